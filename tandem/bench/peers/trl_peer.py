"""`tandem bench rl-trl`: `tandem rl` side by side with TRL's GRPOTrainer at equal settings, in one invocation.

Both train the same model directory on the same problems in the same order: tandem's `ReasoningEnv` makes each
step's training problems and the held-out set, and they are exported as JSONL (chat messages, task, reference
answer, the generator's entry, the prompt's token ids) for TRL's side, which scores with the same reasoning-gym
scorer (`extract_answer` + the task's `score_answer`, on a dataset rebuilt from the exported task settings and
seed). Each side runs in its own process with the same thread count, one after the other (tandem first):
`python -m tandem.cli rl` here, and tandem/bench/peers/trl_worker.py in TRL's own venv (created on demand under the
peer cache, torch pinned so pip never swaps in a CUDA build). Reported: step wall time (mean, and without the
first step), their ratio, the reward and completion length per step, and the greedy held-out reward at the start
and the end with 95 % Wilson intervals.

Settings TRL cannot match exactly are listed in the report's "differences" (sampling streams, std estimator).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.bench.peers.peers import peer_cache
from tandem.errors import InvalidParameterError

TORCH_PIN = "torch==2.13.0"  # on every pip line: an unpinned torch would pull a multi-GB CUDA build
TRL_PINS = ("trl==1.16.0", "reasoning-gym==0.1.25")
# tandem's loss aggregations and TRL's loss_type of the same math
LOSS_TYPES = {"seq_mean_token_mean": "grpo", "token_mean": "dapo", "seq_mean_token_sum_norm": "dr_grpo"}
DIFFERENCES = (
    "sampling: each side draws its own random streams (same prompts and order, different samples)",
    "advantages: tandem divides by the group's population std, TRL by the sample std (both + 1e-4)",
    "tandem skips zero-advantage samples in forward/backward unless --no-skip-zero-advantage (same loss with no KL term); TRL computes them",
    "rollouts: tandem's engine with speculative decoding; TRL's transformers generate (no vLLM)",
)


@dataclass(frozen=True)
class TrlCompareConfig:
    model: str = "smollm2-135m"
    steps: int = 10
    prompts_per_step: int = 4
    group_size: int = 8
    max_tokens: int = 256
    temperature: float = 1.0
    lr: float = 5e-6
    loss_agg: str = "seq_mean_token_mean"
    scale_adv_by_std: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.2
    micro_batch: int = 8
    eval_problems: int = 64
    seed: int = 0
    threads: int = 2
    drafter: str = "ngram"  # tandem's rollout drafter (as `tandem rl --drafters`; NAME@fixed = always speculate)
    task: str = ""  # comma list of reasoning-gym tasks ("" = tandem's default mix)
    task_kwargs: str = ""  # JSON, as `tandem rl --task-kwargs`
    demonstration: bool = True  # the one-shot worked example before each question (as `tandem rl`; False = --no-demonstration)
    skip_zero_advantage: bool = True  # tandem skips zero-advantage samples in its backward (same loss); False: it computes them, as TRL does
    trl_python: str | None = None  # an interpreter with trl; default: the peer cache's venv-trl (made on demand)

    def __post_init__(self) -> None:
        if self.loss_agg not in LOSS_TYPES:
            raise InvalidParameterError(f"loss_agg must be one of {sorted(LOSS_TYPES)}, got {self.loss_agg!r}")
        if self.threads < 1 or self.eval_problems < 1:
            raise InvalidParameterError("need threads >= 1 and eval_problems >= 1")
        if (self.prompts_per_step * self.group_size) % self.micro_batch:
            raise InvalidParameterError("micro_batch must divide prompts_per_step * group_size (TRL's per-device batch)")

    def grpo(self):
        """tandem's GRPOConfig for these settings (one optimiser step per rollout batch, no KL, eval at start and end)."""
        from tandem.rl.command import env_config
        from tandem.rl.grpo import GRPOConfig

        return GRPOConfig(steps=self.steps, prompts_per_step=self.prompts_per_step, group_size=self.group_size, max_tokens=self.max_tokens,
                          temperature=self.temperature, lr=self.lr, clip_low=self.clip_low, clip_high=self.clip_high, loss_agg=self.loss_agg,
                          scale_adv_by_std=self.scale_adv_by_std, micro_batch=self.micro_batch, eval_problems=self.eval_problems,
                          eval_every=self.steps, seed=self.seed, env=env_config(self.task, self.task_kwargs, self.demonstration),
                          skip_zero_advantage=self.skip_zero_advantage)


