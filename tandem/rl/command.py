"""`tandem rl`: GRPO with speculative rollouts; with --compare, every drafter decodes each step's rollouts.

Thin: args -> GRPOConfig -> build_trainer -> run (checkpoint every step when asked) -> summary, sweep, plot.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.errors import InvalidParameterError


def add_rl_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("rl", help="GRPO on verifiable tasks with speculative rollouts (and drafter comparison)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--drafters", default="self_draft", help="comma list of ar,ngram,self_draft,eagle,...; the first one's rollouts train the policy")
    p.add_argument("--compare", action="store_true", help="decode every step's rollouts with every listed drafter (else only the first)")
    p.add_argument("--async", dest="async_mode", action="store_true", help="overlap the rollouts of step t+1 with the update of step t")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--no-adaptive-k", action="store_true", help="fixed draft length instead of the engine's draft policy")
    p.add_argument("--tasks", default="add", help="comma list of add,sub,mul,word")
    p.add_argument("--max-value", type=int, default=10)
    p.add_argument("--eval-problems", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--sweep", default="", help="after training: rollout time per drafter at these batch sizes, e.g. 1,4,16,32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--checkpoint", default=None, help="directory: saved after every step")
    p.add_argument("--resume", default=None, help="checkpoint directory to continue from")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--plot", default=None, help="PNG: held-out reward, rollout time per drafter, the long tail")
    p.set_defaults(func=run_rl)
    return p


def run_rl(args) -> int:
    import torch

    from tandem.rl.checkpoint import load_checkpoint, save_checkpoint
    from tandem.rl.grpo import GRPOConfig
    from tandem.rl.report import batch_sweep, plot, summarize, timestamp
    from tandem.rl.setup import build_trainer
    from tandem.rl.tasks import TaskConfig, render_prompt

    if args.threads:
        torch.set_num_threads(args.threads)
    drafters = [d for d in args.drafters.split(",") if d]
    if not drafters:
        raise InvalidParameterError("--drafters is empty")
    drafters = drafters if args.compare else drafters[:1]
    sizes = [int(s) for s in args.sweep.split(",") if s]
    cfg = GRPOConfig(
        steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size, max_tokens=args.max_tokens,
        temperature=args.temperature, lr=args.lr, micro_batch=args.micro_batch, eval_problems=args.eval_problems,
        eval_every=args.eval_every, async_mode=args.async_mode, seed=args.seed,
        task=TaskConfig(kinds=tuple(k for k in args.tasks.split(",") if k), max_value=args.max_value),
    )
    max_batch = max([cfg.prompts_per_step * cfg.group_size] + sizes)
    trainer = build_trainer(args.model, drafters, cfg, args.num_draft_tokens, not args.no_adaptive_k, max_batch=max_batch)
    if args.resume:
        load_checkpoint(trainer, args.resume)
    started = timestamp()

    def on_step(record: dict) -> None:
        line = {k: record[k] for k in ("step", "reward_mean", "train_s", "sync_s", "step_wall_s")}
        line |= {"rollout_s": {d: round(s, 2) for d, s in record["rollout_s"].items()}, "eval": record.get("eval")}
        print(json.dumps(line), flush=True)
        if args.checkpoint:
            save_checkpoint(trainer, args.checkpoint)
        if args.json_out:  # progress survives an interrupted run
            Path(args.json_out).write_text(json.dumps({"partial": True, "history": trainer.history, "evals": trainer.evals}) + "\n")

    trainer.run(args.steps, on_step=on_step)
    result = {
        "command": "tandem rl", "started": started, "finished": timestamp(), "model": args.model, "drafters": drafters,
        "config": {k: v for k, v in vars(args).items() if k != "func"}, "summary": summarize(trainer.history),
        "evals": trainer.evals, "history": trainer.history,
    }
    if sizes:
        prompts = [render_prompt(p, trainer.tokenizer) for p in trainer.held_out] or [render_prompt(p, trainer.tokenizer) for p in trainer.step_problems(0)]
        prompts = (prompts * (max(sizes) // len(prompts) + 1))[: max(sizes)]
        result["sweep"] = batch_sweep(trainer.engines, prompts, sizes, cfg.max_tokens, cfg.temperature, cfg.seed)
    if args.plot:
        plot(trainer.history, trainer.evals, args.plot, f"tandem rl: {args.model}, {'async' if args.async_mode else 'sync'}")
    text = json.dumps(result, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(json.dumps({"summary": result["summary"], "evals": trainer.evals, "sweep": result.get("sweep")}, indent=1))
    return 0
