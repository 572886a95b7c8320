"""`tandem bench batch`: tokens/s per batch size for plain decoding, each drafter at each fixed k, and the
speculation controller, next to what the calibrated cost model predicts.

Each batch size B runs one wave of B prompts (greedy, ignore_eos, the same max_tokens, so the batch stays
B until the end) through every runner in turn over the same loaded target. Predictions come from the
calibration record (`tandem calibrate`) and the acceptance per position each fixed-k run measured:
tok/s = B * E(k) / (draft(k) + forward(B, 1 + k, C)). Ratios (speedup vs plain) are what to compare:
absolute rates move with the machine's load.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from tandem.bench.machine import machine_info
from tandem.data.prompts import load_prompts, render_chat
from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError
from tandem.sim.calibration import Calibration
from tandem.sim.roofline import forward_seconds
from tandem.sim.speculative import DraftCost


@dataclass(frozen=True)
class BatchBenchConfig:
    model: str = "smollm2-135m"
    drafters: tuple[str, ...] = ("ngram", "self_draft")
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    ks: tuple[int, ...] = (2, 4)  # fixed draft lengths to run (the controller may use up to max(ks))
    max_tokens: int = 32
    prompts: str = "builtin"
    drafter_path: str | None = None
    max_model_len: int = 512  # KV cache per request in every runner

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1 or not self.ks or min(self.ks) < 1 or self.max_tokens < 2:
            raise InvalidParameterError("batch sizes and ks must be >= 1, max_tokens >= 2")


def run_batch_bench(config: BatchBenchConfig, calibration: Calibration | None = None) -> dict:
    from tandem.llm import LLM

    # every runner holds a KV cache of max batch x max_model_len: keep it small (prompts that don't fit are skipped)
    base = LLM(model=config.model, max_batch_size=max(config.batch_sizes), max_model_len=config.max_model_len)
    prompts = render_chat(interleave_domains(load_prompts(config.prompts, split="test" if config.prompts == "builtin" else "all")), base.tokenizer)
    prompts = [p for p in prompts if len(p) + config.max_tokens < config.max_model_len]
    if not prompts:
        raise InvalidParameterError(f"no prompt fits max_model_len {config.max_model_len} with {config.max_tokens} new tokens")
    runners = {"plain": base}
    for name in config.drafters:
        for k in config.ks:
            runners[f"{name} k={k}"] = base.with_drafter(name, k, drafter_path=config.drafter_path)
        runners[f"{name} controller"] = base.with_drafter(name, max(config.ks), drafter_path=config.drafter_path, adaptive_k=True)
    params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0, ignore_eos=True)
    for llm in runners.values():
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    rows = []
    for batch in config.batch_sizes:
        wave = [prompts[i % len(prompts)] for i in range(batch)]
        for name, llm in runners.items():
            rows.append(_measure(name, llm, wave, params))
        _add_speedups(rows, batch)
    context = round(sum(len(p) for p in prompts[:max(config.batch_sizes)]) / min(len(prompts), max(config.batch_sizes)) + config.max_tokens / 2)
    if calibration is not None:
        add_predictions(rows, calibration, context)
    return {"config": asdict(config), "machine": machine_info(), "context": context, "rows": rows}


def _measure(name: str, llm, wave: list[list[int]], params: SamplingParams) -> dict:
    policy = llm.engine.draft_policy
    before = policy.metrics() if policy is not None else None
    start = time.perf_counter()
    outs = llm.generate(wave, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    steps = sum(o.metrics["steps"] for o in outs)
    drafts = sum(o.metrics["drafts"] for o in outs)
    accepted = _sum_lists([o.metrics["accepted_per_position"] for o in outs])
    drafted = _sum_lists([o.metrics["drafted_per_position"] for o in outs])
    row = {"runner": name, "batch": len(wave), "tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 2),
           "acceptance_length": round((tokens - len(wave)) / steps, 3) if steps else None,
           "draft_fill": round(drafts / steps, 4) if steps else 0.0,
           "reach_per_position": [round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted)]}
    if policy is not None:
        row["controller"] = _wave_metrics(before, policy.metrics())
    return row


def _wave_metrics(before: dict, after: dict) -> dict:
    """The controller persists across waves (as in a server): report this wave's decisions only."""
    out = {key: after[key] - before[key] for key in ("speculative_steps", "steps", "probes", "switches")}
    hist = {k: v - before["shape_rows"].get(k, 0) for k, v in after["shape_rows"].items()}
    out["shape_rows"] = {k: v for k, v in hist.items() if v}
    out["speculating_at_end"] = after["speculating"]
    out["acceptance_per_position"] = after["acceptance_per_position"]
    return out


def _sum_lists(lists: list[list[int]]) -> list[int]:
    out: list[int] = []
    for values in lists:
        out += [0] * (len(values) - len(out))
        for i, v in enumerate(values):
            out[i] += v
    return out


def _add_speedups(rows: list[dict], batch: int) -> None:
    here = [r for r in rows if r["batch"] == batch]
    plain = next(r for r in here if r["runner"] == "plain")["tok_s"]
    for r in here:
        r["speedup"] = round(r["tok_s"] / plain, 3)


