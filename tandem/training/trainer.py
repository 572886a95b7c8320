"""The recipe trainer: an EAGLE head on packed batches streamed from feature shards.

One resumable loop: AdamW (warm-up, cosine decay over the wall-clock budget), gradient clipping, and every
`eval_every` steps a held-out evaluation per domain, an atomic checkpoint (head + optimiser + state) and,
when the held-out score improved, the best head saved as fp16 safetensors. A restart with the same DIR
resumes from the newest checkpoint; one that cannot be read is an error, never a silent fresh start.

Checkpoints live in DIR/ckpt/step-NNNNNNN/; DIR/ckpt/LATEST names the newest complete one and is replaced
atomically after the directory is complete, so there is always a valid checkpoint to resume from.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.errors import InvalidParameterError, ModelLoadError
from tandem.models.eagle import EagleConfig, EagleHead, load_eagle, new_eagle_head, save_eagle, target_identity
from tandem.training.features import DOMAIN_NAMES, FeatureStream, shard_docs, pack_documents, read_index
from tandem.training.packed import next_valid, packed_loss, packed_unroll, shifted
from tandem.training.recipes import Recipe

LATEST = "LATEST"
BEST = "best"


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0  # packed (non-pad) tokens consumed
    seconds: float = 0.0  # optimisation wall time over all sessions
    best_score: float = -1.0
    best_step: int = -1
    history: list[dict] = field(default_factory=list)
    init: str | None = None  # the exported head this run started from (`--init`); None: a fresh head


# ---- vocabulary -----------------------------------------------------------------------------------------
CLOCKS = {"wall": time.monotonic, "cpu": time.process_time}  # what a training budget counts (`tandem train --clock`)


def budget_clock(name: str):
    if name not in CLOCKS:
        raise InvalidParameterError(f"clock must be one of {sorted(CLOCKS)}, got {name!r}")
    return CLOCKS[name]


def domain_token_counts(directories: list[Path]) -> dict[str, Counter]:
    """Answer-token counts per domain over every shard present."""
    counts: dict[str, Counter] = {}
    for d in directories:
        index = read_index(d)
        for shard in index["shards"]:
            for doc in shard_docs(d / shard["file"], index["domains"], None):
                name = DOMAIN_NAMES[doc["domain"]] if doc["domain"] < len(DOMAIN_NAMES) else "other"
                counts.setdefault(name, Counter()).update(doc["tokens"][doc["prompt_len"] :].tolist())
    return counts


def document_token_counts(tokenizer, docs) -> dict[str, Counter]:
    """Token counts per domain of reference answers (or, where a domain has none, its prompts): known
    before any target forward, so the vocabulary does not depend on which shards happen to exist yet."""
    counts: dict[str, Counter] = {}
    for doc in docs:
        text = doc.answer if doc.answer is not None else doc.prompt
        counts.setdefault(doc.domain, Counter()).update(tokenizer.encode(text, add_special_tokens=False))
    return counts


def merge_counts(*parts: dict[str, Counter]) -> dict[str, Counter]:
    merged: dict[str, Counter] = {}
    for part in parts:
        for domain, c in part.items():
            merged.setdefault(domain, Counter()).update(c)
    return merged


def balanced_vocab(counts: dict[str, Counter], size: int, vocab_size: int) -> torch.Tensor:  # [size] long
    """The `size` tokens with the highest frequency averaged over domains (each domain's counts
    normalised first), so a large domain (code) cannot crowd out a small one (translation)."""
    score: Counter = Counter()
    for c in counts.values():
        total = sum(c.values()) or 1
        for token, n in c.items():
            score[token] += n / total
    ranked = [t for t, _ in sorted(score.items(), key=lambda kv: (-kv[1], kv[0])) if 0 <= t < vocab_size][:size]
    chosen = set(ranked)
    tail = (t for t in range(vocab_size) if t not in chosen)
    return torch.tensor(ranked + [next(tail) for _ in range(size - len(ranked))], dtype=torch.long)


def coverage(counts: dict[str, Counter], vocab: torch.Tensor) -> dict[str, float]:
    """Per domain: the share of answer tokens inside the vocabulary (the most a drafter could propose)."""
    inside = set(vocab.tolist())
    return {d: round(sum(n for t, n in c.items() if t in inside) / max(1, sum(c.values())), 4) for d, c in counts.items()}


# ---- evaluation ------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_heldout(head: EagleHead, heldout_dir: Path, steps: int, row_len: int) -> dict:
    """Greedy-chain agreement per domain on target-regenerated held-out answers.

    The held-out answers are the target's own greedy tokens, so a draft token at step s from root t is
    accepted exactly when it equals token t+s+2 and every earlier step was; `acceptance_length` is
    1 + the mean accepted run of a chain of `steps` drafts (what chain drafting at k = steps would get).
    """
    index = read_index(heldout_dir)
    docs = [doc for s in index["shards"] for doc in shard_docs(heldout_dir / s["file"], index["domains"], None)]
    report = {}
    for domain in sorted({d["domain"] for d in docs}):
        mine = [d for d in docs if d["domain"] == domain]
        hits, counted, runs = torch.zeros(steps), torch.zeros(steps), []
        for batch in pack_documents(mine, 8, row_len):
            outputs, _ = packed_unroll(head, batch, steps, None)
            correct, valid = [], []
            for s, hidden in enumerate(outputs):
                drafted = head.draft_to_target[head.lm_head(head.norm(hidden)).argmax(-1)]
                ok = next_valid(batch.segment, s + 2) & shifted(batch.answer, s + 1)
                correct.append((drafted == shifted(batch.tokens, s + 2)) & ok)
                valid.append(ok)
            correct, valid = torch.stack(correct), torch.stack(valid)  # [S, B, L]
            hits += correct.sum((1, 2)).float()
            counted += valid.sum((1, 2)).float()
            full = valid.all(0)
            runs.append(correct.long().cumprod(0).sum(0)[full].float())
        run = torch.cat(runs)
        name = DOMAIN_NAMES[domain] if domain < len(DOMAIN_NAMES) else "other"
        report[name] = {"accuracy_per_position": [round(float(h / max(c, 1)), 4) for h, c in zip(hits, counted)], "acceptance_length": round(1 + float(run.mean()) if run.numel() else 1.0, 4)}
    report["mean_acceptance_length"] = round(sum(v["acceptance_length"] for v in report.values()) / len(report), 4)
    return report


def selection_score(entry: dict) -> float:
    """What picks the best checkpoint: the validation split's mean acceptance length when the run has one
    (test-split prompts disjoint from the held-out ones, so the reported held-out score did not choose the
    checkpoint), else the held-out mean (runs made before the validation split existed)."""
    return entry["validation"]["mean_acceptance_length"] if "validation" in entry else entry["heldout"]["mean_acceptance_length"]


# ---- checkpoints -------------------------------------------------------------------------------------------
def save_checkpoint(ckpt_root: Path, head: EagleHead, optimizer: torch.optim.Optimizer, state: TrainState, keep: int = 2) -> Path:
    from safetensors.torch import save_file

    final = ckpt_root / f"step-{state.step:07d}"
    tmp = ckpt_root / f".tmp-step-{state.step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_eagle(head, tmp)
    tensors, groups = optimizer_tensors(optimizer)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"state": asdict(state), "param_groups": groups}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = ckpt_root / (LATEST + ".tmp")
    pointer.write_text(final.name)
    os.replace(pointer, ckpt_root / LATEST)
    for old in sorted(ckpt_root.glob("step-*"))[:-keep]:  # zero-padded names sort by step; `final` is the newest
        shutil.rmtree(old, ignore_errors=True)
    return final


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """AdamW state as flat named tensors (safetensors, never pickle) + its param groups as JSON."""
    sd = optimizer.state_dict()
    tensors = {f"{i}.{name}": (v if torch.is_tensor(v) else torch.tensor(v)).contiguous() for i, st in sd["state"].items() for name, v in st.items()}
    return tensors, sd["param_groups"]


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]) -> None:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        i, name = key.split(".", 1)
        state.setdefault(int(i), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def resume(ckpt_root: Path, target) -> tuple[EagleHead, dict[str, torch.Tensor], list[dict], TrainState] | None:
    """The newest checkpoint, or None when there is none; an unreadable one raises ModelLoadError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    pointer = ckpt_root / LATEST
    if not pointer.exists():
        return None
    path = ckpt_root / pointer.read_text().strip()
    try:
        head = load_eagle(path, target)
        tensors = load_file(str(path / "optimizer.safetensors"))
        meta = json.loads((path / "state.json").read_text())
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, SafetensorError) as e:
        raise ModelLoadError(f"cannot resume from {path}: {e}") from e
    return head, tensors, meta["param_groups"], TrainState(**meta["state"])


