"""Peers in `tandem bench decode`: HF transformers (plain, prompt-lookup and assisted generation) in this
process, onnxruntime-genai (plain and n-gram) and llama.cpp (bench/peers/llama_peer.py) in child processes of the peer
harness's venv.

Same prompts (already chat-templated token ids), greedy, batch 1 (their speculative generation supports no
more), same threads, in the same run as tandem's drafters and interleaved with them prompt by prompt, so
speedups are ratios measured on the same minutes of this machine.
"""
from __future__ import annotations

import atexit
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.child_env import peer_environment
from tandem.errors import InvalidParameterError


def load_hf_causal_lm(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_modes(base, config) -> dict[str, dict]:
    """Generation kwargs per HF mode; assisted only when a draft model was named."""
    modes = {"hf": {}, "hf_prompt_lookup": {"prompt_lookup_num_tokens": config.num_draft_tokens}}
    if config.drafter_model:
        from tandem.models.zoo import resolve_model

        modes["hf_assisted"] = {"assistant_model": load_hf_causal_lm(resolve_model(config.drafter_model))}
    return modes


@dataclass
class PeerOutput:
    token_ids: list[int]
    metrics: dict | None = None  # HF reports no speculation metrics
    count: int | None = None  # tokens generated, where the engine counts them itself (token_ids then recovered from its text)
    seconds: float | None = None  # the engine's own time for the request (prefill + decoding), where the wall clock holds more


def hf_runners(base, config) -> dict:
    """One runner per HF mode, batch 1 (HF's assisted and prompt-lookup generation support no more)."""
    if config.batch_size != 1:
        raise InvalidParameterError("--peers hf needs --batch-size 1 (HF's speculative generation is batch-1 only)")
    hf = load_hf_causal_lm(base.model_dir)
    eos = list(base.target.cfg.eos_token_ids) or None
    return {name: _hf_runner(hf, config.max_tokens, eos, kwargs) for name, kwargs in hf_modes(base, config).items()}


def _hf_runner(hf, max_tokens: int, eos, kwargs):
    return lambda batch: [PeerOutput(_generate(hf, ids, max_tokens, eos, kwargs)) for ids in batch]


def _generate(hf, ids: list[int], max_tokens: int, eos, kwargs) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos[0] if eos else 0, **kwargs)
    return out[0, len(ids) :].tolist()


PEER_CACHE_ENV = "TANDEM_BENCH_CACHE"  # the peer harness's cache root (../shared/peers), default ~/.cache/tandem-peers


def peer_cache() -> Path:
    return Path(os.environ.get(PEER_CACHE_ENV) or Path.home() / ".cache" / "tandem-peers")


def ortg_paths(python: str | None, model: str | None) -> tuple[Path, Path]:
    """The interpreter that has onnxruntime-genai and its fp32 model directory: given, or the peer harness's."""
    py = Path(python) if python else peer_cache() / "env" / "venv" / "bin" / "python"
    model_dir = Path(model) if model else peer_cache() / "models" / "smollm2_onnx_fp32"
    if not py.exists():
        raise InvalidParameterError(f"--peers ortg: no Python at {py} (set up ../shared/peers, or pass --ortg-python)")
    if not (model_dir / "genai_config.json").exists():
        raise InvalidParameterError(f"--peers ortg: {model_dir} is not an onnxruntime-genai model (run the peer harness once, or pass --ortg-model)")
    return py, model_dir


class WorkerPeer:
    """A peer engine in a child process of another Python: one JSON request line in, one JSON reply line out
    (tandem/bench/peers/ortg_worker.py, llama_worker.py). The first line it prints is its ready line."""

    label = "peer"

    def __init__(self, cmd: list[str]):
        self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=peer_environment())
        self.ready = self._read()

    def request(self, payload: dict) -> dict:
        self.process.stdin.write(json.dumps(payload) + "\n")
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"{self.label} peer: {reply['error']}")
        return reply

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label} peer exited (code {self.process.poll()}); its stderr is above")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


class OrtgPeer(WorkerPeer):
    """onnxruntime-genai in a child process (tandem/bench/peers/ortg_worker.py), one JSON line per request."""

    label = "onnxruntime-genai"

    def __init__(self, python: Path, model_dir: Path, threads: int, eos: list[int]):
        worker = Path(__file__).with_name("ortg_worker.py")
        super().__init__([str(python), str(worker), "--model", str(model_dir), "--threads", str(threads), "--eos", ",".join(map(str, eos))])
        self.version = f"onnxruntime-genai {self.ready['ready']}"

    def generate(self, ids: list[int], max_tokens: int, mode: str) -> list[int]:
        return self.request({"ids": ids, "max_tokens": max_tokens, "mode": mode})["token_ids"]


def ortg_runners(base, config) -> dict:
    """`ortg` (plain) and `ortg_ngram` (its prompt lookup) over one child process, batch 1."""
    if config.batch_size != 1:
        raise InvalidParameterError("--peers ortg needs --batch-size 1")
    python, model_dir = ortg_paths(config.ortg_python, config.ortg_model)
    peer = OrtgPeer(python, model_dir, torch.get_num_threads(), sorted(base.target.cfg.eos_token_ids))
    atexit.register(peer.close)

    def runner(mode: str):
        return lambda batch: [PeerOutput(peer.generate(ids, config.max_tokens, mode)) for ids in batch]

    return {"ortg": runner("plain"), "ortg_ngram": runner("ngram")}
