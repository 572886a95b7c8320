"""`--ray` on `tandem serve` and `tandem rl`: options added to their parsers; without --ray nothing changes."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.errors import InvalidParameterError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", action="store_true", help="run on a Ray cluster (pip install 'tandem[ray]')")
    p.add_argument("--address", default=None, help="--ray: join this cluster (HEAD:6379, or 'auto' for `ray start` on this node); default: start a local one")


def _dispatch(p: argparse.ArgumentParser, ray_func) -> None:
    embedded = p.get_default("func")
    p.set_defaults(func=lambda args: ray_func(args) if args.ray else embedded(args))


def add_ray_serve_options(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--replicas", type=int, default=1, help="--ray: engine replicas (Ray Serve deployment replicas)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="--ray: CPUs Ray reserves per replica")
    p.add_argument("--trainer-cpus", type=float, default=1.0, help="--ray --online: CPUs Ray reserves for the trainer actor")
    _dispatch(p, serve_ray)


def serve_ray(args) -> int:
    from tandem.cluster.serve import serve_on_ray
    from tandem.cluster.specs import Placement, TrainerSpec
    from tandem.flywheel.trainer import FlywheelConfig
    from tandem.server.cli import config_from_args

    if args.replicas < 1:
        raise InvalidParameterError(f"--replicas must be >= 1, got {args.replicas}")
    config = config_from_args(args)
    if config.admin_key is not None:
        raise InvalidParameterError("--admin-key with --ray is not supported yet: Serve routes an admin request to one replica, not all")
    spec = None
    if config.online:
        from tandem.models.zoo import tandem_home

        state = args.state_dir or str(tandem_home() / "serve" / ("".join(c if c.isalnum() or c in "-_." else "_" for c in config.model_name.strip("/")) + "-ray"))
        loss = FlywheelConfig() if args.publish_every is None else FlywheelConfig(publish_every=args.publish_every)
        spec = TrainerSpec(model=config.model, drafter_path=config.drafter_path, draft_vocab_size=config.draft_vocab_size, num_draft_tokens=config.num_draft_tokens,
                           loss=loss, state_dir=state, checkpoint_every=args.checkpoint_every, threads=args.trainer_threads,
                           placement=Placement(num_cpus=args.trainer_cpus, max_restarts=-1))
        from dataclasses import replace

        config = replace(config, state_dir=None)  # each replica keeps its own (temporary) version history
    serve_on_ray(config, args.replicas, spec, args.replica_cpus, args.address)
    return 0


def add_ray_rl_options(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--rollout-workers", type=int, default=2, help="--ray: rollout-worker actors (each its own engine and drafter)")
    p.add_argument("--worker-cpus", type=float, default=1.0, help="--ray: CPUs Ray reserves per rollout worker")
    _dispatch(p, rl_ray)


def rl_ray(args) -> int:
    """`tandem rl --ray`: GRPO with the first drafter's rollouts on Ray workers (no --compare, --sweep, --plot,
    --resume/--checkpoint yet: tandem.rl.command has no hook for another trainer builder)."""
    from tandem.cluster.ray_env import connect, shutdown
    from tandem.cluster.rl import build_ray_trainer
    from tandem.cluster.specs import Placement
    from tandem.rl.command import grpo_config
    from tandem.rl.report import summarize
    from tandem.rl.rewards import load_reward

    unsupported = [flag for flag, on in (("--compare", args.compare), ("--sweep", args.sweep), ("--plot", args.plot), ("--checkpoint", args.checkpoint),
                                         ("--resume", args.resume)) if on]
    if unsupported:
        raise InvalidParameterError(f"--ray does not support {', '.join(unsupported)} yet")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    drafter = next((d for d in args.drafters.split(",") if d), None)
    if drafter is None:
        raise InvalidParameterError("--drafters is empty")
    cfg = grpo_config(args)
    reward_fn = load_reward(args.reward)
    connect(args.address)
    try:
        trainer = build_ray_trainer(args.model, drafter, cfg, args.rollout_workers, args.num_draft_tokens, not args.no_adaptive_k,
                                    placement=Placement(num_cpus=args.worker_cpus), reward_fn=reward_fn)

        def on_step(record: dict) -> None:
            print(json.dumps({k: record[k] for k in ("step", "reward_mean", "train_s", "sync_s", "step_wall_s")} | {"eval": record.get("eval")}), flush=True)

        trainer.run(args.steps, on_step=on_step)
        result = {"command": "tandem rl --ray", "rollout_workers": args.rollout_workers, "summary": summarize(trainer.history),
                  "evals": trainer.evals, "history": trainer.history}
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({"summary": result["summary"], "evals": trainer.evals}, indent=1))
    finally:
        shutdown()
    return 0
