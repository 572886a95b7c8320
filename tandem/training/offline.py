"""Offline training of EAGLE and MTP drafter heads on the target's own greedy continuations.

1. Data: each prompt (chat-rendered) is continued greedily by our runtime; one more target forward over
   prompt + continuation records the tapped hidden states, the final hidden state and the target's
   argmax at every position (`Example`).
2. The reduced draft vocabulary is the most frequent tokens of those sequences.
3. Loss: soft cross-entropy of the draft logits against the target distribution restricted to the draft
   vocabulary (tandem.ops.losses), the target logits recomputed on the fly from the final hidden state
   and the target's LM-head rows. EAGLE trains with the training-time-test unroll (`eagle_train.unroll`,
   `unroll` steps feeding its own hidden states back); MTP head i learns position t+1+i's distribution.
4. AdamW with warm-up and cosine decay, a step and wall-clock budget; then per-position draft accuracy on
   held-out prompts (continuation rows only, where the fed tokens are the target's greedy ones, so the
   leading run of correct positions is exactly what greedy chain drafting would get accepted).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.errors import InvalidParameterError
from tandem.models.cpu_gemm import product_nt
from tandem.models.eagle import EagleConfig, EagleHead, draft_vocab_from_tokens, new_eagle_head, save_eagle
from tandem.models.eagle_train import unroll_states
from tandem.models.mtp import MtpConfig, MtpHeads, new_mtp_heads, save_mtp
from tandem.models.transformer import Transformer
from tandem.ops.losses import soft_cross_entropy

DRAFTERS = ("eagle", "mtp")


@dataclass(frozen=True)
class TrainConfig:
    drafter: str = "eagle"  # eagle | mtp
    model: str = "smollm2-135m"  # zoo name or model directory
    data: str = "builtin"  # builtin (train split), a JSONL file of {domain, prompt}, or a directory of traces-*.parquet
    domains: tuple[str, ...] = ()  # empty = every domain of the data
    max_prompts: int = 64  # prompts in all (train + held-out)
    max_tokens: int = 96  # greedy continuation length per prompt
    steps: int = 200  # optimiser steps at most
    minutes: float | None = None  # wall-clock budget of the optimisation loop
    draft_vocab: int = 8192  # reduced draft vocabulary size
    unroll: int = 4  # EAGLE training-time-test steps (= positions trained per chain)
    chain_fraction: float = 0.25  # EAGLE: share of chain roots unrolled past step 0 in each training step
    mtp_heads: int = 4  # MTP heads (draft positions)
    batch_size: int = 4  # sequences per optimiser step
    lr: float = 1e-3
    holdout: float = 0.1  # fraction of prompts held out for evaluation
    seed: int = 0
    out: str | None = None  # where to save the head

    def __post_init__(self) -> None:
        object.__setattr__(self, "domains", tuple(self.domains))
        if self.drafter not in DRAFTERS:
            raise InvalidParameterError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        for name in ("max_prompts", "max_tokens", "steps", "draft_vocab", "unroll", "mtp_heads", "batch_size"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.holdout < 1.0 or not 0.0 < self.chain_fraction <= 1.0:
            raise InvalidParameterError("holdout must be in [0, 1) and chain_fraction in (0, 1]")
        if self.lr <= 0 or (self.minutes is not None and self.minutes <= 0):
            raise InvalidParameterError("lr and minutes must be > 0")


@dataclass
class Example:
    """One sequence and what the target computed over it (all on CPU, float32)."""

    tokens: torch.Tensor  # [L] long: prompt + greedy continuation
    taps: torch.Tensor | None  # [L, 3 d]: tapped hidden states (EAGLE), None for MTP
    final_hidden: torch.Tensor  # [L, d] after the target's final norm
    target_next: torch.Tensor  # [L] long: the target's argmax at each position (predicts position + 1)
    prompt_len: int


# ---- data ------------------------------------------------------------------------------------------------
def greedy_continuations(target: Transformer, prompts: list[list[int]], max_tokens: int, batch_size: int = 8) -> list[list[int]]:
    """Plain greedy decoding with our engine (EOS ends a continuation early)."""
    from tandem.config import EngineConfig, SamplingParams
    from tandem.engine.engine import Engine

    max_len = max(len(p) for p in prompts) + max_tokens + 1
    engine = Engine(target, EngineConfig(max_batch_size=batch_size, max_model_len=min(max_len, target.cfg.max_position)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for prompt in prompts:
        engine.add_request(prompt, params)
    requests = list(engine.waiting)
    with tqdm(total=len(prompts) * max_tokens, desc="target continuations", unit="tok", disable=None) as bar:
        while engine.has_unfinished():
            bar.update(sum(len(out.new_token_ids) for out in engine.step()))
    return [r.output_ids for r in requests]


@torch.inference_mode()
def target_example(target: Transformer, tokens: list[int], prompt_len: int, taps: tuple[int, ...]) -> Example:
    out = target(torch.tensor([tokens]), taps=taps)
    tapped = torch.cat([h[0].float() for h in out.hidden], dim=-1) if taps else None
    return Example(torch.tensor(tokens), tapped, out.final_hidden[0].float(), out.logits[0].argmax(-1), prompt_len)


def build_examples(target: Transformer, prompts: list[list[int]], max_tokens: int, taps: tuple[int, ...]) -> list[Example]:
    continuations = greedy_continuations(target, prompts, max_tokens)
    return [target_example(target, p + c, len(p), taps) for p, c in tqdm(list(zip(prompts, continuations)), desc="target features", disable=None)]


def load_prompt_ids(cfg: TrainConfig, tokenizer) -> list[list[int]]:
    from tandem.data.prompts import load_prompts, render_chat

    domains = cfg.domains or None
    per_domain = max(1, math.ceil(cfg.max_prompts / len(cfg.domains))) if cfg.domains else None
    split = "train" if cfg.data == "builtin" else "all"
    prompts = load_prompts(cfg.data, domains=domains, per_domain=per_domain, split=split, seed=cfg.seed)
    return _interleave(render_chat(prompts, tokenizer), [p.domain for p in prompts])[: cfg.max_prompts]


def _interleave(items: list, keys: list[str]) -> list:
    """Round-robin over keys, so a prefix (and the held-out tail) mixes every domain."""
    groups: dict[str, list] = {}
    for item, key in zip(items, keys):
        groups.setdefault(key, []).append(item)
    longest = max((len(g) for g in groups.values()), default=0)
    return [g[i] for i in range(longest) for g in groups.values() if i < len(g)]


# ---- losses ----------------------------------------------------------------------------------------------
def _pad(examples: list[Example], field: str, length: int) -> torch.Tensor:  # [B, length, ...]
    rows = [getattr(e, field) for e in examples]
    out = rows[0].new_zeros((len(rows), length) + tuple(rows[0].shape[1:]))
    for i, row in enumerate(rows):
        out[i, : min(len(row), length)] = row[:length]
    return out


def _restricted_target(final_hidden: torch.Tensor, target_rows: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., Vd]
    """The target's next-token distribution restricted to the draft vocabulary and renormalised."""
    return torch.softmax(product_nt(final_hidden, target_rows), dim=-1)


