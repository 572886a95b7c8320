"""`tandem rl`: GRPO on reasoning-gym tasks with speculative rollouts; with --compare, every drafter decodes
each step's rollouts.

Thin: args -> GRPOConfig -> build_trainer -> run (checkpoint every step when asked) -> summary, sweep, plot, export.
Each step's line and the JSON carry the reward (what trains; reasoning-gym's scorers give partial credit) and the
exact accuracy (the scorer's full score) side by side, for training samples and the held-out evaluation.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from tandem.errors import InvalidParameterError


def add_rl_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("rl", help="GRPO on reasoning tasks with speculative rollouts (and drafter comparison)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--drafters", default="suffix", help="comma list of ar,ngram,suffix,self_draft,eagle,...; NAME@fixed = always "
                   "speculate at --num-draft-tokens (else the controller decides); the first one's rollouts train the policy")
    p.add_argument("--compare", action="store_true", help="decode every step's rollouts with every listed drafter (else only the first)")
    p.add_argument("--async", dest="async_mode", action="store_true", help="overlap the rollouts of step t+1 with the update of step t")
    p.add_argument("--task", default="", help="comma list of reasoning-gym task names (default: the measured default mix)")
    p.add_argument("--task-kwargs", default="", help='JSON: per task, generator settings, e.g. {"chain_sum": {"max_terms": 4}}')
    p.add_argument("--no-demonstration", action="store_true", help="zero-shot prompts (no worked example before the question)")
    p.add_argument("--reward", default="reasoning_gym", help="reasoning_gym | math_verify | module:function (text, problem, env) -> float")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--warmup-steps", type=int, default=0, help="optimiser steps of linear learning-rate warm-up")
    p.add_argument("--lr-schedule", default="constant", choices=["constant", "linear", "cosine"])
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.2, help="> --clip-low: DAPO's clip-higher, e.g. 0.28")
    p.add_argument("--loss-agg", default="seq_mean_token_mean", choices=["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"])
    p.add_argument("--no-std-norm", action="store_true", help="Dr. GRPO: advantages not divided by the group's std")
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the frozen initial policy")
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--mini-batches", type=int, default=1, help="optimiser steps per pass over a rollout batch")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--no-skip-zero-advantage", action="store_true", help="forward/backward samples with zero advantage too")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--no-adaptive-k", action="store_true", help="every drafter at a fixed draft length (as NAME@fixed)")
    p.add_argument("--eval-problems", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--sweep", default="", help="after training: rollout time per drafter at these batch sizes, e.g. 1,4,16,32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--checkpoint", default=None, help="directory: saved after every step")
    p.add_argument("--resume", default=None, help="checkpoint directory to continue from (the same settings)")
    p.add_argument("--export", default=None, help="directory: the trained policy as a Hugging Face model (safetensors, config, tokenizer)")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--plot", default=None, help="PNG: held-out reward and exact accuracy, rollout time per drafter, the long tail")
    p.set_defaults(func=run_rl)
    return p


def env_config(task: str = "", task_kwargs: str = "", demonstration: bool = True):
    """The EnvConfig of `--task`, `--task-kwargs` and `--no-demonstration`."""
    from tandem.rl.envs import EnvConfig

    tasks = [t for t in task.split(",") if t]
    cfg = EnvConfig.for_tasks(tasks) if tasks else EnvConfig()
    if task_kwargs:
        try:
            extra = json.loads(task_kwargs)
        except json.JSONDecodeError as e:
            raise InvalidParameterError(f"--task-kwargs is not JSON: {e}") from e
        if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
            raise InvalidParameterError('--task-kwargs takes {"task": {"setting": value}}')
        cfg = EnvConfig(cfg.tasks, {t: cfg.task_kwargs.get(t, {}) | extra.get(t, {}) for t in set(cfg.task_kwargs) | set(extra)})
    if not demonstration:
        cfg = dataclasses.replace(cfg, demonstration=False)
    return cfg


def grpo_config(args):
    from tandem.rl.grpo import GRPOConfig

    return GRPOConfig(
        steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size, max_tokens=args.max_tokens,
        temperature=args.temperature, lr=args.lr, warmup_steps=args.warmup_steps, lr_schedule=args.lr_schedule,
        clip_low=args.clip_low, clip_high=args.clip_high, loss_agg=args.loss_agg, scale_adv_by_std=not args.no_std_norm,
        kl_coef=args.kl_coef, ppo_epochs=args.ppo_epochs, mini_batches=args.mini_batches, micro_batch=args.micro_batch,
        skip_zero_advantage=not args.no_skip_zero_advantage, eval_problems=args.eval_problems, eval_every=args.eval_every,
        async_mode=args.async_mode, seed=args.seed, env=env_config(args.task, args.task_kwargs, not args.no_demonstration),
    )


def run_rl(args, build=None) -> int:
    """`build`: the trainer builder, tandem.rl.setup.build_trainer's signature (`tandem rl --ray` passes the one whose
    rollouts run on Ray workers); checkpoint, resume, evaluation and the report are the same for every builder."""
    import torch

    from tandem.models.hf_export import check_destination
    from tandem.rl.checkpoint import load_checkpoint, save_checkpoint
    from tandem.rl.export import export_policy
    from tandem.rl.report import batch_sweep, plot, summarize, timestamp
    from tandem.rl.rewards import load_reward, reward_label
    from tandem.rl.setup import build_trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    drafters = [d for d in args.drafters.split(",") if d]
    if not drafters:
        raise InvalidParameterError("--drafters is empty")
    drafters = drafters if args.compare else drafters[:1]
    sizes = [int(s) for s in args.sweep.split(",") if s]
    cfg = grpo_config(args)
    reward_fn = load_reward(args.reward)
    if args.export:
        check_destination(args.export)  # refused before training, not after
    max_batch = max([cfg.prompts_per_step * cfg.group_size, cfg.eval_problems] + sizes)
    trainer = (build or build_trainer)(args.model, drafters, cfg, args.num_draft_tokens, not args.no_adaptive_k, max_batch=min(max_batch, 128),
                                       reward_fn=reward_fn)
    if args.resume:
        load_checkpoint(trainer, args.resume)
    started = timestamp()
    model_ref = str(Path(args.model).resolve()) if Path(args.model).is_dir() else args.model  # what the checkpoint records

    def on_step(record: dict) -> None:
        line = {k: round(record[k], 4) if isinstance(record[k], float) else record[k]
                for k in ("step", "reward_mean", "exact_mean", "completion_tokens_mean", "train_s", "sync_s", "step_wall_s", "entropy", "clip_fraction")}
        line |= {"rollout_s": {d: round(s, 2) for d, s in record["rollout_s"].items()}, "same_rollouts": record["same_rollouts"], "eval": record.get("eval")}
        print(json.dumps(line), flush=True)
        if args.checkpoint:
            save_checkpoint(trainer, args.checkpoint, model=model_ref)
        if args.json_out:  # progress survives an interrupted run
            Path(args.json_out).write_text(json.dumps({"partial": True, "history": trainer.history, "evals": trainer.evals}) + "\n")

    trainer.run(max(0, args.steps - trainer.step_index), on_step=on_step)
    result = {
        "command": "tandem rl", "started": started, "finished": timestamp(), "model": args.model, "drafters": drafters,
        "config": {k: v for k, v in vars(args).items() if k != "func"}, "summary": summarize(trainer.history),
        "evals": trainer.evals, "history": trainer.history,
    }
    if sizes:
        prompts = [trainer.env.render(p, trainer.tokenizer) for p in trainer.held_out] or \
                  [trainer.env.render(p, trainer.tokenizer) for p in trainer.step_problems(0)]
        prompts = (prompts * (max(sizes) // len(prompts) + 1))[: max(sizes)]
        result["sweep"] = batch_sweep(trainer.engines, prompts, sizes, cfg.max_tokens, cfg.temperature, cfg.seed)
    if args.plot:
        plot(trainer.history, trainer.evals, args.plot, f"tandem rl: {args.model}, {'async' if args.async_mode else 'sync'}",
             reward_label(args.reward))
    if args.export:
        result["export"] = str(export_policy(trainer.learner.named_tensors(), args.model, args.export))
    text = json.dumps(result, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(json.dumps({"summary": result["summary"], "evals": trainer.evals, "sweep": result.get("sweep"), "export": result.get("export")}, indent=1))
    return 0
