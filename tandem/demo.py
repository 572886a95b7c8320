"""`make demo`: plain decoding vs the flywheel on a domain-shifting stream, measured in the same run.

SmolLM2-135M serves one stream of chat-rendered prompts in blocks per domain (code -> sql -> math ->
chat -> translation), greedy, `batch` requests in flight, 1 torch thread for the engine. Block by block,
plain decoding (no drafter) serves the block, then the flywheel serves the same block, so machine load
drifting over the run hits both alike:

- plain decoding: the reference tokens/s; the trainer rests meanwhile;
- the flywheel: the EAGLE head starts from the strong static head shipped in tandem/heads/ (or, if none is
  shipped yet, from an untrained day-0 head, with a warning) and drafts with a prompt-lookup branch grafted
  on (tandem.drafters.hybrid); the engine records traces, the trainer (1 more thread; in a child process on
  >= 2 cores, so it does not share the engine's interpreter lock) learns from them, and new head versions
  are hot-swapped between steps (rollback on an acceptance collapse).

A row per finished request shows domain, acceptance length, tokens/s and the drafter version; the end
prints per-block means for both, the speedup over plain decoding (stream tokens / serving time, same
prompts and the same greedy outputs), and writes the plot.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import tandem

STRONG_HEAD = Path(tandem.__file__).resolve().parent / "heads" / "eagle-smollm2"
HEADER = f"{'req':>4} {'domain':<12} {'accept':>6} {'tok/s':>6} {'version':>7} {'swaps':>5} {'rollbk':>6} {'train':>6} {'loss':>7}"


def demo_heads(target, draft_vocab: int = 8192, seed: int = 0) -> tuple[dict, str, float]:
    """{"static": the head the flywheel starts from}, a label saying which one it is, and its confidence cut
    (a trained head's chains end where it is unsure; an untrained head drafts full chains)."""
    from tandem.drafters.eagle import TRAINED_MIN_CONFIDENCE
    from tandem.flywheel.setups import scratch_head
    from tandem.models.eagle import load_eagle

    if STRONG_HEAD.is_dir():  # load_eagle refuses a damaged or mismatched head with a clear error
        return {"static": load_eagle(STRONG_HEAD, target)}, f"strong static EAGLE head ({STRONG_HEAD})", TRAINED_MIN_CONFIDENCE
    print(f"WARNING: no trained head at {STRONG_HEAD}; starting from an UNTRAINED day-0 head instead.\n"
          "         Expect acceptance near 1.0 and no speedup until the flywheel has learned (this is not the shipped demo).\n")
    return {"static": scratch_head(target, draft_vocab, seed)}, "untrained day-0 EAGLE head (fallback: no shipped head yet)", 0.0


def run_demo(model: str, requests: int = 30, block: int = 6, max_tokens: int = 40, out_dir: str = "out", batch: int = 1, trainer_process: bool | None = None) -> dict:
    """trainer_process: train in a child process (True) or a thread of this one (False); None: a process when
    the machine has >= 2 cores (one for the engine, one for the trainer)."""
    import torch

    from tandem.bench.shift import ShiftConfig, build_stream, prompt_key
    from tandem.bench.shift_plot import plot_shift
    from tandem.bench.shift_stats import summarize
    from tandem.config import SamplingParams
    from tandem.flywheel.setups import live_engine, serve_stream
    from tandem.llm import load_tokenizer
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model

    start = time.perf_counter()
    cfg = ShiftConfig(model=model, requests=requests, block=block, max_tokens=max_tokens, modes=("plain", "online"), replay=False,
                      static_prompts=0, window=max(2, block // 2), publish_every=5, live_batch=batch,
                      trainer_process=trainer_process)
    model_dir = Path(resolve_model(model))
    target = load_transformer(model_dir)
    target.pack()
    heads, label, cut = demo_heads(target, cfg.draft_vocab, cfg.seed)
    stream, stream_ids, _ = build_stream(cfg, load_tokenizer(model_dir))
    pairs = [(stream_ids[prompt_key(p)], p.domain) for p in stream]
    longest = max(len(ids) for ids, _ in pairs) + max_tokens + 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    torch.set_num_threads(1)
    print(f"tandem demo: {model}, {len(stream)} requests in blocks of {block} ({' -> '.join(cfg.domains)}), greedy, "
          f"{batch} in flight, {max_tokens} new tokens each\n")

    where = "a child process" if cfg.setup.trainer_process else "a background thread"
    print(f"plain decoding and the flywheel (starting from the {label}; trainer in {where}) take turns, block by block,\n"
          "so both see the same machine; the trainer rests while plain decoding runs\n")
    print(HEADER)
    setup = replace(cfg.setup, prompt_lookup=True, min_confidence=cut)  # the head's draft plus a prompt-lookup branch (tandem.drafters.hybrid)
    plain_engine, _ = live_engine("plain", target, heads, setup, batch, longest)
    engine, flywheel = live_engine("online", target, heads, setup, batch, longest)
    plain, online = [], []
    for first in range(0, len(pairs), block):
        part = pairs[first : first + block]
        if flywheel.trainer is not None:
            flywheel.trainer.stop()
        plain.append(_offset(serve_stream(plain_engine, None, part, params, batch, prefix=f"plain-{first}"), first))
        flywheel.start()
        online.append(_offset(serve_stream(engine, flywheel, part, params, batch, on_finish=lambda row, f=first: _show(row, flywheel, f), prefix=f"online-{first}"), first))
    flywheel.close()
    metrics = flywheel.metrics()
    plain, online = _joined(plain), _joined(online)

    results = {"plain": plain.rows, "flywheel": online.rows}
    summary = summarize(results, cfg)
    plot = plot_shift(results, cfg, Path(out_dir) / "demo_flywheel.png")
    speedup = online.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0
    _report(results, plain, online, block, metrics)
    same = sum(a == b for a, b in zip(plain.outputs, online.outputs))
    print(f"\ngreedy outputs identical to plain decoding: {same}/{len(stream)} requests")
    print(f"SPEEDUP over plain decoding: {speedup:.2f}x  (flywheel {online.tokens_per_s:.1f} tok/s vs plain {plain.tokens_per_s:.1f} tok/s, "
          f"same stream, measured in this run; machine load affects both)")
    print(f"plot: {plot}   ({time.perf_counter() - start:.0f} s in all)")
    return {"head": label, "speedup": round(speedup, 4), "plain_tokens_per_s": round(plain.tokens_per_s, 3),
            "online_tokens_per_s": round(online.tokens_per_s, 3), "identical_outputs": same, "summary": summary, "metrics": metrics, "plot": str(plot),
            "trainer_process": flywheel.options.trainer_process}


def _offset(result, first: int):
    """A block's StreamResult with its rows numbered within the whole stream."""
    for row in result.rows:
        row["i"] += first
    return result


def _joined(parts):
    """One StreamResult from the blocks' (rows and outputs in stream order, tokens and seconds summed)."""
    from tandem.flywheel.setups import StreamResult

    return StreamResult([r for p in parts for r in p.rows], [o for p in parts for o in p.outputs],
                        sum(p.output_tokens for p in parts), sum(p.seconds for p in parts))


def _show(row: dict, flywheel, first: int = 0) -> None:
    trainer, swaps = flywheel.trainer, flywheel.swapper.stats
    loss = f"{trainer.losses[-1]['loss']:.3f}" if trainer.losses else "-"
    print(f"{row['i'] + first:>4} {row['domain']:<12} {row['acceptance_length']:>6.2f} {row['tokens_per_s']:>6.1f} {row['version']:>7} "
          f"{swaps.swaps:>5} {swaps.rollbacks:>6} {trainer.steps:>6} {loss:>7}", flush=True)


def _report(results: dict, plain, online, block: int, metrics: dict) -> None:
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    print("\nper block          plain tok/s   flywheel tok/s   flywheel accept   versions")
    for b in range(0, len(online.rows), block):
        p, o = results["plain"][b : b + block], results["flywheel"][b : b + block]
        print(f"  {o[0]['domain']:<14} {mean(p, 'tokens_per_s'):>11.1f} {mean(o, 'tokens_per_s'):>16.1f} {mean(o, 'acceptance_length'):>17.3f}"
              f"   v{o[0]['version']}..v{o[-1]['version']}")
    values = [r["acceptance_length"] for r in online.rows]
    n = min(block, len(values))
    print(f"\nflywheel acceptance length: first {n} requests {sum(values[:n]) / n:.3f} -> last {n} {sum(values[-n:]) / n:.3f}")
    print(f"swaps {metrics['swaps']['swaps']}, rollbacks {metrics['swaps']['rollbacks']}, refused {metrics['swaps']['refused']}, "
          f"trainer steps {metrics['trainer']['steps']}, max swap copy {metrics['swaps']['max_swap_ms']} ms, max swap step {metrics['max_swap_step_s']} s (slowest step {metrics['max_step_s']} s)")
    print(f"buffer: {metrics['buffer']['traces']} traces, {metrics['buffer']['bytes'] / 2**20:.1f} MiB, dropped {metrics['buffer']['dropped']}")
