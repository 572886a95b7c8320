"""`make demo`: plain decoding, the static head and the flywheel side by side on a domain-shifting stream.

SmolLM2-135M serves one stream of chat-rendered prompts in blocks per domain (code -> translation, four
times each, by default: the shipped general head trained on chat only, so both are domains it never saw,
and each comes back while the flywheel learns it), greedy, `batch` requests in flight, 1 torch thread for
the engine. Block by block, the three serve the same block in turn, so machine load drifting over the run
hits all alike:

- plain decoding: the reference tokens/s; the trainer rests meanwhile;
- static: the EAGLE head shipped in tandem/heads/ (the general head of recipe eagle-smollm2-general when
  it is shipped, Aurora's set-up; else the head of recipe eagle-smollm2), frozen, same drafter settings,
  served bare as a user would run it (no trace recording, no collector: the flywheel pays for what it adds);
- the flywheel: the same head at the start, drafting with a prompt-lookup branch grafted on
  (tandem.drafters.hybrid) like static; the engine records traces, the trainer (1 more thread; in a child
  process on >= 2 cores, so it does not share the engine's interpreter lock) learns from them, and new head
  versions are hot-swapped between steps (rollback on an acceptance collapse). The trainer rests while
  plain and static serve.

A row per finished flywheel request shows domain, acceptance length, tokens/s and the drafter version; the
end prints per-block tokens/s of all three, the speedups over plain decoding and over static (stream
tokens / serving time, same prompts, the same greedy outputs), and writes the plot with all three.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import tandem

HEADS = Path(tandem.__file__).resolve().parent / "heads"
GENERAL_HEAD = HEADS / "eagle-smollm2-general"  # recipe eagle-smollm2-general: chat data only (Aurora's static drafter)
STRONG_HEAD = HEADS / "eagle-smollm2"  # recipe eagle-smollm2: every built-in domain but summary
DEMO_DOMAINS = ("code", "translation")  # the general head never saw either; translation is where the flywheel gained most (BENCHMARKS 10)
HEADER = f"{'req':>4} {'domain':<12} {'accept':>6} {'tok/s':>6} {'version':>7} {'swaps':>5} {'rollbk':>6} {'train':>6} {'loss':>7}"
MODES = ("plain", "static", "flywheel")


@dataclass(frozen=True)
class DemoConfig:
    """What the stream statistics and the plot read (tandem.flywheel.stream_stats / stream_plot)."""

    model: str
    block: int
    window: int
    domains: tuple[str, ...]
    replay: bool = False


@dataclass(frozen=True)
class DemoHead:
    """The head static serves and the flywheel starts from, and what is known of it."""

    head: object  # EagleHead
    label: str  # which head, for the printout
    min_confidence: float  # a trained head's chains end where it is unsure; an untrained head drafts full chains
    trained_on: tuple[str, ...] | None  # the domains its recipe trained on (its card); () untrained; None unknown (no card)


def trained_domains(head_dir: Path) -> tuple[str, ...] | None:
    """The domains a head's recipe trained on, from its card (None without one)."""
    import json

    from tandem.models.eagle import CARD_FILE
    from tandem.training.recipes import RECIPES

    card_path = head_dir / CARD_FILE
    if not card_path.is_file():
        return None
    card = json.loads(card_path.read_text())
    recipe = RECIPES.get(card.get("recipe"))
    domains = card.get("settings", {}).get("domains") or (recipe.domains if recipe is not None else None)
    return tuple(domains) if domains is not None else None


def demo_head(target, path: str | Path | None = None, draft_vocab: int = 8192, seed: int = 0) -> DemoHead:
    """`path` if given, else the shipped general head (recipe eagle-smollm2-general: Aurora's static drafter),
    else the strong one (recipe eagle-smollm2), else an untrained day-0 head with a warning."""
    from tandem.drafters.eagle import TRAINED_MIN_CONFIDENCE
    from tandem.flywheel.setups import scratch_head
    from tandem.models.eagle import load_eagle

    candidates = [(Path(path), "EAGLE head")] if path is not None else [(GENERAL_HEAD, "general static EAGLE head"), (STRONG_HEAD, "strong static EAGLE head")]
    for where, what in candidates:
        if where.is_dir() or path is not None:  # load_eagle refuses a missing, damaged or mismatched head with a clear error
            return DemoHead(load_eagle(where, target), f"{what} ({where})", TRAINED_MIN_CONFIDENCE, trained_domains(where))
    print(f"WARNING: no trained head at {STRONG_HEAD}; starting from an UNTRAINED day-0 head instead.\n"
          "         Expect acceptance near 1.0 and no speedup until the flywheel has learned (this is not the shipped demo).\n")
    return DemoHead(scratch_head(target, draft_vocab, seed), "untrained day-0 EAGLE head (fallback: no shipped head yet)", 0.0, ())