@dataclass
class StepStats:
    """Per draft position: loss, and top-1 agreement with the target's greedy token."""

    loss: torch.Tensor  # scalar, differentiable
    correct: torch.Tensor  # [S, B, T] bool
    valid: torch.Tensor  # [S, B, T] bool: position exists
    continuation: torch.Tensor  # [B, T] bool: chain roots inside the continuation


def eagle_logits(
    head: EagleHead, examples: list[Example], unroll: int, chain_roots: torch.Tensor | None = None, first_roots: torch.Tensor | None = None,
    project: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The training-time-test unroll over a padded batch: logits per step ([B, T or R0, Vd], then [B, R, Vd])
    and the roots of each step. chain_roots [R]: roots unrolled past step 0 (a sample makes training
    cheaper); first_roots [R0]: roots whose step-0 logits are computed; None = all. project=False: the normed hidden
    states instead of logits (eagle_train.lm_head_rows projects many at once)."""
    logits, roots, _ = eagle_states(head, examples, unroll, chain_roots, first_roots, project)
    return logits, roots


def eagle_states(
    head: EagleHead, examples: list[Example], unroll: int, chain_roots: torch.Tensor | None = None, first_roots: torch.Tensor | None = None,
    project: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """eagle_logits, and step 0's keys and values at every entry (eagle_train.unroll_states)."""
    length = max(len(e.tokens) for e in examples)
    t = length - 1  # chain roots 0 .. L-2 (entry t pairs feature t with token t+1)
    tokens = _pad(examples, "tokens", length + unroll)  # [B, L+S]
    fused = head.fuse([_pad(examples, "taps", t)])
    logits, context = unroll_states(head, tokens[:, 1 : t + unroll], fused, unroll, chain_roots, first_roots, project)
    later = torch.arange(t) if chain_roots is None else chain_roots
    return logits, [torch.arange(t) if first_roots is None else first_roots] + [later] * (unroll - 1), context


def eagle_step(head: EagleHead, target_rows: torch.Tensor, examples: list[Example], unroll: int, chain_roots: torch.Tensor | None = None) -> StepStats:
    logits, roots = eagle_logits(head, examples, unroll, chain_roots)
    return _stats(examples, target_rows, logits, roots, head.draft_to_target)


def mtp_step(heads: MtpHeads, target_rows: torch.Tensor, examples: list[Example]) -> StepStats:
    length = max(len(e.tokens) for e in examples)
    t = length - 1
    logits = heads(_pad(examples, "final_hidden", t))  # [B, T, K, Vd]: head i at row t predicts position t+2+i
    return _stats(examples, target_rows, list(logits.unbind(2)), [torch.arange(t)] * logits.shape[2], heads.draft_to_target)


def target_positions(roots: list[torch.Tensor]) -> torch.Tensor:  # [P] sorted
    """Where the loss reads the target distribution: root + s + 1 for each unroll step s (the steps' positions
    overlap, so each is read once)."""
    return torch.unique(torch.cat([root + s + 1 for s, root in enumerate(roots)]))


def target_states(examples: list[Example], roots: list[torch.Tensor]) -> torch.Tensor:  # [B, P, d]
    """The target's final hidden states at `target_positions(roots)` (zeros past an example's end: masked)."""
    t = max(len(e.tokens) for e in examples) - 1
    return _pad(examples, "final_hidden", t + len(roots) + 1)[:, target_positions(roots)]


def _stats(examples: list[Example], target_rows: torch.Tensor, logits: list[torch.Tensor], roots: list[torch.Tensor], draft_to_target: torch.Tensor,
           probs: torch.Tensor | None = None, weights: list[torch.Tensor] | None = None) -> StepStats:
    """Draft position s at root t predicts the token after position t+s+1 (target distribution there).

    logits[s] [B, R_s, Vd] holds the chains rooted at roots[s] [R_s]; correct/valid are scattered back
    to [S, B, T] (positions a step did not unroll count as invalid). probs [B, P, Vd]: the target distribution
    at `target_positions(roots)` when the caller computed it (one pass over target_rows for many examples).
    weights[s] [B, R_s]: each prediction's weight in the loss (None: 1 each).
    """
    steps, batch, t = len(logits), len(examples), max(len(e.tokens) for e in examples) - 1
    greedy = _pad(examples, "target_next", t + steps + 1)
    lengths = torch.tensor([len(e.tokens) for e in examples]).unsqueeze(1)  # [B, 1]
    loss = 0.0
    correct = torch.zeros(steps, batch, t, dtype=torch.bool)
    valid = torch.zeros(steps, batch, t, dtype=torch.bool)
    read = target_positions(roots)
    if probs is None:
        with torch.no_grad():
            probs = _restricted_target(target_states(examples, roots), target_rows)  # [B, P, Vd]
    for s, (step_logits, root) in enumerate(zip(logits, roots)):
        position = root + s + 1  # [R] where the target distribution is read
        mask = position.unsqueeze(0) <= lengths - 1  # [B, R]
        target_probs = probs[:, torch.searchsorted(read, position)]
        vocab = step_logits.shape[-1]
        weight = mask.float() if weights is None else mask.float() * weights[s]
        loss = loss + soft_cross_entropy(step_logits.reshape(-1, vocab), target_probs.reshape(-1, vocab), weight.reshape(-1))
        correct[s][:, root] = draft_to_target[step_logits.detach().argmax(-1)] == greedy[:, position]
        valid[s][:, root] = mask
    continuation = torch.arange(t).unsqueeze(0) >= torch.tensor([e.prompt_len - 1 for e in examples]).unsqueeze(1)
    return StepStats(loss / steps, correct, valid, continuation)


step_stats = _stats  # the public name (the online flywheel trainer reuses the loss)


def sample_roots(length: int, fraction: float, generator: torch.Generator) -> torch.Tensor | None:  # [R] increasing, or None = all
    if fraction >= 1.0:
        return None
    count = max(1, math.ceil(fraction * (length - 1)))
    return torch.randperm(length - 1, generator=generator)[:count].sort().values


# ---- optimisation and evaluation ---------------------------------------------------------------------------
def lr_at(step: int, progress: float, lr: float, warmup: int = 20) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 10% as progress (0..1) runs out."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def fit(module: torch.nn.Module, step_fn, train: list[Example], cfg: TrainConfig, generator: torch.Generator) -> list[float]:
    """AdamW over random mini-batches until cfg.steps or cfg.minutes runs out (the schedule follows whichever
    is closer to its end); returns the loss per step."""
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    module.train()
    module.unpack()  # the prepacked copies would go stale as the weights change
    budget = 60 * cfg.minutes if cfg.minutes else math.inf
    start = time.monotonic()
    losses: list[float] = []
    bar = tqdm(range(cfg.steps), desc=f"train {cfg.drafter}", disable=None)
    for step in bar:
        progress = max(step / cfg.steps, (time.monotonic() - start) / budget)
        if progress >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, progress, cfg.lr)
        batch = [train[i] for i in torch.randint(len(train), (min(cfg.batch_size, len(train)),), generator=generator).tolist()]
        loss = step_fn(batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    module.eval()
    return losses


@torch.no_grad()
def evaluate(step_fn, examples: list[Example], batch_size: int = 4) -> dict:
    """Top-1 agreement per draft position and the mean accepted run of a greedy chain, continuation rows only."""
    correct, counted, runs = None, None, []
    for i in range(0, len(examples), batch_size):
        stats = step_fn(examples[i : i + batch_size])
        rows = stats.valid & stats.continuation.unsqueeze(0)  # [S, B, T]
        hits = (stats.correct & rows).sum((1, 2))
        correct = hits if correct is None else correct + hits
        counted = rows.sum((1, 2)) if counted is None else counted + rows.sum((1, 2))
        full = rows.all(0)  # chain roots whose every position exists
        leading = stats.correct.long().cumprod(0).sum(0)  # [B, T] accepted run from each root
        runs.append(leading[full].float())
    if correct is None:
        return {"accuracy_per_position": [], "mean_accepted_chain": 0.0}
    accepted = torch.cat(runs)
    return {
        "accuracy_per_position": [round(float(c) / max(1, int(n)), 4) for c, n in zip(correct, counted)],
        "mean_accepted_chain": round(float(accepted.mean()) if accepted.numel() else 0.0, 4),
    }


def new_head(cfg: TrainConfig, target: Transformer, train: list[Example], generator: torch.Generator):
    vocab = draft_vocab_from_tokens((e.tokens.tolist() for e in train), min(cfg.draft_vocab, target.cfg.vocab_size), target.cfg.vocab_size)
    if cfg.drafter == "eagle":
        return new_eagle_head(target, EagleConfig.for_target(target.cfg, len(vocab)), vocab, generator)
    return new_mtp_heads(target, MtpConfig.for_target(target.cfg, cfg.mtp_heads, len(vocab)), vocab)


def step_function(cfg: TrainConfig, module, target_rows: torch.Tensor, generator: torch.Generator | None = None):
    """The loss over a batch; with a generator (training), EAGLE unrolls only a sample of chain roots."""
    if cfg.drafter == "mtp":
        return lambda batch: mtp_step(module, target_rows, batch)
    if generator is None:
        return lambda batch: eagle_step(module, target_rows, batch, cfg.unroll)
    return lambda batch: eagle_step(module, target_rows, batch, cfg.unroll, sample_roots(max(len(e.tokens) for e in batch), cfg.chain_fraction, generator))


def train_head(cfg: TrainConfig, target: Transformer, examples: list[Example]) -> tuple[torch.nn.Module, dict]:
    """Split, build, evaluate untrained, fit, evaluate trained. Returns the head and a report."""
    generator = torch.Generator().manual_seed(cfg.seed)
    held = max(1, round(len(examples) * cfg.holdout)) if cfg.holdout > 0 and len(examples) > 1 else 0
    train, heldout = examples[: len(examples) - held], examples[len(examples) - held :]
    module = new_head(cfg, target, train, generator)
    target_rows = target.lm_head.weight.detach().float()[module.draft_to_target]  # [Vd, d] frozen
    eval_fn = step_function(cfg, module, target_rows)
    before = evaluate(eval_fn, heldout) if heldout else {}
    start = time.perf_counter()
    losses = fit(module, step_function(cfg, module, target_rows, generator), train, cfg, generator)
    seconds = time.perf_counter() - start
    after = evaluate(eval_fn, heldout) if heldout else {}
    report = {
        "drafter": cfg.drafter, "train_sequences": len(train), "heldout_sequences": len(heldout),
        "train_tokens": sum(len(e.tokens) for e in train), "steps": len(losses), "train_seconds": round(seconds, 1),
        "loss_first": round(losses[0], 4) if losses else None, "loss_last": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4) if losses else None,
        "heldout_untrained": before, "heldout_trained": after,
    }
    return module, report


