"""The online drafter trainer: pulls traces from the buffer, trains an EAGLE head, publishes versions.

Loss per batch of SequenceTraces (docs/ARCHITECTURE.md derives the discard term):

    L = [imitation] soft CE to the target over the committed sequence, with the training-time-test unroll
      + discard_weight * mean over rejected proposals of  -r * log(1 - q_theta(x))   (r: stop-gradient)
      + branch_weight  * soft CE to the target at drafted nodes off the accepted path (one tree-masked pass)

The imitation term is offline training's (tandem.training.offline) on the request's own committed
tokens and target hidden states. A rejected node at draft depth d whose chain began at committed
position t was proposed by unroll step d at root t: the discard term reads exactly that row. The branch
pass runs the head once over the committed entries plus every branch node, each branch node seeing the
committed context before its position and its own branch ancestors (teacher-forced with the target's
hidden states at its parent).

`OnlineTrainer` runs `train_step` in a daemon thread (or synchronously, for replay), publishes to a
WeightStore every `publish_every` steps, and checkpoints head + optimizer state (safetensors + JSON,
never pickle) so a restarted trainer resumes. A crash stops the trainer only: it records the error and
the engine keeps serving the last published weights.
"""
from __future__ import annotations

import json
import math

import random
import shutil
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.errors import InvalidParameterError, TandemError
from tandem.flywheel.buffer import TraceBuffer
from tandem.flywheel.traces import SequenceTrace
from tandem.flywheel.weights import WeightStore
from tandem.models.eagle import EagleHead, load_eagle, save_eagle, target_to_draft
from tandem.ops.losses import discard_loss, soft_cross_entropy
from tandem.training.offline import Example, eagle_logits, step_stats

OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer.json"
CHECKPOINT_MARKER = STATE_FILE  # written last: a directory with it holds a whole checkpoint