# ---- the problems, exported -----------------------------------------------------------------------------------
def export_records(cfg, tokenizer=None) -> list[dict]:
    """A meta line, then every training problem in step order (as GRPOTrainer draws them), then the held-out set."""
    from tandem.rl.envs import SEED_SPAN, ReasoningEnv

    env = ReasoningEnv(cfg.env, seed=cfg.seed, held_out_size=cfg.eval_problems)
    records = [{"kind": "meta", "env": cfg.env.as_dict(), "seed": cfg.seed, "train_seed_base": 2 * cfg.seed * SEED_SPAN, "size": SEED_SPAN,
                "steps": cfg.steps, "prompts_per_step": cfg.prompts_per_step}]

    def record(kind: str, step: int | None, slot: int, problem) -> dict:
        out = {"kind": kind, "step": step, "slot": slot, "task": problem.task, "index": problem.index, "answer": problem.answer,
               "messages": env.messages(problem), "entry": problem.entry}
        return out | ({"prompt_ids": env.render(problem, tokenizer)} if tokenizer is not None else {})

    for step in range(cfg.steps):  # the trainer's own draw (GRPOTrainer.step_problems calls the same)
        records += [record("train", step, k, p) for k, p in enumerate(env.step_problems(step, cfg.prompts_per_step))]
    records += [record("held_out", None, j, p) for j, p in enumerate(env.held_out)]
    return records


def write_jsonl(records: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


# ---- TRL's venv ---------------------------------------------------------------------------------------------------
def trl_venv() -> Path:
    return peer_cache() / "env" / "venv-trl"


def ensure_trl_venv(venv: Path | None = None, log=sys.stderr) -> Path:
    """The venv's python; made (python -m venv, torch first, then trl + reasoning-gym, torch pinned) when missing."""
    venv = venv or trl_venv()
    python = venv / "bin" / "python"
    if python.exists() and _imports(python, "trl", "reasoning_gym"):
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = ([sys.executable, "-m", "venv", str(venv)],) if not python.exists() else ()
    steps += ([str(python), "-m", "pip", "install", TORCH_PIN], [str(python), "-m", "pip", "install", TORCH_PIN, *TRL_PINS])
    for cmd in steps:
        print(f"[rl-trl] $ {' '.join(cmd)}", file=log, flush=True)
        if subprocess.run(cmd, stdout=log, stderr=log).returncode:
            raise RuntimeError(f"setting up TRL's venv failed: {' '.join(cmd)}")
    torch_version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True).stdout.strip()
    if not torch_version.startswith(TORCH_PIN.split("==")[1]):
        raise RuntimeError(f"pip replaced torch in {venv}: {torch_version}")
    freeze = subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    Path(f"{venv}.freeze.txt").write_text(freeze)
    return python


def _imports(python: Path, *modules: str) -> bool:
    return subprocess.run([str(python), "-c", f"import {', '.join(modules)}"], capture_output=True).returncode == 0


# ---- the two sides ------------------------------------------------------------------------------------------------
def _child_env(threads: int) -> dict:
    return os.environ | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}


