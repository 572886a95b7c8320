"""llama.cpp's own C++ tools as runners of `tandem bench decode --peers llama` (built by `tandem peers setup llama-cpp`,
tandem/bench/peers/llama_build.py): what a user of llama.cpp runs, not the Python binding.

Runners, each one tool process per prompt (greedy: `--temp 0`; the KV cache starts empty; tandem's threads):
  llama_cli                   `llama-completion -no-cnv`: plain decoding
  llama_spec_dN_mM_pP         `llama-speculative-simple --spec-type draft-simple -md DRAFT --spec-draft-n-max N
                              --spec-draft-n-min M --spec-draft-p-min P` (without --spec-type it drafts nothing and exits): speculative decoding with a draft model, through common_speculative,
                              the code llama-server runs for `--model-draft` (`llama-speculative`, the older tree variant,
                              ignores the draft minimum and min probability)
  llama_lookup_dN             `llama-lookup --spec-draft-n-max N`: its n-gram cache (lookup decoding), no draft model

The tools take text, so each prompt's ids are decoded to text (special tokens kept) and passed verbatim (`-p`,
`--no-escape`: `-f` would drop a trailing newline, the chat template's last token); `llama-tokenize` checks once per
prompt that the GGUF reads that text as the same ids. The tools print text, not ids: a runner's ids are its output
re-tokenized by tandem's tokenizer (the same vocabulary, checked), cut at max tokens and the first EOS, used only for
the greedy comparison. Tokens and time are the tools' own figures: tokens generated (the speculative tools stop one
round past --n-predict, so a request can hold a few more) over the prompt evaluation plus the decoding they time (the
process start and the model load are left out, as tandem's runners load once); decoding alone is in the metrics too
(`decode_tokens`, `decode_s`). Acceptance: the tools report drafted and accepted tokens, not their verify rounds, so
`steps` is the verify rounds implied, each emitting its accepted drafts and one token of its own, the first token
counted as the prefill's (tokens - 1 - accepted, tandem's convention).
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.peers.peers import PeerOutput
from tandem.child_env import peer_environment

TOOLS = {"cli": "llama-completion", "spec": "llama-speculative-simple", "lookup": "llama-lookup"}
END_OF_TEXT = " [end of text]\n"  # llama-completion's line after an EOS (the EOS itself prints as nothing)
TRAILER = "\n\n"  # the speculative tools' stdout: "\n\n" + prompt + generated text + "\n\n" (+ "\n\n" after the stats)


@dataclass(frozen=True)
class ToolMode:
    """One llama.cpp tool configuration: a runner."""

    mode: str  # cli / spec / lookup
    draft_max: int = 0  # spec, lookup: --spec-draft-n-max
    draft_min: int = 0  # spec: --spec-draft-n-min
    p_min: float = 0.0  # spec: --spec-draft-p-min (a draft stops at a token the draft model is less sure of)

    @property
    def name(self) -> str:
        if self.mode == "spec":
            return f"llama_spec_d{self.draft_max}_m{self.draft_min}_p{self.p_min:g}"
        return f"llama_lookup_d{self.draft_max}" if self.mode == "lookup" else "llama_cli"


def command(tool: Path, mode: ToolMode, gguf: Path, draft: Path | None, prompt: str, max_tokens: int, threads: int,
            n_ctx: int) -> list[str]:
    """The tool's argv for one prompt."""
    cmd = [str(tool), "-m", str(gguf), "-p", prompt, "--no-escape", "-n", str(max_tokens), "-c", str(n_ctx),
           "-t", str(threads), "-tb", str(threads), "--temp", "0", "--seed", "0"]
    if mode.mode == "cli":
        return cmd + ["-no-cnv", "--no-display-prompt"]
    cmd += ["--spec-draft-n-max", str(mode.draft_max)]
    if mode.mode == "spec":
        cmd += ["--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-min", str(mode.draft_min), "--spec-draft-p-min", f"{mode.p_min:g}",
                "-td", str(threads), "-tbd", str(threads)]
    return cmd


def _number(pattern: str, text: str, what: str, cast=float):
    found = re.search(pattern, text)
    if found is None:
        raise RuntimeError(f"llama.cpp tool output: no {what} (pattern {pattern!r}) in its log")
    return tuple(cast(g) for g in found.groups()) if len(found.groups()) > 1 else cast(found.group(1))


