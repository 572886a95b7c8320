"""`tandem simulate` argument parsing (the top-level CLI only registers it)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_simulate_command(sub) -> argparse.ArgumentParser:
    from tandem.sim.hardware import PRESETS
    from tandem.sim.report import MODEL_DIMS, SimulateConfig

    d = SimulateConfig()
    p = sub.add_parser("simulate", help="predict speculation speedups per batch size and RL step (roofline + Amdahl)")
    p.add_argument("--paper", action="store_true", help="reproduce the RL-rollout paper's figures (8B Amdahl, 235B on 2,048 GB200)")
    p.add_argument("--model", default=d.model, choices=sorted(MODEL_DIMS))
    p.add_argument("--hardware", default=d.hardware, choices=sorted(PRESETS))
    p.add_argument("--precision", default=d.precision, help="fp32 | bf16 | fp8 | int8")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel devices per replica")
    p.add_argument("--batch-sizes", default=",".join(map(str, d.batch_sizes)))
    p.add_argument("--context", type=int, default=d.context)
    p.add_argument("--acceptance", default=",".join(map(str, d.acceptance)), help="conditional acceptance per draft position")
    p.add_argument("--draft-fraction", type=float, default=d.draft_fraction, help="one draft depth / a batch-1 target forward")
    p.add_argument("--generation-share", type=float, default=d.generation_share)
    p.add_argument("--replicas", default="", help="project N engine replicas instead, e.g. 1,2,4,8: aggregate tok/s and latency for --load")
    p.add_argument("--load", type=int, default=256, help="--replicas: concurrent requests split over the replicas")
    p.add_argument("--output-tokens", type=int, default=256, help="--replicas: tokens per request")
    p.add_argument("--routing-ms", type=float, default=0.0, help="--replicas: per-request cost of reaching a replica (tandem.cluster.overhead measures Ray's)")
    p.add_argument("--calibration", default=None, help="a `tandem calibrate` JSON: use its fitted machine (cpu)")
    p.add_argument("--rollout", default=None, help="a `tandem rl --json` run: its rollouts replayed through the simulator, predicted vs "
                   "measured speedup per engine (with --calibration: this machine; without: --hardware/--model/--precision)")
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=run_simulate)
    return p


def run_simulate(args) -> int:
    from tandem.sim.paper import reproduce
    from tandem.sim.report import SimulateConfig, format_table, simulate_batches

    if args.paper:
        result = reproduce()
        text = json.dumps(result, indent=2)
    elif args.rollout:
        result, text = _rollout(args)
    else:
        acceptance = tuple(float(x) for x in args.acceptance.split(",") if x)
        config = SimulateConfig(
            model=args.model, hardware=args.hardware, precision=args.precision, tp=args.tp,
            batch_sizes=tuple(int(x) for x in args.batch_sizes.split(",") if x), context=args.context,
            acceptance=acceptance, max_k=len(acceptance), draft_fraction=args.draft_fraction, generation_share=args.generation_share,
        )
        machine = None
        if args.calibration:
            from tandem.sim.calibration import load_calibration

            machine = load_calibration(args.calibration).machine
        if args.replicas:
            from tandem.sim.replicas import format_replica_table, replica_table

            counts = [int(x) for x in args.replicas.split(",") if x]
            result = replica_table(config, counts, args.load, args.output_tokens, args.routing_ms / 1000, machine)
            text = format_replica_table(result)
        else:
            result = simulate_batches(config, machine)
            text = format_table(result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    print(text)
    return 0


def _rollout(args) -> tuple[dict, str]:
    """--rollout: the run's measured lengths and acceptance through the rollout simulator."""
    from tandem.sim.report import SimulateConfig, cost_model
    from tandem.sim.roofline import forward_seconds
    from tandem.sim.rollout_compare import format_comparison, predicted_vs_measured

    run = json.loads(Path(args.rollout).read_text())
    max_k = int(run.get("config", {}).get("num_draft_tokens", 4))
    engines = run.get("history", [{}])[0].get("rollout_s", {})
    if args.calibration:
        from tandem.sim.calibration import load_calibration

        cal = load_calibration(args.calibration)
        forward = lambda b, t, c: forward_seconds(cal.work, cal.machine, b, t, c)  # noqa: E731
        drafts, where = dict(cal.drafters), f"calibration of {cal.model} on {cal.fingerprint.get('cpu', '?')}"
    else:  # a preset: each draft depth costs --draft-fraction of a batch-1 target forward, as in the batch table
        model = cost_model(SimulateConfig(model=args.model, hardware=args.hardware, precision=args.precision, tp=args.tp,
                                          draft_fraction=args.draft_fraction))
        forward, where = model.forward, f"{args.model} {args.precision} on {args.hardware} (tp {args.tp})"
        drafts = {name.partition("@")[0]: model.draft for name in engines}
    result = predicted_vs_measured(run, forward, drafts, max_k)
    result["cost_model"] = where
    return result, f"cost model: {where}\n" + format_comparison(result, projection=not args.calibration)