def run_demo(model: str, requests: int = 96, block: int = 12, max_tokens: int = 64, out_dir: str = "out", batch: int = 1,
             trainer_process: bool | None = None, domains: tuple[str, ...] = DEMO_DOMAINS, head: str | Path | None = None,
             adaptive_k: bool = False) -> dict:
    """trainer_process: train in a child process (True) or a thread of this one (False); None: a process when
    the machine has >= 2 cores (one for the engine, one for the trainer). head: a head directory (default:
    the shipped one, `demo_head`). adaptive_k: static and flywheel draft under the speculation controller."""
    import torch

    from tandem.config import SamplingParams
    from tandem.flywheel.setups import core_split, demo_setup, live_engine, pinned, serve_stream, serving_cores
    from tandem.flywheel.stream import StreamSpec, build_stream, prompt_key
    from tandem.flywheel.stream_plot import plot_shift
    from tandem.flywheel.stream_stats import summarize
    from tandem.llm import load_tokenizer
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model

    start = time.perf_counter()
    cfg = DemoConfig(model=model, block=block, window=max(2, block // 2), domains=tuple(dict.fromkeys(domains)))
    model_dir = Path(resolve_model(model))
    target = load_transformer(model_dir)
    target.pack()
    start_head = demo_head(target, head)
    heads, label = {"static": start_head.head}, start_head.label
    stream, stream_ids, _ = build_stream(StreamSpec(requests=requests, block=block, domains=domains), load_tokenizer(model_dir))
    pairs = [(stream_ids[prompt_key(p)], p.domain) for p in stream]
    longest = max(len(ids) for ids, _ in pairs) + max_tokens + 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    torch.set_num_threads(1)
    setup = replace(demo_setup(start_head.min_confidence, trainer_process), adaptive_k=adaptive_k)  # the flywheel's defaults (setups.DEFAULTS)
    print(f"tandem demo: {model}, {len(stream)} requests in blocks of {block} ({' -> '.join(domains)}), greedy, "
          f"{batch} in flight, {max_tokens} new tokens each\n")
    split = core_split() if setup.trainer_process else None
    where = (f"a child process on core {split[1][0]}, serving on {','.join(map(str, split[0]))}" if split else
             "a child process" if setup.trainer_process else "a background thread")
    print(f"plain decoding, the static head and the flywheel (both starting from the {label}; trainer in {where})\n"
          "take turns, block by block, so all three see the same machine; the trainer rests while the others run\n")
    print(HEADER)
    with pinned(serving_cores(setup)):  # the trainer's core is its own; the three modes serve on the same other cores
        plain_engine, _ = live_engine("plain", target, heads, setup, batch, longest)
        static_engine, _ = live_engine("static", target, heads, setup, batch, longest)  # bare: no recording, no collector
        engine, flywheel = live_engine("online", target, heads, setup, batch, longest)
        parts = {mode: [] for mode in MODES}
        for first in range(0, len(pairs), block):
            part = pairs[first : first + block]
            if flywheel.trainer is not None:
                flywheel.trainer.stop()
            parts["plain"].append(_offset(serve_stream(plain_engine, None, part, params, batch, prefix=f"plain-{first}"), first))
            parts["static"].append(_offset(serve_stream(static_engine, None, part, params, batch, prefix=f"static-{first}"), first))
            flywheel.start()
            parts["flywheel"].append(_offset(serve_stream(engine, flywheel, part, params, batch, on_finish=lambda row, f=first: _show(row, flywheel, f), prefix=f"online-{first}"), first))
        flywheel.close()
    metrics = flywheel.metrics()
    joined = {mode: _joined(parts[mode]) for mode in MODES}
    results = {mode: joined[mode].rows for mode in MODES}
    summary = summarize(results, cfg)
    plot = plot_shift(results, cfg, Path(out_dir) / "demo_flywheel.png")
    speed = {mode: joined[mode].tokens_per_s for mode in MODES}
    _report(results, block, metrics)
    same = {mode: sum(a == b for a, b in zip(joined["plain"].outputs, joined[mode].outputs)) for mode in ("static", "flywheel")}
    print(f"\ngreedy outputs identical to plain decoding: static {same['static']}/{len(stream)}, flywheel {same['flywheel']}/{len(stream)} requests")
    print("\n            tok/s   vs plain   vs static   mean accept   drafted a step   ms a decode step (draft + verify)")
    for mode in MODES:
        accept, cost = summary[mode]["mean_acceptance_length"], step_costs(results[mode])
        print(f"  {mode:<9} {speed[mode]:>6.1f} {_ratio(speed[mode], speed['plain']):>9.2f}x {_ratio(speed[mode], speed['static']):>10.2f}x {accept:>12.3f}"
              f" {cost['drafted_per_step']:>16.2f} {cost['draft_ms']:>10.2f} + {cost['verify_ms']:.2f}")
    _per_domain(results, block, cfg.domains, start_head.trained_on)
    print(f"SPEEDUP over plain decoding: flywheel {_ratio(speed['flywheel'], speed['plain']):.2f}x, static {_ratio(speed['static'], speed['plain']):.2f}x; "
          f"flywheel over static {_ratio(speed['flywheel'], speed['static']):.2f}x  (same stream, measured in this run; machine load affects all three)")
    print(f"plot: {plot}   ({time.perf_counter() - start:.0f} s in all)")
    return {"head": label, "speedup": round(_ratio(speed["flywheel"], speed["plain"]), 4), "static_speedup": round(_ratio(speed["static"], speed["plain"]), 4),
            "flywheel_over_static": round(_ratio(speed["flywheel"], speed["static"]), 4),
            "step_costs": {m: {k: round(v, 3) for k, v in step_costs(results[m]).items()} for m in MODES},
            "tokens_per_s": {m: round(v, 3) for m, v in speed.items()}, "identical_outputs": same,
            "summary": summary, "metrics": metrics, "plot": str(plot), "trainer_process": flywheel.options.trainer_process,
            "flywheel_settings": setup.learning(), "head_trained_on": start_head.trained_on}


def step_costs(rows: list[dict]) -> dict:
    """What a decode step drafted and cost over a mode's requests: the acceptance's price (a head that drafts longer
    verifies more tokens a step; on a CPU each one costs)."""
    steps = max(1, sum(r["steps"] for r in rows))
    return {"drafted_per_step": sum(r["drafted_per_step"] * r["steps"] for r in rows) / steps,
            "draft_ms": 1000 * sum(r["draft_s"] for r in rows) / steps, "verify_ms": 1000 * sum(r["verify_s"] for r in rows) / steps}


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


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


def _per_domain(results: dict, block: int, domains: tuple[str, ...], trained_on: tuple[str, ...] | None) -> None:
    """Flywheel vs static on each domain: over all its blocks, and on its last block (the flywheel has learned
    the most by then; where it overtakes static, this is where it shows)."""
    mean = lambda rows, key: sum(r[key] for r in rows) / max(1, len(rows))  # noqa: E731
    print("\nper domain        flywheel tok/s  static tok/s           flywheel accept  static accept")
    for d in domains:
        starts = [b for b in range(0, len(results["flywheel"]), block) if results["flywheel"][b]["domain"] == d]
        seen = "the head's card does not say whether it trained on it" if trained_on is None else \
            "the head trained on it" if d in trained_on else "the head never saw it"
        print(f"  {d}: {seen}")
        parts = {"all blocks": {m: [r for r in results[m] if r["domain"] == d] for m in MODES},
                 "last block": {m: results[m][starts[-1] : starts[-1] + block] for m in MODES}}
        for label, rows in parts.items():
            fly, static = mean(rows["flywheel"], "tokens_per_s"), mean(rows["static"], "tokens_per_s")
            print(f"    {label:<12} {fly:>10.1f} {static:>13.1f}  ({_ratio(fly, static):.2f}x)"
                  f" {mean(rows['flywheel'], 'acceptance_length'):>15.3f} {mean(rows['static'], 'acceptance_length'):>14.3f}")


def _report(results: dict, block: int, metrics: dict) -> None:
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    print("\nper block          plain tok/s  static tok/s  flywheel tok/s  static accept  flywheel accept  versions")
    for b in range(0, len(results["flywheel"]), block):
        p, s, o = (results[m][b : b + block] for m in MODES)
        print(f"  {o[0]['domain']:<14} {mean(p, 'tokens_per_s'):>11.1f} {mean(s, 'tokens_per_s'):>13.1f} {mean(o, 'tokens_per_s'):>15.1f}"
              f" {mean(s, 'acceptance_length'):>14.3f} {mean(o, 'acceptance_length'):>16.3f}   v{o[0]['version']}..v{o[-1]['version']}")
    print(f"swaps {metrics['swaps']['swaps']}, rollbacks {metrics['swaps']['rollbacks']}, refused {metrics['swaps']['refused']}, "
          f"trainer steps {metrics['trainer']['steps']}, max swap copy {metrics['swaps']['max_swap_ms']} ms, max swap step {metrics['max_swap_step_s']} s (slowest step {metrics['max_step_s']} s)")
    print(f"buffer: {metrics['buffer']['traces']} traces, {metrics['buffer']['bytes'] / 2**20:.1f} MiB, dropped {metrics['buffer']['dropped']}")