# ---- the loop ----------------------------------------------------------------------------------------------
def wait_for_features(out: Path, log, kinds: tuple[str, ...] = ("reference", "regenerated"), timeout_s: float = 3600.0, poll_s: float = 10.0) -> list[Path]:
    """Feature directories with at least one shard (and the held-out set), waiting while a concurrent
    `--phase features` process writes the first ones."""
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        ready = [out / "features" / k for k in kinds if has_shards(out / "features" / k)]
        if ready and has_shards(out / "features" / "heldout"):
            return ready
        if time.monotonic() > deadline:
            raise ModelLoadError(f"no feature shards appeared under {out / 'features'} within {timeout_s:.0f} s")
        if not announced:
            log(f"waiting for feature shards under {out / 'features'} ...")
            announced = True
        time.sleep(poll_s)


def has_shards(directory: Path) -> bool:
    return (directory / "index.json").exists() and bool(read_index(directory)["shards"])


def lr_at(step: int, progress: float, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def sample_roots(batch, fraction: float, rng: random.Random) -> torch.Tensor | None:
    if fraction >= 1.0:
        return None
    candidates = torch.nonzero((batch.segment > 0).any(0)).flatten().tolist()
    count = max(1, math.ceil(fraction * len(candidates)))
    return torch.tensor(sorted(rng.sample(candidates, min(count, len(candidates)))), dtype=torch.long)


def train_recipe(recipe: Recipe, out: Path, hours: float | None, log=print, init: str | Path | None = None, max_steps: int | None = None, clock: str = "wall") -> dict:
    """Train (or resume) until `hours` of optimisation have passed in this session, or until the run has taken
    `max_steps` optimiser steps (then the learning-rate schedule follows steps, not time: runs that must be
    compared at equal data, as in an ablation); without a checkpoint in `out`, start from the exported head
    `init` when given (see `starting_point`). `clock` is what `hours` (and the schedule) count: "wall", or
    "cpu", this process's CPU time, which a paused or starved run does not spend."""
    if hours is None and max_steps is None:
        raise InvalidParameterError("train_recipe needs hours or max_steps")
    now = budget_clock(clock)
    from tandem.training.recipes import load_target

    target, tokenizer = load_target(recipe)
    heldout = out / "features" / "heldout"
    feature_dirs = wait_for_features(out, log, recipe.feature_kinds)
    ckpt_root = out / "ckpt"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    head, saved_optimizer, state = starting_point(recipe, out, target, tokenizer, feature_dirs, init, log)
    peak_lr = recipe.init_lr if state.init else recipe.lr
    head.unpack()
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=peak_lr, weight_decay=0.0)
    if saved_optimizer is not None:
        load_optimizer_tensors(optimizer, *saved_optimizer)
    if state.init and state.step == 0:  # the starting head is the score to beat: best/ holds it until training does better
        log(json.dumps(_checkpoint_and_eval(head, optimizer, state, heldout, ckpt_root, out, recipe, float("nan"), {}, 0.0)))
    target_rows = target.lm_head.weight.detach().float()[head.draft_to_target]  # [Vd, d]
    rng = random.Random(f"{recipe.seed}:{state.step}")
    budget = 3600 * hours if hours is not None else float("inf")  # this session's time by `clock`; the schedule spans all sessions' time
    session_start = start = now()
    total = state.seconds + budget
    stream = FeatureStream(feature_dirs, target_identity(target.cfg))
    batches = stream.batches(recipe.rows, recipe.row_len, rng)
    window_tokens, window_start = 0, now()
    bar = tqdm(desc="train eagle", unit="step", disable=None)
    while now() - session_start < budget and (max_steps is None or state.step < max_steps):
        batch = next(batches)
        progress = state.step / max_steps if max_steps else (state.seconds + now() - start) / max(total, 1e-9)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(state.step, progress, peak_lr, recipe.warmup)
        loss, stats = packed_loss(head, target_rows, batch, recipe.unroll, sample_roots(batch, recipe.chain_fraction, rng), step_weight=recipe.step_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        state.step += 1
        state.tokens += batch.num_tokens
        window_tokens += batch.num_tokens
        bar.update()
        if state.step % recipe.eval_every == 0:
            elapsed = now() - window_start
            state.seconds += now() - start
            start = now()
            entry = _checkpoint_and_eval(head, optimizer, state, heldout, ckpt_root, out, recipe, float(loss.detach()), stats, window_tokens / max(elapsed, 1e-9))
            log(json.dumps(entry))
            window_tokens, window_start = 0, now()
            feature_dirs = wait_for_features(out, log, recipe.feature_kinds)
            stream = FeatureStream(feature_dirs, target_identity(target.cfg))  # pick up shards written meanwhile
            batches = stream.batches(recipe.rows, recipe.row_len, rng)
    state.seconds += now() - start
    entry = _checkpoint_and_eval(head, optimizer, state, heldout, ckpt_root, out, recipe, float("nan"), {}, 0.0)
    return {"recipe": asdict(recipe), "init": state.init, "final": entry, "best_step": state.best_step, "best_score": state.best_score, "steps": state.step, "tokens": state.tokens}


def starting_point(recipe: Recipe, out: Path, target, tokenizer, feature_dirs: list[Path], init: str | Path | None, log) -> tuple[EagleHead, tuple[dict, list] | None, TrainState]:
    """(head, saved optimiser tensors and groups or None, state). The newest checkpoint always wins, so a
    restarted run continues where it stopped; else the exported head `init` (its weights and its own draft
    vocabulary, a fresh optimiser and schedule); else a fresh head over a balanced vocabulary."""
    resumed = resume(out / "ckpt", target)
    if resumed is not None:
        head, tensors, groups, state = resumed
        log(f"resumed from step {state.step} ({state.tokens} tokens)")
        if init is not None:
            log(f"--init {init} ignored: resuming the checkpoint in {out / 'ckpt'}")
        return head, (tensors, groups), state
    if init is not None:
        path = Path(init).expanduser().resolve()
        head = load_eagle(path, target)
        log(f"starting from the exported head {path} (draft vocabulary {head.cfg.draft_vocab_size})")
        return head, None, TrainState(init=str(path))
    return fresh_head(recipe, out, target, tokenizer, feature_dirs), None, TrainState()


def fresh_head(recipe: Recipe, out: Path, target, tokenizer, feature_dirs: list[Path]) -> EagleHead:
    """An untrained head over the balanced vocabulary of the shards and sources; writes the coverage table
    of a few vocabulary sizes next to the run (DIR/vocab_coverage.json)."""
    counts = merge_counts(domain_token_counts(feature_dirs), vocab_source_counts(tokenizer, recipe))
    vocab = balanced_vocab(counts, min(recipe.draft_vocab, target.cfg.vocab_size), target.cfg.vocab_size)
    cfg = EagleConfig.for_target(target.cfg, len(vocab), shared_lm_head=recipe.shared_lm_head, intermediate_size=recipe.head_intermediate)
    head = new_eagle_head(target, cfg, vocab, torch.Generator().manual_seed(recipe.seed))
    sizes = sorted({8192, 16384, 32768, len(vocab)} & set(range(1, target.cfg.vocab_size + 1)))
    table = {size: coverage(counts, balanced_vocab(counts, size, target.cfg.vocab_size)) for size in sizes}
    (out / "vocab_coverage.json").write_text(json.dumps(table, indent=1))
    return head


def vocab_source_counts(tokenizer, recipe: Recipe) -> dict[str, Counter]:
    from tandem.data.packages import package_files
    from tandem.training import sources

    reference = sources.reference_documents(package_files(), recipe.domains, recipe.chatterbot)
    math_prompts = sources.regeneration_prompts(domains=("math",), seed=recipe.seed) if "math" in recipe.domains else []
    return document_token_counts(tokenizer, reference + math_prompts)


def _checkpoint_and_eval(head, optimizer, state: TrainState, heldout: Path, ckpt_root: Path, out: Path, recipe: Recipe, loss: float, stats: dict, tokens_per_s: float) -> dict:
    head.eval()
    report = evaluate_heldout(head, heldout, recipe.eval_depth, recipe.row_len)
    validation = heldout.parent / "validation"
    checked = evaluate_heldout(head, validation, recipe.eval_depth, recipe.row_len) if has_shards(validation) else None
    head.train()
    entry = {"step": state.step, "tokens": state.tokens, "seconds": round(state.seconds, 1), "loss": round(loss, 4), "train_tokens_per_s": round(tokens_per_s, 1), "train_top1": [round(c / max(n, 1), 3) for c, n in zip(stats.get("correct", []), stats.get("counted", []))], "heldout": report}
    if checked is not None:
        entry["validation"] = checked
    state.history.append(entry)
    score = selection_score(entry)
    if score > state.best_score:
        state.best_score, state.best_step = score, state.step
        tmp = out / f".{BEST}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_eagle(head, tmp, dtype=torch.float16)
        (tmp / "report.json").write_text(json.dumps(entry | {"init": state.init}, indent=1))  # the card says where the run started
        old = out / f".{BEST}.old"
        shutil.rmtree(old, ignore_errors=True)
        if (out / BEST).exists():
            os.replace(out / BEST, old)
        os.replace(tmp, out / BEST)
        shutil.rmtree(old, ignore_errors=True)
    save_checkpoint(ckpt_root, head, optimizer, state)
    return entry