def tandem_command(cfg: TrlCompareConfig, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "tandem.cli", "rl", "--model", cfg.model, "--drafters", cfg.drafter, "--steps", str(cfg.steps),
           "--prompts-per-step", str(cfg.prompts_per_step), "--group-size", str(cfg.group_size), "--max-tokens", str(cfg.max_tokens),
           "--temperature", str(cfg.temperature), "--lr", str(cfg.lr), "--loss-agg", cfg.loss_agg, "--clip-low", str(cfg.clip_low),
           "--clip-high", str(cfg.clip_high), "--micro-batch", str(cfg.micro_batch), "--eval-problems", str(cfg.eval_problems),
           "--eval-every", str(cfg.steps), "--seed", str(cfg.seed), "--threads", str(cfg.threads), "--json", str(out)]
    cmd += ["--no-std-norm"] if not cfg.scale_adv_by_std else []
    cmd += ["--task", cfg.task] if cfg.task else []
    cmd += [] if cfg.demonstration else ["--no-demonstration"]
    cmd += [] if cfg.skip_zero_advantage else ["--no-skip-zero-advantage"]
    return cmd + (["--task-kwargs", cfg.task_kwargs] if cfg.task_kwargs else [])


def trl_command(cfg: TrlCompareConfig, python: Path, model_dir: Path, problems: Path, out: Path) -> list[str]:
    worker = Path(__file__).with_name("trl_worker.py")
    return [str(python), str(worker), "--model", str(model_dir), "--problems", str(problems), "--out", str(out),
            "--group-size", str(cfg.group_size), "--max-tokens", str(cfg.max_tokens), "--temperature", str(cfg.temperature),
            "--lr", str(cfg.lr), "--loss-type", LOSS_TYPES[cfg.loss_agg], "--scale-rewards", "group" if cfg.scale_adv_by_std else "none",
            "--epsilon", str(cfg.clip_low), "--epsilon-high", str(cfg.clip_high), "--micro-batch", str(cfg.micro_batch),
            "--seed", str(cfg.seed), "--threads", str(cfg.threads)]


def check_drafter(spec: str) -> None:
    """Before anything runs: the drafter is "ar" or registered (as `tandem rl --drafters` takes it)."""
    import tandem.drafters  # noqa: F401  (registers the built-in drafters)
    from tandem.drafters.base import registered
    from tandem.rl.setup import FIXED

    name = spec[: -len(FIXED)] if spec.endswith(FIXED) else spec
    if name != "ar" and name not in registered():
        raise InvalidParameterError(f"--drafter {spec!r}: not ar or one of {', '.join(registered())}")


