"""Where the live flywheel's tokens/s go, on the engines `make demo` builds (docs/BENCHMARKS.md 10, "Why acceptance
does not reach tokens/s"): `python -m tandem.bench.flywheel.flywheel_costs [--requests 12] [--rounds 3] [--json PATH]`.

Serving on all cores but the trainer's, 1 thread, greedy, 1 in flight, the general head with the prompt-lookup
graft; the same `requests` code prompts each round:
- overhead: static (bare: no recording, no collector) vs the flywheel's engine with the trainer resting (the same
  head): what the flywheel's serving path (step records, trace collection, the hot-swapper) costs by itself;
- interference: static while the trainer child trains on its own core vs while it rests;
- learning: static vs the flywheel while it trains on those prompts (acceptance, drafted tokens a step, the
  verify's and the drafting's seconds a step).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HEAD = Path(__file__).resolve().parents[2] / "heads" / "eagle-smollm2-general"


def per_step(result, max_tokens: int) -> dict:
    """A StreamResult's mean acceptance, drafted tokens a step and draft / verify ms a decode step."""
    rows = result.rows
    steps = sum(max_tokens / r["acceptance_length"] for r in rows)
    return {"tokens_per_s": round(result.tokens_per_s, 2), "acceptance": round(sum(r["acceptance_length"] for r in rows) / len(rows), 3),
            "drafted_per_step": round(sum(r["drafted_per_step"] for r in rows) / len(rows), 2),
            "verify_ms_per_step": round(1000 * sum(r["verify_s"] for r in rows) / steps, 2),
            "draft_ms_per_step": round(1000 * sum(r["draft_s"] for r in rows) / steps, 2),
            "prefill_share": round(sum(r["prefill_s"] for r in rows) / result.seconds, 3)}


def run(requests: int = 12, rounds: int = 3, max_tokens: int = 64, head: Path = HEAD, model: str = "smollm2-135m") -> dict:
    import torch

    from tandem.config import SamplingParams
    from tandem.drafters.eagle import TRAINED_MIN_CONFIDENCE
    from tandem.flywheel.setups import demo_setup, live_engine, pinned, serve_stream, serving_cores
    from tandem.flywheel.stream import StreamSpec, build_stream, prompt_key
    from tandem.llm import load_tokenizer
    from tandem.models.eagle import load_eagle
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model

    torch.set_num_threads(1)
    model_dir = Path(resolve_model(model))
    target = load_transformer(model_dir)
    target.pack()
    heads = {"static": load_eagle(head, target)}
    stream, ids, _ = build_stream(StreamSpec(requests=2 * requests, block=requests, domains=("code", "translation")), load_tokenizer(model_dir))
    pairs = [(ids[prompt_key(p)], p.domain) for p in stream][:requests]
    longest = max(len(i) for i, _ in pairs) + max_tokens + 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    setup = demo_setup(TRAINED_MIN_CONFIDENCE, trainer_process=True)  # make demo's flywheel
    report = {"overhead": [], "interference": [], "learning": []}
    with pinned(serving_cores(setup)):
        static_engine, _ = live_engine("static", target, heads, setup, 1, longest)  # bare, as a user serves the head
        engine, flywheel = live_engine("online", target, heads, setup, 1, longest)
        serve = lambda eng, fly: serve_stream(eng, fly, pairs, params, 1)  # noqa: E731
        try:
            flywheel.trainer.stop()
            for _ in range(rounds):  # the head is still the static one: nothing has trained
                static, online = serve(static_engine, None), serve(engine, flywheel)
                report["overhead"].append(round(online.tokens_per_s / static.tokens_per_s, 3))
            serve(engine, flywheel)  # a buffer to train on
            for _ in range(rounds):
                flywheel.trainer.stop()
                resting = serve(static_engine, None)
                flywheel.start()
                training = serve(static_engine, None)
                report["interference"].append(round(training.tokens_per_s / resting.tokens_per_s, 3))
            for _ in range(rounds):
                flywheel.trainer.stop()
                static = serve(static_engine, None)
                flywheel.start()
                online = serve(engine, flywheel)
                report["learning"].append({"static": per_step(static, max_tokens), "flywheel": per_step(online, max_tokens),
                                           "tokens_per_s_ratio": round(online.tokens_per_s / static.tokens_per_s, 3)})
        finally:
            flywheel.close()
    return report


def main(argv: list[str] | None = None) -> int:
    from tandem.bench.machine import machine_info

    parser = argparse.ArgumentParser(prog="python -m tandem.bench.flywheel.flywheel_costs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args(argv)
    measured = run(args.requests, args.rounds, args.max_tokens)
    report = {"machine": machine_info()} | measured  # after run: its 1 thread
    text = json.dumps(report, indent=1)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