def add_predictions(rows: list[dict], calibration: Calibration, context: int) -> None:
    """Predicted tok/s and speedup for plain and each fixed k (from that run's measured reach per
    position: u_j = P(the first j drafted tokens accepted)); the controller's prediction is the best of them."""
    forward = lambda b, t: forward_seconds(calibration.work, calibration.machine, b, t, context)  # noqa: E731
    for r in rows:
        b = r["batch"]
        plain = b / forward(b, 1)
        if r["runner"] == "plain":
            r["predicted_tok_s"], r["predicted_speedup"] = round(plain, 2), 1.0
        elif " k=" in r["runner"]:
            name, k = r["runner"].split(" k=")
            draft = calibration.drafters.get(name, DraftCost())
            rate = predicted_rate(forward, draft, b, int(k), r["reach_per_position"], r["draft_fill"])
            r["predicted_tok_s"], r["predicted_speedup"] = round(rate, 2), round(rate / plain, 3)
    for r in rows:
        if r["runner"].endswith(" controller"):
            name = r["runner"][: -len(" controller")]
            same = [x for x in rows if x["batch"] == r["batch"] and (x["runner"] == "plain" or x["runner"].startswith(f"{name} k="))]
            best = max(same, key=lambda x: x["predicted_tok_s"])
            r["predicted_tok_s"], r["predicted_speedup"] = best["predicted_tok_s"], best["predicted_speedup"]


def predicted_rate(forward, draft: DraftCost, batch: int, k: int, reach: list[float], fill: float = 1.0) -> float:
    """reach[j] = P(the first j + 1 drafted tokens accepted | a draft was made); fill = the fraction of
    request-steps that got a draft (lookup drafters find none on some steps)."""
    tokens = 1.0 + fill * sum(reach[:k])  # E(k) = 1 + sum_j P(first j accepted)
    wide = 1 - (1 - fill) ** batch  # the verify is 1 + k wide if any row drafted
    seconds = draft.seconds(k, batch * k, batch) + wide * forward(batch, 1 + k) + (1 - wide) * forward(batch, 1)
    return batch * tokens / seconds


def format_table(report: dict) -> str:
    batches = sorted({r["batch"] for r in report["rows"]})
    runners = list(dict.fromkeys(r["runner"] for r in report["rows"]))
    cell = {(r["runner"], r["batch"]): r for r in report["rows"]}
    lines = ["| runner | " + " | ".join(f"B={b} tok/s (x plain; predicted x)" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for name in runners:
        cells = []
        for b in batches:
            r = cell[(name, b)]
            pred = f"; {r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else ""
            cells.append(f"{r['tok_s']:.1f} ({r['speedup']:.2f}x{pred})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    runners = list(dict.fromkeys(r["runner"] for r in report["rows"]))
    for name in runners:
        rows = sorted((r for r in report["rows"] if r["runner"] == name), key=lambda r: r["batch"])
        line, = ax.plot([r["batch"] for r in rows], [r["tok_s"] for r in rows], marker="o", label=name,
                        linewidth=2.5 if name == "plain" or name.endswith("controller") else 1.2)
        if all("predicted_tok_s" in r for r in rows) and not name.endswith("controller"):
            ax.plot([r["batch"] for r in rows], [r["predicted_tok_s"] for r in rows], linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (dashed: calibrated prediction)")
    ax.set_title(f"bench batch: {report['config']['model']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def interleave_domains(prompts: list) -> list:
    """Round-robin over domains, so that a wave of B prompts mixes domains."""
    by_domain: dict[str, list] = {}
    for p in prompts:
        by_domain.setdefault(p.domain, []).append(p)
    out, queues = [], list(by_domain.values())
    for i in range(max(len(q) for q in queues)):
        out += [q[i] for q in queues if i < len(q)]
    return out


def add_bench_batch_command(bench) -> None:
    d = BatchBenchConfig()
    p = bench.add_parser("batch", help="tok/s per batch size: plain, fixed k, the controller, and the predicted curve")
    p.add_argument("--model", default=d.model)
    p.add_argument("--drafters", default=",".join(d.drafters))
    p.add_argument("--batch-sizes", default=",".join(map(str, d.batch_sizes)))
    p.add_argument("--ks", default=",".join(map(str, d.ks)), help="fixed draft lengths")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--prompts", default=d.prompts)
    p.add_argument("--drafter-path", default=None)
    p.add_argument("--calibration", default=None, help="a calibration JSON (default: the stored one for --model, if fresh)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--plot", default=None, help="write the PNG here")
    p.set_defaults(func=_bench_batch)


def _bench_batch(args) -> int:
    import json
    from pathlib import Path

    import torch

    torch.set_num_threads(args.threads)
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    config = BatchBenchConfig(model=args.model, drafters=tuple(x for x in args.drafters.split(",") if x), batch_sizes=ints(args.batch_sizes),
                              ks=ints(args.ks), max_tokens=args.max_tokens, prompts=args.prompts, drafter_path=args.drafter_path)
    report = run_batch_bench(config, _calibration(args.calibration, args.model))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, args.plot)
    print(format_table(report))
    return 0


def _calibration(path: str | None, model: str) -> Calibration | None:
    from tandem.engine.calibrate import calibration_path, fingerprint
    from tandem.sim.calibration import load_calibration

    if path:
        return load_calibration(path)
    stored = calibration_path(model)
    if stored.exists():
        record = load_calibration(stored)
        return record if record.stale_reason(fingerprint()) is None else None
    return None
