"""`make demo`: the flywheel on the embedded default model.

SmolLM2-135M serves a short domain-shifting stream (code -> sql -> math -> chat -> translation) with an
EAGLE drafter that starts untrained (day 0). The engine records traces, the trainer learns from them in
a background thread, and new drafter versions are hot-swapped between engine steps. A row per finished
request shows the domain, acceptance length, tokens/s, the drafter version that served it, swaps and
rollbacks; the end prints a summary per block and writes a plot.
"""
from __future__ import annotations

import time
from pathlib import Path

HEADER = f"{'req':>4} {'domain':<12} {'accept':>6} {'tok/s':>6} {'version':>7} {'swaps':>5} {'rollbk':>6} {'train':>6} {'loss':>7} {'traces':>6}"


def run_demo(model: str, requests: int = 40, block: int = 8, max_tokens: int = 48, out_dir: str = "out") -> dict:
    from tandem.bench.shift import ShiftConfig, build_stream, rolling, scratch_head, summarize
    from tandem.bench.shift_live import live_mode
    from tandem.bench.shift_plot import plot_shift
    from tandem.llm import load_tokenizer
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model

    start = time.perf_counter()
    cfg = ShiftConfig(model=model, requests=requests, block=block, max_tokens=max_tokens, modes=("online_scratch",), replay=False,
                      static_prompts=0, window=4, publish_every=5)
    model_dir = Path(resolve_model(model))
    target = load_transformer(model_dir)
    target.pack()
    stream, stream_ids, _ = build_stream(cfg, load_tokenizer(model_dir))
    print(f"tandem flywheel demo: {model}, {len(stream)} requests in blocks of {block} "
          f"({' -> '.join(cfg.domains)}), greedy, EAGLE drafter from scratch, trainer in the background\n")
    print(HEADER)

    def show(row: dict, flywheel) -> None:
        trainer, swaps = flywheel.trainer, flywheel.swapper.stats
        loss = f"{trainer.losses[-1]['loss']:.3f}" if trainer.losses else "-"
        print(f"{row['i']:>4} {row['domain']:<12} {row['acceptance_length']:>6.2f} {row['tokens_per_s']:>6.1f} {row['version']:>7} "
              f"{swaps.swaps:>5} {swaps.rollbacks:>6} {trainer.steps:>6} {loss:>7} {len(flywheel.buffer):>6}", flush=True)

    rows, metrics = live_mode("online_scratch", target, stream, stream_ids, {"scratch": scratch_head(target, cfg)}, cfg, on_finish=show)
    summary = summarize({"online_scratch": rows}, cfg)["online_scratch"]
    plot = plot_shift({"online_scratch": rows}, cfg, Path(out_dir) / "demo_flywheel.png")
    print("\nper block (mean acceptance length, drafter versions):")
    for b in range(0, len(rows), block):
        chunk = rows[b : b + block]
        print(f"  {chunk[0]['domain']:<12} {sum(r['acceptance_length'] for r in chunk) / len(chunk):.3f}   v{chunk[0]['version']}..v{chunk[-1]['version']}")
    values = [r["acceptance_length"] for r in rows]
    print(f"\nacceptance length: first {block} requests {sum(values[:block]) / block:.3f} -> last {block} {sum(values[-block:]) / block:.3f} "
          f"(rolling-{cfg.window} max {max(rolling(values, cfg.window)):.3f})")
    print(f"swaps {metrics['swaps']['swaps']}, rollbacks {metrics['swaps']['rollbacks']}, refused {metrics['swaps']['refused']}, "
          f"trainer steps {metrics['trainer']['steps']}, max swap copy {metrics['swaps']['max_swap_ms']} ms, "
          f"median step {metrics['median_step_s']} s, max swap step {metrics['max_swap_step_s']} s")
    print(f"buffer: {metrics['buffer']['traces']} traces, {metrics['buffer']['bytes'] / 2**20:.1f} MiB, dropped {metrics['buffer']['dropped']}")
    print(f"plot: {plot}   ({time.perf_counter() - start:.0f} s in all)")
    return {"summary": summary, "metrics": metrics, "plot": str(plot)}
