"""`--ray` on `tandem serve` and `tandem rl`: options added to their parsers; without --ray nothing changes."""
from __future__ import annotations

import argparse

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
    p.add_argument("--replica-cpus", type=float, default=1.0, help="--ray: CPUs Ray reserves per replica (also its engine threads; its KV cache: a quarter of its share of the node's memory)")
    p.add_argument("--trainer-cpus", type=float, default=1.0, help="--ray --online: CPUs Ray reserves for the trainer actor (also its threads)")
    _dispatch(p, serve_ray)


def serve_ray(args) -> int:
    from tandem.cluster.serve import serve_on_ray

    config, spec = serve_plan(args)
    serve_on_ray(config, args.replicas, spec, args.replica_cpus, args.address)
    return 0


def serve_plan(args):
    """The ServerConfig every replica runs and, with --online, the trainer actor's TrainerSpec (threads: --trainer-cpus;
    spill retention: --spill-max-gb / --spill-max-age-hours / --no-spill, as the embedded server's)."""
    from dataclasses import replace

    from tandem.cluster.specs import Placement, TrainerSpec
    from tandem.flywheel.trainer import FlywheelConfig
    from tandem.server.cli import config_from_args

    if args.replicas < 1:
        raise InvalidParameterError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replica_cpus <= 0 or args.trainer_cpus <= 0:
        raise InvalidParameterError(f"--replica-cpus and --trainer-cpus must be > 0, got {args.replica_cpus} and {args.trainer_cpus}")
    config = config_from_args(args)
    if config.admin_key is not None:
        raise InvalidParameterError("--admin-key with --ray is not supported yet: Serve routes an admin request to one replica, not all")
    if not config.online:
        return config, None
    from tandem.models.zoo import tandem_home

    state = args.state_dir or str(tandem_home() / "serve" / ("".join(c if c.isalnum() or c in "-_." else "_" for c in config.model_name.strip("/")) + "-ray"))
    loss = FlywheelConfig() if args.publish_every is None else FlywheelConfig(publish_every=args.publish_every)
    spec = TrainerSpec(model=config.model, drafter_path=config.drafter_path, draft_vocab_size=config.draft_vocab_size, num_draft_tokens=config.num_draft_tokens,
                       loss=loss, state_dir=state, checkpoint_every=args.checkpoint_every, threads=max(1, int(args.trainer_cpus)),
                       spill=config.spill_traces, spill_max_bytes=config.spill_max_bytes, spill_max_age_s=config.spill_max_age_s,
                       placement=Placement(num_cpus=args.trainer_cpus, max_restarts=-1))
    return replace(config, state_dir=None), spec  # each replica keeps its own (temporary) version history


def add_ray_rl_options(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--rollout-workers", type=int, default=2, help="--ray: rollout-worker actors (each its own engine and drafter)")
    p.add_argument("--worker-cpus", type=float, default=1.0, help="--ray: CPUs Ray reserves per rollout worker")
    p.add_argument("--learner-cpus", type=float, default=1.0, help="--ray: CPUs Ray reserves for the learner actor (also its threads)")
    p.add_argument("--learner-gpus", type=float, default=0.0, help="--ray: GPUs Ray reserves for the learner actor (placement only: it trains on CPU)")
    _dispatch(p, rl_ray)


def rl_ray(args) -> int:
    """`tandem rl --ray`: tandem.rl.command.run_rl with the first drafter's rollouts on Ray workers and the learner on
    its own actor (tandem.cluster.learner); the loop, rewards, checkpoints (`--checkpoint`, `--resume`: the embedded
    format, a resumed run continues to `--steps` in all), evaluation and the report stay in this process. A rollout
    worker that dies is restarted and its prompts decoded again (tandem.cluster.rl); a learner that dies ends the run
    with an error that names it, and `--resume` continues from the last checkpoint."""
    from tandem.cluster.ray_env import connect, require_ray, shutdown, warn_if_short
    from tandem.cluster.rl import build_ray_trainer
    from tandem.cluster.specs import Placement
    from tandem.rl.command import run_rl

    refuse_ray_rl_options(args)
    placement = Placement(num_cpus=args.worker_cpus)
    learner_placement = Placement(num_cpus=args.learner_cpus, num_gpus=args.learner_gpus)

    started: list = []  # the actors this run starts, killed when it ends (a shared cluster or a caller's session keeps nothing)

    def build(model, drafters, cfg, num_draft_tokens, adaptive_k, max_batch=None, reward_fn=None):
        trainer = build_ray_trainer(model, drafters[0], cfg, args.rollout_workers, num_draft_tokens, adaptive_k, max_batch=max_batch,
                                    reward_fn=reward_fn, placement=placement, learner_placement=learner_placement)
        started.extend([trainer.learner.actor, *trainer.engines[0].workers])
        return trainer

    started_here = not require_ray().is_initialized()
    ray = connect(args.address)
    warn_if_short(args.rollout_workers * args.worker_cpus + args.learner_cpus,
                  f"tandem rl --ray ({args.rollout_workers} rollout workers x {args.worker_cpus:g} CPUs + the learner's {args.learner_cpus:g})")
    try:
        return run_rl(args, build)
    finally:
        for actor in started:
            ray.kill(actor, no_restart=True)
        if started_here:  # a caller's own Ray session (tests, notebooks) stays up
            shutdown()


def refuse_ray_rl_options(args) -> None:
    """Options the Ray path does not take, refused before Ray or a model starts."""
    if args.compare:  # every drafter decoding every step is a timing comparison on one machine's cores
        raise InvalidParameterError("--ray does not take --compare: comparing drafters times each one's rollouts on the same cores, while on "
                                    "Ray each drafter would need rollout workers of its own (idle while the others decode, placed wherever "
                                    "Ray finds room): compare drafters without --ray")
    if args.sweep:
        raise InvalidParameterError("--ray does not take --sweep (a batch-size sweep of local engines): run it without --ray")
    if args.rollout_workers < 1:
        raise InvalidParameterError(f"--rollout-workers must be >= 1, got {args.rollout_workers}")