def save_head(module, out: str | Path) -> Path:
    return save_eagle(module, out) if isinstance(module, EagleHead) else save_mtp(module, out)


def train_offline(cfg: TrainConfig, examples_fn=None) -> dict:
    """The whole `tandem train` job: data, head, fit, evaluate, save. examples_fn(target, taps) -> [Example]
    supplies the data instead of the prompts (tandem.flywheel.trace_training: spilled flywheel traces)."""
    from tandem.llm import load_tokenizer
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model

    start = time.perf_counter()
    model_dir = resolve_model(cfg.model)
    target = load_transformer(model_dir)
    target.pack()
    taps = EagleConfig.for_target(target.cfg).taps if cfg.drafter == "eagle" else ()
    if examples_fn is not None:
        examples = examples_fn(target, taps)
    elif Path(cfg.data).expanduser().is_dir():
        raise InvalidParameterError(f"{cfg.data} is a directory: trace shards train through tandem.flywheel.trace_training")
    else:
        examples = build_examples(target, load_prompt_ids(cfg, load_tokenizer(model_dir)), cfg.max_tokens, taps)
    data_seconds = time.perf_counter() - start
    module, report = train_head(cfg, target, examples)
    if cfg.out:
        report["saved_to"] = str(save_head(module, Path(cfg.out).expanduser()))
    return {"config": asdict(cfg), "data_seconds": round(data_seconds, 1), "total_seconds": round(time.perf_counter() - start, 1)} | report