def parse_timings(mode: str, log: str) -> dict:
    """{"prompt_s", "decode_s", "decode_tokens", "tokens", and for spec / lookup "drafted", "accepted"} from a tool's log."""
    if mode == "cli":
        prompt_ms, _ = _number(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", log, "prompt eval time")
        eval_ms, runs = _number(r"\w+:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs", log, "eval time")
        # the first token comes from the prompt's logits; each later one is one eval run (the last, EOS or not, is not evaluated)
        return {"prompt_s": prompt_ms / 1e3, "decode_s": eval_ms / 1e3, "decode_tokens": int(runs), "tokens": int(runs) + 1}
    _, prompt_s = _number(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", log, "'encoded' line")
    decoded, decode_s = _number(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log, "'decoded' line")
    return {"prompt_s": prompt_s, "decode_s": decode_s, "decode_tokens": int(decoded), "tokens": int(decoded),
            "drafted": int(_number(r"n_drafted\s*=\s*(\d+)", log, "n_drafted")),
            "accepted": int(_number(r"n_accept\s*=\s*(\d+)", log, "n_accept"))}


def generated_text(mode: str, stdout: str, prompt: str) -> tuple[str, bool]:
    """(the generated text, whether the tool printed its end-of-text marker) from a tool's stdout."""
    if mode == "cli":  # llama-completion ends its stdout with "\n\n" whether or not it stopped at an EOS
        text = stdout.removesuffix(TRAILER)
        return (text[: -len(END_OF_TEXT)], True) if text.endswith(END_OF_TEXT) else (text, False)
    head = TRAILER + prompt
    if not stdout.startswith(head):
        raise RuntimeError(f"llama.cpp {TOOLS[mode]}: its output does not start with the prompt: {stdout[:120]!r}")
    text = stdout[len(head):]
    for _ in range(2):
        text = text.removesuffix(TRAILER)
    return text, False


def system_info(log: str) -> str:
    """The `system_info:` line every tool logs at start (the CPU features its ggml build uses)."""
    found = re.search(r"system_info: (.*)$", log, re.M)  # log lines carry a time and level prefix: not anchored
    return found.group(1).strip() if found else ""


class ToolRunner:
    """Runs one ToolMode per prompt; text <-> ids through tandem's tokenizer (checked against the GGUF's)."""

    def __init__(self, tool: Path, mode: ToolMode, gguf: Path, draft: Path | None, tokenizer, eos: list[int],
                 threads: int, n_ctx: int):
        self.tool, self.mode, self.gguf, self.draft = tool, mode, gguf, draft
        self.tokenizer, self.eos, self.threads, self.n_ctx = tokenizer, set(eos), threads, n_ctx
        end = getattr(tokenizer, "eos_token_id", None)
        self.end_id = end if end in self.eos else min(eos)  # the EOS an instruct model ends its turn with
        self.system_info = ""

    def __call__(self, batch: list[list[int]], max_tokens: int) -> list[PeerOutput]:
        return [self.generate(ids, max_tokens) for ids in batch]

    def generate(self, ids: list[int], max_tokens: int) -> PeerOutput:
        prompt = self.tokenizer.decode(ids, skip_special_tokens=False)
        cmd = command(self.tool, self.mode, self.gguf, self.draft, prompt, max_tokens, self.threads, self.n_ctx)
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=peer_environment())
        if done.returncode != 0:
            raise RuntimeError(f"llama.cpp {self.tool.name} exited {done.returncode}: {done.stderr.strip()[-600:]}")
        self.system_info = self.system_info or system_info(done.stderr)
        timings = parse_timings(self.mode.mode, done.stderr)
        text, ended = generated_text(self.mode.mode, done.stdout, prompt)
        # llama-completion marks an EOS stop; the speculative tools stop one round past max_tokens unless an EOS came first
        stopped = ended if self.mode.mode == "cli" else timings["tokens"] <= max_tokens
        out_ids = self.ids_of(text, stopped, max_tokens)
        return PeerOutput(out_ids, self.metrics(timings), count=timings["tokens"],
                          seconds=timings["prompt_s"] + timings["decode_s"])

    def ids_of(self, text: str, stopped: bool, max_tokens: int) -> list[int]:
        """The output's ids: its text re-tokenized, up to the first EOS and max_tokens; a stop before max_tokens whose EOS
        the tool did not print gets it back (tandem's runners return the EOS)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        cut = next((i + 1 for i, t in enumerate(ids) if t in self.eos), len(ids))
        ids = ids[: min(cut, max_tokens)]
        if stopped and len(ids) < max_tokens and not (ids and ids[-1] in self.eos):
            ids.append(self.end_id)
        return ids

    def metrics(self, timings: dict) -> dict | None:
        if self.mode.mode == "cli":
            return {"decode_tokens": timings["decode_tokens"], "decode_s": timings["decode_s"]}
        steps = max(timings["tokens"] - 1 - timings["accepted"], 1)
        return {"steps": steps, "drafted_tokens": timings["drafted"], "accepted_tokens": timings["accepted"],
                "draft_time_s": 0.0, "mean_draft_length": timings["drafted"] / steps,
                "decode_tokens": timings["decode_tokens"], "decode_s": timings["decode_s"]}


def llama_tokenize(tool: Path, gguf: Path, text: str) -> list[int]:
    """The GGUF's ids for `text` (special tokens parsed, as the generating tools parse their prompt)."""
    done = subprocess.run([str(tool), "-m", str(gguf), "-p", text, "--no-escape", "--ids", "--log-disable"],
                          capture_output=True, text=True, errors="replace")
    if done.returncode != 0:
        raise RuntimeError(f"llama-tokenize exited {done.returncode}: {done.stderr.strip()[-400:]}")
    found = re.search(r"\[([\d,\s]*)\]\s*$", done.stdout)
    if found is None:
        raise RuntimeError(f"llama-tokenize printed no id list: {done.stdout[-200:]!r}")
    return [int(t) for t in found.group(1).replace(",", " ").split()]


def tool_modes(config, modes: list[str]) -> list[ToolMode]:
    """The ToolModes of --llama-modes: plain, one per --llama-spec setting, one per --llama-lookup length."""
    out = [ToolMode("cli")] if "cli" in modes else []
    if "spec" in modes:
        out += [ToolMode("spec", n_max, n_min, p_min) for n_max, n_min, p_min in config.llama_spec]
    if "lookup" in modes:
        out += [ToolMode("lookup", n_max) for n_max in config.llama_lookup]
    return out


def tool_runners(config, gguf: Path, draft: Path | None, eos: list[int], n_ctx: int, threads: int, modes: list[str],
                 tokenizer, token_ids: list[list[int]], info: dict) -> dict:
    """A runner per ToolMode; every prompt checked to tokenize the same in the GGUF; the build and its version in `info`."""
    from tandem.bench.peers import llama_build
    from tandem.errors import InvalidParameterError

    for ids in token_ids:
        theirs = llama_tokenize(llama_build.tool("llama-tokenize"), gguf, tokenizer.decode(ids, skip_special_tokens=False))
        if theirs != list(ids):
            raise InvalidParameterError(f"--llama-gguf: the GGUF reads a prompt's text as {theirs[:12]}..., tandem's ids are "
                                        f"{list(ids)[:12]}...: not the same vocabulary (use the GGUF of the model tandem loads)")
    runners = {}
    for mode in tool_modes(config, modes):
        tool = llama_build.tool(TOOLS[mode.mode])
        run = ToolRunner(tool, mode, gguf, draft, tokenizer, eos, threads, n_ctx)
        runners[mode.name] = (lambda r: lambda batch: r(batch, config.max_tokens))(run)
        info.setdefault("tools", {})[mode.name] = {"tool": tool.name, **{k: v for k, v in vars(mode).items() if k != "mode"}}
    probe = ToolRunner(llama_build.tool("llama-completion"), ToolMode("cli"), gguf, None, tokenizer, eos, threads, n_ctx)
    probe.generate(token_ids[0][:8], 1)
    info["version"] = llama_build.tool_version(llama_build.tool("llama-completion"))
    info["build"] = llama_build.built_info()
    info["system_info"] = probe.system_info
    return runners