@dataclass(frozen=True)
class FlywheelConfig:
    imitation: bool = True  # soft CE to the target on the committed sequence (TTT unroll)
    discard_weight: float = 0.5  # weight of the unlikelihood term on rejected proposals (0 = off)
    branch_weight: float = 0.5  # weight of imitation on rejected branches (0 = off)
    unroll: int = 4  # training-time-test steps (>= the served draft length)
    chain_fraction: float = 0.25  # share of chain roots unrolled past step 0
    batch_size: int = 4  # traces per step
    lr: float = 5e-4
    warmup: int = 10
    weight_decay: float = 0.0
    publish_every: int = 10  # optimiser steps between published versions
    min_traces: int = 2  # wait for this many traces before training
    recent: int = 512  # sample only the newest traces (follow the traffic); 0 = all
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.imitation or self.discard_weight > 0 or self.branch_weight > 0):
            raise InvalidParameterError("every loss term is off: enable imitation, discard_weight or branch_weight")
        for name in ("unroll", "batch_size", "publish_every", "min_traces"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.discard_weight < 0 or self.branch_weight < 0 or self.lr <= 0 or not 0 < self.chain_fraction <= 1:
            raise InvalidParameterError("discard_weight, branch_weight >= 0, lr > 0 and chain_fraction in (0, 1] are required")


def trace_example(trace: SequenceTrace) -> Example:
    """The committed part of a trace as an offline-training Example (positions with target features only)."""
    m = len(trace.features)
    tokens = trace.tokens[:m]
    return Example(tokens, trace.features.float(), trace.final_hidden.float(), trace.tokens[1 : m + 1], min(trace.prompt_len, m))


# ---- the loss ---------------------------------------------------------------------------------------------------
def generated_roots(trace: SequenceTrace) -> torch.Tensor:  # [R] chain roots whose first draft token is generated output
    """Roots prompt_len - 1 .. M - 2: where the engine drafts (the prompt itself is never drafted)."""
    m = len(trace.features)
    first = min(max(trace.prompt_len - 1, 0), m - 2)
    return torch.arange(first, m - 1)


def flywheel_loss(head: EagleHead, target_rows: torch.Tensor, traces: list[SequenceTrace], cfg: FlywheelConfig, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
    """Mean over traces of the switched-on terms. Each trace runs alone (no padding): its step-0 logits are
    read at the generated positions only, and its chains are a `chain_fraction` sample of them plus every
    root a rejection past depth 0 needs."""
    traces = [t for t in traces if len(t.features) >= 2]
    if not traces:
        raise InvalidParameterError("no trace in the batch has two committed positions")
    to_draft = target_to_draft(head.draft_to_target.cpu(), head.cfg.target_vocab_size)
    totals: dict[str, torch.Tensor] = {}
    rejections = 0
    for trace in traces:
        roots = generated_roots(trace)
        events = _reject_events(trace, to_draft, cfg.unroll, roots)
        rejections += len(events[0])
        sampled = roots[torch.randperm(len(roots), generator=generator)[: max(1, math.ceil(cfg.chain_fraction * len(roots)))]]
        chains = torch.unique(torch.cat([sampled, events[0][events[1] > 0]]))
        example = trace_example(trace)
        logits, step_roots = eagle_logits(head, [example], cfg.unroll, chains, roots)
        parts = {}
        if cfg.imitation:
            parts["imitation"] = step_stats([example], target_rows, logits, step_roots, head.draft_to_target).loss
        if cfg.discard_weight > 0:
            parts["discard"] = cfg.discard_weight * _discard(logits, step_roots, events)
        if cfg.branch_weight > 0 and len(trace.branch_token):
            parts["branch"] = cfg.branch_weight * _branch_loss(head, target_rows, trace)
        for name, value in parts.items():
            totals[name] = totals.get(name, 0.0) + value / len(traces)
    loss = sum(totals.values())
    return loss, {k: float(v.detach()) for k, v in totals.items()} | {"rejections": rejections}


def _reject_events(trace: SequenceTrace, to_draft: torch.Tensor, unroll: int, roots: torch.Tensor):
    """(root, depth, draft id, r) of the trace's rejections the unroll can score."""
    if not len(trace.reject_token):
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, empty, torch.zeros(0)
    draft_ids = to_draft[trace.reject_token]
    keep = (trace.reject_depth < unroll) & (trace.reject_root >= roots[0]) & (trace.reject_root <= roots[-1]) & (draft_ids >= 0) & (trace.reject_weight > 0)
    return trace.reject_root[keep], trace.reject_depth[keep], draft_ids[keep], trace.reject_weight[keep]


def _discard(logits: list[torch.Tensor], step_roots: list[torch.Tensor], events) -> torch.Tensor:
    root, depth, token, weight = events
    if len(root) == 0:
        return logits[0].sum() * 0.0
    rows, tokens, weights = [], [], []
    for s in depth.unique().tolist():
        at = depth == s
        rows.append(logits[s][0, torch.searchsorted(step_roots[s], root[at])])
        tokens.append(token[at])
        weights.append(weight[at])
    return discard_loss(torch.cat(rows), torch.cat(tokens), torch.cat(weights).float())


def _branch_loss(head: EagleHead, target_rows: torch.Tensor, trace: SequenceTrace) -> torch.Tensor:
    """One forward over committed entries 0..C-1 plus the branch nodes, with a tree mask."""
    m = len(trace.features)
    keep = trace.branch_pos < m
    if not bool(keep.any()):
        return head.fc.weight.sum() * 0.0
    index = torch.cumsum(keep.long(), 0) - 1  # new index of each kept branch node
    parent = trace.branch_parent[keep]
    parent = torch.where(parent >= 0, index[parent.clamp(min=0)], parent)
    pos, token = trace.branch_pos[keep], trace.branch_token[keep]
    features = trace.features.float()
    committed = int(pos.max())  # entries 0..committed-1 are the context any branch node can see
    nb = len(pos)
    branch_feats = torch.where((parent >= 0).unsqueeze(1), trace.branch_features[keep].float()[parent.clamp(min=0)], features[pos])
    ids = torch.cat([trace.tokens[1 : committed + 1], token]).unsqueeze(0)
    feats = head.fuse([torch.cat([features[:committed], branch_feats]).unsqueeze(0)])
    positions = torch.cat([torch.arange(committed), pos]).unsqueeze(0)
    mask = torch.zeros(committed + nb, committed + nb, dtype=torch.bool)
    mask[:committed, :committed] = torch.ones(committed, committed, dtype=torch.bool).tril()
    mask[committed:, :committed] = torch.arange(committed).unsqueeze(0) < pos.unsqueeze(1)
    ancestors = torch.eye(nb, dtype=torch.bool)
    for i in range(nb):
        if parent[i] >= 0:
            ancestors[i] |= ancestors[int(parent[i])]
    mask[committed:, committed:] = ancestors
    logits, _ = head(ids, feats, positions, tree_mask=mask.unsqueeze(0))
    with torch.no_grad():
        target = torch.softmax(trace.branch_final[keep].float() @ target_rows.T, dim=-1)
    return soft_cross_entropy(logits[0, committed:], target)


# ---- the trainer ---------------------------------------------------------------------------------------------------
class OnlineTrainer:
    def __init__(self, head: EagleHead, target_rows: torch.Tensor, buffer: TraceBuffer, store: WeightStore, cfg: FlywheelConfig = FlywheelConfig()):
        self.head = head.train().requires_grad_(True)
        self.head.unpack()  # prepacked copies would go stale as the weights change
        self.target_rows = target_rows.detach().float()
        self.buffer = buffer
        self.store = store
        self.cfg = cfg
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.rng = random.Random(cfg.seed)
        self.steps = 0
        self.published: int | None = None  # last version published
        self.losses: deque[dict] = deque(maxlen=200)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one train_step / checkpoint at a time

    # ---- one step ---------------------------------------------------------------------------------------
    def train_step(self) -> dict | None:
        """One optimiser step on a sampled batch; None when the buffer has too few traces."""
        if len(self.buffer) < self.cfg.min_traces:
            return None
        batch = self.buffer.sample(self.cfg.batch_size, self.rng, self.cfg.recent or None)
        with self._lock:
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.lr * min(1.0, (self.steps + 1) / self.cfg.warmup)
            loss, parts = flywheel_loss(self.head, self.target_rows, batch, self.cfg, self.generator)
            if not torch.isfinite(loss):
                raise TandemError(f"non-finite flywheel loss at step {self.steps}: {parts}")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.optimizer.step()
            self.steps += 1
            record = {"step": self.steps, "loss": float(loss.detach())} | parts
            self.losses.append(record)
            if self.steps % self.cfg.publish_every == 0:
                self.publish()
        return record

    def publish(self) -> int:
        version = self.store.publish(self.head.state_dict(), {"trainer_step": self.steps})
        self.published = version.version
        return version.version

    # ---- background thread --------------------------------------------------------------------------------
    def start(self, threads: int | None = 1, idle_s: float = 0.05, checkpoint_dir: str | Path | None = None, checkpoint_every: int = 100) -> "OnlineTrainer":
        """Train in a daemon thread (with its own torch thread count), checkpointing every `checkpoint_every` steps."""
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        args = (threads, idle_s, checkpoint_dir, checkpoint_every)
        self._thread = threading.Thread(target=self._loop, args=args, name="tandem-trainer", daemon=True)
        self._thread.start()
        return self

    def _loop(self, threads: int | None, idle_s: float, checkpoint_dir, checkpoint_every: int) -> None:
        if threads:
            torch.set_num_threads(threads)
        try:
            while not self._stop.is_set():
                if self.train_step() is None:
                    self._stop.wait(idle_s)
                elif checkpoint_dir is not None and self.steps % checkpoint_every == 0:
                    self.save_checkpoint(checkpoint_dir)
        except BaseException as e:  # the engine keeps serving the last published weights
            self.error = e

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path) -> Path:
        """Head + optimiser state + counters, written to a temporary directory and renamed into place."""
        from safetensors.torch import save_file

        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with self._lock:
            save_eagle(self.head, tmp)
            state = self.optimizer.state_dict()
            tensors = {f"{i}.{key}": value.detach().cpu().contiguous().reshape(value.shape) for i, s in state["state"].items() for key, value in s.items() if torch.is_tensor(value)}
            save_file(tensors, str(tmp / OPTIMIZER_FILE))
            meta = {"steps": self.steps, "published": self.published, "config": asdict(self.cfg), "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]}
            (tmp / STATE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
        return path

    def load_optimizer(self, path: str | Path) -> None:
        from safetensors.torch import load_file

        path = Path(path)
        meta = json.loads((path / STATE_FILE).read_text())
        tensors = load_file(str(path / OPTIMIZER_FILE))
        state: dict[int, dict] = {}
        for name, value in tensors.items():
            index, key = name.split(".", 1)
            state.setdefault(int(index), {})[key] = value
        groups = [dict(g, params=list(range(len(self.params)))) for g in meta["param_groups"]]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        self.steps = int(meta["steps"])
        self.published = meta.get("published")

    @classmethod
    def resume(cls, path: str | Path, target, buffer: TraceBuffer, store: WeightStore, cfg: FlywheelConfig = FlywheelConfig()) -> "OnlineTrainer":
        """A trainer continuing from `save_checkpoint`'s directory (head weights and optimiser moments)."""
        head = load_eagle(path, target)
        trainer = cls(head, target_lm_rows(target, head), buffer, store, cfg)
        try:
            trainer.load_optimizer(path)
        except Exception as e:  # safetensors raises its own error type on a corrupt file
            raise TandemError(f"cannot resume the trainer from {path}: {e}") from e
        return trainer


def target_lm_rows(target, head: EagleHead) -> torch.Tensor:  # [Vd, d]: the target's LM-head rows of the draft vocabulary
    return target.lm_head.weight.detach().float()[head.draft_to_target.cpu()]


def trainer_copy(head: EagleHead) -> EagleHead:
    """A separate, trainable copy of a served head (the served one is only ever written by hot-swaps)."""
    copy = EagleHead(head.cfg, head.embed_weight, head.draft_to_target.clone())
    copy.load_state_dict(head.state_dict())
    return copy


def wait_for(predicate, timeout: float, poll: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return predicate()