def _run_child(cmd: list[str], threads: int, what: str) -> float:
    print(f"[rl-trl] {what}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    code = subprocess.run(cmd, env=_child_env(threads), stdout=sys.stderr).returncode
    if code:
        raise RuntimeError(f"{what} exited with code {code}")
    return time.perf_counter() - t0


def tandem_side(result: dict) -> dict:
    """tandem rl's JSON -> the common shape: per-step curve and greedy held-out reward at the start and the end."""
    steps = [{"step": h["step"], "wall_s": h["step_wall_s"], "reward_mean": h["reward_mean"], "completion_tokens_mean": h["completion_tokens_mean"]}
             for h in result["history"]]
    evals = result["evals"]

    def held(e: dict) -> dict:
        return {"reward": e["greedy"], "ci95": list(e["greedy_ci95"]), "problems": e["problems"], "tokens_mean": e["greedy_tokens_mean"]}

    return {"steps": steps, "held_out_start": held(evals[0]), "held_out_end": held(evals[-1])}


def trl_side(result: dict) -> dict:
    """The worker's JSON -> the common shape (Wilson intervals computed here, from its per-problem rewards)."""
    from tandem.rl.envs import wilson_interval

    def held(e: dict) -> dict:
        r = e["rewards"]
        return {"reward": sum(r) / len(r), "ci95": [round(x, 4) for x in wilson_interval(sum(r), len(r))], "problems": len(r),
                "tokens_mean": e["tokens_mean"]}

    return {"steps": result["steps"], "held_out_start": held(result["held_out_start"]), "held_out_end": held(result["held_out_end"]),
            "versions": result["versions"], "prompt_ids_match": result.get("prompt_ids_match")}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def compare(tandem: dict, trl: dict) -> dict:
    """Step wall time per side (all steps, and without the first), the ratio TRL / tandem, and the curves side by side."""
    out: dict = {"step_wall_s": {}, "held_out": {}}
    for name, side in (("tandem", tandem), ("trl", trl)):
        walls = [s["wall_s"] for s in side["steps"]]
        out["step_wall_s"][name] = {"mean": _mean(walls), "mean_after_first": _mean(walls[1:]), "total": sum(walls)}
        out["held_out"][name] = {"start": side["held_out_start"], "end": side["held_out_end"]}
    t, r = out["step_wall_s"]["tandem"], out["step_wall_s"]["trl"]
    out["speedup"] = {k: (r[k] / t[k] if t[k] and r[k] else None) for k in ("mean", "mean_after_first")}
    out["curve"] = [{"step": a["step"], "tandem_reward": a["reward_mean"], "trl_reward": b["reward_mean"], "tandem_tokens": a["completion_tokens_mean"],
                     "trl_tokens": b["completion_tokens_mean"], "tandem_wall_s": a["wall_s"], "trl_wall_s": b["wall_s"]}
                    for a, b in zip(tandem["steps"], trl["steps"])]
    return out


def markdown(report: dict) -> str:
    """A short table: step time and held-out reward per side, then the per-step curve."""
    c = report["comparison"]
    w, h = c["step_wall_s"], c["held_out"]

    def f(x, nd=2):
        return "n/a" if x is None else f"{x:.{nd}f}"

    def held(e: dict) -> str:
        return f"{e['reward']:.3f} [{e['ci95'][0]:.3f}, {e['ci95'][1]:.3f}]"

    lines = [f"GRPO step wall time and held-out reward (greedy, 95 % Wilson interval, {h['tandem']['start']['problems']} problems), "
             f"{report['settings']['steps']} steps", "",
             "| | step wall s (mean) | without step 0 | held-out start | held-out end |", "|---|---:|---:|---:|---:|"]
    for name in ("tandem", "trl"):
        lines.append(f"| {name} | {f(w[name]['mean'])} | {f(w[name]['mean_after_first'])} | {held(h[name]['start'])} | {held(h[name]['end'])} |")
    lines.append(f"| TRL / tandem | {f(c['speedup']['mean'])}x | {f(c['speedup']['mean_after_first'])}x | | |")
    lines += ["", "| step | tandem reward | TRL reward | tandem tokens | TRL tokens | tandem s | TRL s |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in c["curve"]:
        lines.append(f"| {row['step']} | {f(row['tandem_reward'], 3)} | {f(row['trl_reward'], 3)} | {f(row['tandem_tokens'], 1)} | "
                     f"{f(row['trl_tokens'], 1)} | {f(row['tandem_wall_s'])} | {f(row['trl_wall_s'])} |")
    return "\n".join(lines) + "\n"


def run_rl_trl_bench(cfg: TrlCompareConfig, work_dir: Path | None = None) -> dict:
    """Export the problems, run `tandem rl`, then TRL's worker, each in its own process; the combined report."""
    import torch

    from tandem.bench.machine import machine_info
    from tandem.llm import load_tokenizer
    from tandem.models.zoo import resolve_model
    from tandem.rl.report import timestamp

    check_drafter(cfg.drafter)
    python = Path(cfg.trl_python) if cfg.trl_python else ensure_trl_venv()
    if not python.exists():
        raise InvalidParameterError(f"--trl-python: no interpreter at {python}")
    model_dir = resolve_model(cfg.model)
    grpo = cfg.grpo()
    work = Path(work_dir or tempfile.mkdtemp(prefix="tandem-rl-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    problems = work / "problems.jsonl"
    write_jsonl(export_records(grpo, load_tokenizer(model_dir)), problems)
    started = timestamp()
    tandem_s = _run_child(tandem_command(cfg, work / "tandem.json"), cfg.threads, "tandem rl")
    trl_s = _run_child(trl_command(cfg, python, model_dir, problems, work / "trl.json"), cfg.threads, "TRL GRPOTrainer")
    tandem_raw = json.loads((work / "tandem.json").read_text())
    trl_raw = json.loads((work / "trl.json").read_text())
    tandem, trl = tandem_side(tandem_raw), trl_side(trl_raw)
    torch.set_num_threads(cfg.threads)
    return {"command": "tandem bench rl-trl", "started": started, "finished": timestamp(), "settings": asdict(cfg), "model_dir": str(model_dir),
            "machine": machine_info(), "versions": {"tandem_torch": torch.__version__, "trl_side": trl["versions"]},
            "process_wall_s": {"tandem": tandem_s, "trl": trl_s}, "trl_settings": trl_raw.get("settings"),
            "prompt_ids_match": trl["prompt_ids_match"], "differences": list(DIFFERENCES), "work_dir": str(work),
            "comparison": compare(tandem, trl), "tandem": tandem, "trl": {k: v for k, v in trl.items() if k != "versions"}}


# ---- CLI ----------------------------------------------------------------------------------------------------------
def add_bench_rl_trl_command(bench) -> None:
    p = bench.add_parser("rl-trl", help="tandem rl vs TRL's GRPOTrainer at equal settings (step time, reward curves)")
    d = TrlCompareConfig()
    p.add_argument("--model", default=d.model)
    for flag, value in (("steps", d.steps), ("prompts-per-step", d.prompts_per_step), ("group-size", d.group_size), ("max-tokens", d.max_tokens),
                        ("micro-batch", d.micro_batch), ("eval-problems", d.eval_problems), ("seed", d.seed), ("threads", d.threads)):
        p.add_argument(f"--{flag}", type=int, default=value)
    for flag, value in (("temperature", d.temperature), ("lr", d.lr), ("clip-low", d.clip_low), ("clip-high", d.clip_high)):
        p.add_argument(f"--{flag}", type=float, default=value)
    p.add_argument("--loss-agg", default=d.loss_agg, choices=sorted(LOSS_TYPES))
    p.add_argument("--no-std-norm", action="store_true", help="Dr. GRPO advantages (TRL: scale_rewards='none')")
    p.add_argument("--drafter", default=d.drafter, help="tandem's rollout drafter")
    p.add_argument("--task", default="")
    p.add_argument("--task-kwargs", default="")
    p.add_argument("--no-demonstration", action="store_true", help="zero-shot prompts on both sides")
    p.add_argument("--no-skip-zero-advantage", action="store_true",
                   help="tandem computes zero-advantage samples in its backward too, as TRL does (equal learner work)")
    p.add_argument("--trl-python", default=None, help="an interpreter with trl (default: venv-trl under the peer cache, made on demand)")
    p.add_argument("--work-dir", default=None, help="where the problems and each side's raw JSON go (default: a temporary directory)")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--markdown", default=None, help="also write the table here")
    p.set_defaults(func=_run)


def _run(args) -> int:
    cfg = TrlCompareConfig(model=args.model, steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                           max_tokens=args.max_tokens, temperature=args.temperature, lr=args.lr, loss_agg=args.loss_agg,
                           scale_adv_by_std=not args.no_std_norm, clip_low=args.clip_low, clip_high=args.clip_high, micro_batch=args.micro_batch,
                           eval_problems=args.eval_problems, seed=args.seed, threads=args.threads, drafter=args.drafter, task=args.task,
                           task_kwargs=args.task_kwargs, demonstration=not args.no_demonstration, trl_python=args.trl_python,
                           skip_zero_advantage=not args.no_skip_zero_advantage)
    report = run_rl_trl_bench(cfg, Path(args.work_dir) if args.work_dir else None)
    table = markdown(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table)
    print(table)
    return 0