# ---- command line ----------------------------------------------------------------------------------------
def add_train_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train an EAGLE or MTP drafter head offline on the target's own outputs")
    p.add_argument("--drafter", choices=DRAFTERS, default="eagle")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="builtin", help="builtin (train split), a JSONL file of {domain, prompt}, or a directory of flywheel traces (Parquet)")
    p.add_argument("--domains", default="", help="comma list, e.g. code,sql (default: all)")
    p.add_argument("--max-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=96, help="greedy continuation tokens per prompt")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--minutes", type=float, default=None, help="wall-clock budget of the optimisation loop")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--unroll", type=int, default=4, help="EAGLE training-time-test steps")
    p.add_argument("--chain-fraction", type=float, default=0.25, help="EAGLE: share of chain roots unrolled past step 0 per step")
    p.add_argument("--mtp-heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True, help="directory to save the head to (with --recipe: the run directory)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the report here")
    p.add_argument("--recipe", default=None, help="a named recipe (eagle-smollm2): feature shards + packed training, resumable")
    p.add_argument("--hours", type=float, default=None, help="with --recipe: the budget, in hours of --clock")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="with --recipe: what --hours counts; cpu: this process's CPU time, so a run paused or starved "
                        "by other jobs still gets its budget (with --threads 1, an hour of a quiet core)")
    p.add_argument("--phase", default="all", help="with --recipe: all | features | train")
    p.add_argument("--kinds", default=None, help="with --recipe: feature kinds to produce/train on (reference,regenerated)")
    p.add_argument("--export", default=None, help="with --recipe: copy the best head here (fp16 + card)")
    p.add_argument("--init", default=None, help="with --recipe: start from this exported head (its weights and draft vocabulary) when DIR has no checkpoint yet")
    p.add_argument("--ablate", action="append", default=[], metavar="FIELD=V1,V2",
                   help="with --recipe: train one fresh head per value (one field changed from the recipe) on DIR/features, same steps, one table (repeatable)")
    p.add_argument("--ablate-steps", type=int, default=100, help="with --ablate: optimiser steps per variant")
    p.add_argument("--parallel", type=int, default=2, help="with --ablate: variants trained at once (one thread each)")
    p.set_defaults(func=run_train)
    return p


def run_train(args, train=train_offline) -> int:
    """`tandem train`: args -> TrainConfig -> train(cfg) (train_offline, or the flywheel's train_from_traces)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(
        drafter=args.drafter, model=args.model, data=args.data, domains=tuple(d for d in args.domains.split(",") if d),
        max_prompts=args.max_prompts, max_tokens=args.max_tokens, steps=args.steps, minutes=args.minutes,
        draft_vocab=args.draft_vocab, unroll=args.unroll, chain_fraction=args.chain_fraction, mtp_heads=args.mtp_heads, batch_size=args.batch_size,
        lr=args.lr, seed=args.seed, out=args.out,
    )
    text = json.dumps(train(cfg), indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(text)
    return 0
