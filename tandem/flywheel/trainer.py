"""The online drafter trainer: pulls traces from the buffer, trains an EAGLE head, publishes versions.

The loss is tandem.flywheel.objective's. `OnlineTrainer` runs `train_step` in a daemon thread (or
synchronously, for replay) on batches drawn from the whole buffer, publishes to a WeightStore every
`publish_every` steps, and checkpoints head + optimizer state (safetensors + JSON, never pickle) so a
restarted trainer resumes. Checkpoints are replaced atomically: each is written to its own directory
and a pointer file is switched with os.replace, so a valid checkpoint exists at every moment. When
serving rolls back a collapsed version, `request_restore` makes the trainer continue from the weights
rolled back to (with fresh optimiser moments), and its later versions say so (meta "restores"). A crash
stops the trainer only: it records the error and the engine keeps serving the last published weights.
"""
from __future__ import annotations

import json
import os
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
from tandem.flywheel.objective import flywheel_loss
from tandem.flywheel.pace import LossPacer, PaceConfig
from tandem.flywheel.weights import WeightStore, WeightVersion
from tandem.models.config import ModelConfig
from tandem.models.eagle import EagleHead, copy_head, load_eagle, save_eagle
from tandem.models.head_state import install_trainable, make_trainable, trainable_state

OPTIMIZER_FILE = "optimizer.safetensors"
ANCHOR_FILE = "anchor.safetensors"  # the weights FlywheelConfig.anchor pulls toward (when on)
STATE_FILE = "trainer.json"
LATEST_FILE = "LATEST"  # in a checkpoint directory: the name of the current checkpoint's subdirectory


SAMPLERS = ("uniform", "domains")


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
    recent: int = 0  # sample only the newest traces; 0 = the whole buffer (one domain must not erase another)
    anchor: float = 0.0  # decoupled pull toward the weights training started from (L2-SP); 0 = off
    sample: str = "uniform"  # "uniform" over the buffer's traces, or "domains": a domain uniformly, then a trace of it
    recent_share: float = 0.0  # share of each batch drawn from the newest `recent_window` traces (today's traffic); the rest as `sample` says
    recent_window: int = 32
    pace_margin: float | None = None  # None: step whenever there are traces; else rest when a round of steps lowers the newest traces' loss by less than this share (tandem.flywheel.pace)
    covered_weight: float = 1.0  # imitation weight of a (root, depth) the deployed drafter's prompt-lookup branch already drafts right
    # (eagle_ngram: the head's token there adds nothing); 1.0 = every position alike (tandem.flywheel.objective.lookup_covered)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.pace_margin is not None and self.pace_margin < 0:
            raise InvalidParameterError(f"pace_margin must be >= 0 (or None: no pacing), got {self.pace_margin}")
        if not (self.imitation or self.discard_weight > 0 or self.branch_weight > 0):
            raise InvalidParameterError("every loss term is off: enable imitation, discard_weight or branch_weight")
        if self.sample not in SAMPLERS:
            raise InvalidParameterError(f"sample must be one of {SAMPLERS}, got {self.sample!r}")
        if self.recent < 0:
            raise InvalidParameterError(f"recent must be >= 0, got {self.recent}")
        if not 0.0 <= self.recent_share <= 1.0 or self.recent_window < 1:
            raise InvalidParameterError(f"recent_share must be in [0, 1] and recent_window >= 1, got {self.recent_share}, {self.recent_window}")
        for name in ("unroll", "batch_size", "publish_every", "min_traces"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.covered_weight <= 1.0:
            raise InvalidParameterError(f"covered_weight must be in [0, 1], got {self.covered_weight}")
        if self.discard_weight < 0 or self.branch_weight < 0 or self.lr <= 0 or not 0 < self.chain_fraction <= 1:
            raise InvalidParameterError("discard_weight, branch_weight >= 0, lr > 0 and chain_fraction in (0, 1] are required")
        if not 0 <= self.anchor * self.lr < 1:
            raise InvalidParameterError(f"anchor must be >= 0 with anchor * lr < 1, got anchor {self.anchor}, lr {self.lr}")


def draw_batch(buffer: TraceBuffer, cfg: FlywheelConfig, rng: random.Random) -> list:
    """A training batch: round(batch_size x recent_share) traces from the newest `recent_window` (what is served
    now: a new domain is learned at once), the rest from the whole buffer (or the `recent` newest), uniformly or
    balanced over domains (what was served before is not forgotten)."""
    fresh = round(cfg.batch_size * cfg.recent_share)
    return (buffer.sample(fresh, rng, cfg.recent_window)
            + buffer.sample(cfg.batch_size - fresh, rng, cfg.recent or None, by_domain=cfg.sample == "domains"))


# ---- the trainer ------------------------------------------------------------------------------------------------------
class OnlineTrainer:
    def __init__(self, head: EagleHead, target_rows: torch.Tensor, buffer: TraceBuffer, store: WeightStore, cfg: FlywheelConfig = FlywheelConfig()):
        head.unpack()  # prepacked copies would go stale as the weights change
        self.head = make_trainable(head)  # a shared LM head stays frozen
        self.target_rows = target_rows.detach().float()
        self.buffer = buffer
        self.store = store
        self.cfg = cfg
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.anchor = [p.detach().clone() for p in self.params] if cfg.anchor > 0 else None  # the starting weights
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.rng = random.Random(cfg.seed)
        self.pacer = None if cfg.pace_margin is None else LossPacer(PaceConfig(margin=cfg.pace_margin))
        self._probe_batch: list = []  # the current pacing round's newest traces
        self.steps = 0
        self.lr_scale = 1.0  # set by the step schedule (tandem.flywheel.schedule): > 1 right after a domain shift
        self.resumed_from_step: int | None = None  # the checkpoint's step count, when resumed
        self.published: int | None = None  # last version published
        self.losses: deque[dict] = deque(maxlen=200)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one train_step / checkpoint at a time
        self.restores = 0  # rollbacks applied: versions published after the n-th carry meta["restores"] = n
        self._restore: WeightVersion | None = None  # requested by serving, applied at the next step

    # ---- rollback from serving ------------------------------------------------------------------------------
    def request_restore(self, version: WeightVersion) -> int:
        """Serving rolled back to `version`: continue training from those weights (never blocks the caller).
        Returns the `restores` count the versions trained from them will carry."""
        self._restore = version
        return self.restores + 1

    def _apply_restore(self) -> None:
        version, self._restore = self._restore, None
        if version is None:
            return
        install_trainable(self.head, version.tensors)
        self.optimizer.state.clear()  # the moments that led to the collapse go with it
        self.restores += 1

    # ---- one step ---------------------------------------------------------------------------------------
    def train_step(self) -> dict | None:
        """One optimiser step on a sampled batch; None when the buffer has too few traces or, paced, when the
        newest traces are already learnt (a step would buy little)."""
        if len(self.buffer) < self.cfg.min_traces:
            return None
        began = time.perf_counter()
        with self._lock:
            self._apply_restore()
            if self.pacer is not None and not self._worth_a_step():
                return None
            batch = draw_batch(self.buffer, self.cfg, self.rng)
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.lr * min(1.0, (self.steps + 1) / self.cfg.warmup) * self.lr_scale
            loss, parts = flywheel_loss(self.head, self.target_rows, batch, self.cfg, self.generator)
            if not torch.isfinite(loss):
                raise TandemError(f"non-finite flywheel loss at step {self.steps}: {parts}")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.optimizer.step()
            self._pull_to_anchor()
            self.steps += 1
            record = {"step": self.steps, "loss": float(loss.detach()), "seconds": round(time.perf_counter() - began, 4)} | parts
            self.losses.append(record)
            if self.pacer is not None:
                self.pacer.stepped()
            if self.steps % self.cfg.publish_every == 0:
                self.publish()
        return record

    def _worth_a_step(self) -> bool:
        """The pacer's verdict, probing the loss (forward only) on the round's newest `batch_size` traces when it asks;
        both probes of a round draw the same chains (a generator seeded by the round), so they differ by the steps only."""
        added = self.buffer.stats().added
        while self.pacer.wants_probe(added):
            if self.pacer.state == "start":
                self._probe_batch = [t for t in self.buffer.snapshot() if len(t.features) >= 2][-self.cfg.batch_size :]
            if not self._probe_batch:  # nothing the loss can read yet: no verdict, step as unpaced
                return True
            generator = torch.Generator().manual_seed(self.cfg.seed + 1 + self.pacer.rounds)
            with torch.no_grad():
                loss, _ = flywheel_loss(self.head, self.target_rows, self._probe_batch, self.cfg, generator)
            self.pacer.probe(float(loss), added)
        return self.pacer.may_step()

    def _pull_to_anchor(self) -> None:
        """theta -= lr * anchor * (theta - theta_0): weight decay toward the head training started from rather
        than toward zero (L2-SP), so a strong head adapts to the traffic without drifting away from what it
        knew; Adam's steps are ~lr per coordinate, so weights settle within ~1/anchor of theta_0."""
        if self.anchor is None:
            return
        with torch.no_grad():
            for p, start in zip(self.params, self.anchor):
                p.sub_(p - start, alpha=self.optimizer.param_groups[0]["lr"] * self.cfg.anchor)

    def publish(self) -> int:
        version = self.store.publish(trainable_state(self.head), {"trainer_step": self.steps, "restores": self.restores})
        self.published = version.version
        return version.version

    # ---- background thread --------------------------------------------------------------------------------
    def start(
        self, threads: int | None = 1, idle_s: float = 0.05, checkpoint_dir: str | Path | None = None, checkpoint_every: int = 100, duty: float = 1.0,
    ) -> "OnlineTrainer":
        """Train in a daemon thread (with its own torch thread count), checkpointing every `checkpoint_every`
        steps, busy at most a `duty` share of wall time (it rests after each step; the engine thread in the
        same process competes with it for the CPU and the interpreter lock)."""
        if not 0 < duty <= 1:
            raise InvalidParameterError(f"duty must be in (0, 1], got {duty}")
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        args = (threads, idle_s, checkpoint_dir, checkpoint_every, duty)
        self._thread = threading.Thread(target=self._loop, args=args, name="tandem-trainer", daemon=True)
        self._thread.start()
        return self

    def _loop(self, threads: int | None, idle_s: float, checkpoint_dir, checkpoint_every: int, duty: float) -> None:
        if threads:
            torch.set_num_threads(threads)
        try:
            while not self._stop.is_set():
                began = time.perf_counter()
                if self.train_step() is None:
                    self._stop.wait(idle_s)
                    continue
                if checkpoint_dir is not None and self.steps % checkpoint_every == 0:
                    self.save_checkpoint(checkpoint_dir)
                self._stop.wait(rest_after(time.perf_counter() - began, duty))
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
        """Head + optimiser state + counters into a new subdirectory of `path`, then the LATEST pointer is
        switched to it atomically (os.replace) and older ones are removed: a valid checkpoint at every moment."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        name = f"step-{self.steps:08d}-{time.time_ns()}"
        tmp = path / (name + ".tmp")
        with self._lock:
            self._apply_restore()  # a checkpoint never holds weights serving already rolled back from
            save_eagle(self.head, tmp)
            state = self.optimizer.state_dict()
            tensors = {f"{i}.{key}": value.detach().cpu().contiguous().reshape(value.shape) for i, s in state["state"].items() for key, value in s.items() if torch.is_tensor(value)}
            save_file(tensors, str(tmp / OPTIMIZER_FILE))
            if self.anchor is not None:
                save_file({str(i): a.contiguous() for i, a in enumerate(self.anchor)}, str(tmp / ANCHOR_FILE))
            meta = {"steps": self.steps, "published": self.published, "restores": self.restores, "config": asdict(self.cfg), "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]}
            (tmp / STATE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            # still under the lock: a concurrent save (the trainer's periodic one vs admin's "checkpoint now")
            # must not see this save's .tmp directory as a leftover and delete it
            tmp.rename(path / name)
            pointer = path / (LATEST_FILE + ".tmp")
            pointer.write_text(name + "\n")
            os.replace(pointer, path / LATEST_FILE)
            for old in path.iterdir():  # earlier checkpoints and leftovers of interrupted saves
                if old.is_dir() and old.name != name and old.name.startswith("step-"):
                    shutil.rmtree(old, ignore_errors=True)
        return path / name

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
        if self.anchor is not None and (path / ANCHOR_FILE).is_file():  # else: the resumed weights are the anchor
            anchor = load_file(str(path / ANCHOR_FILE))
            self.anchor = [anchor[str(i)].to(p.dtype) for i, p in enumerate(self.params)]
        self.steps = self.resumed_from_step = int(meta["steps"])
        self.published = meta.get("published")
        self.restores = int(meta.get("restores", 0))

    @classmethod
    def resume(cls, path: str | Path, target, buffer: TraceBuffer, store: WeightStore, cfg: FlywheelConfig = FlywheelConfig()) -> "OnlineTrainer":
        """A trainer continuing from `save_checkpoint`'s directory (head weights and optimiser moments);
        raises TandemError when it holds no readable checkpoint."""
        checkpoint = latest_checkpoint(path)
        if checkpoint is None:
            raise TandemError(f"no trainer checkpoint in {path} (no {LATEST_FILE} pointer to a complete checkpoint)")
        try:
            head = load_eagle(checkpoint, target)
            trainer = cls(head, target_lm_rows(target, head), buffer, store, cfg)
            trainer.load_optimizer(checkpoint)
        except Exception as e:  # safetensors / json raise their own error types on a corrupt file
            raise TandemError(f"cannot resume the trainer from {checkpoint}: {e}") from e
        return trainer


def resume_or_start(checkpoint_dir: str | Path | None, target, head: EagleHead, buffer: TraceBuffer, store: WeightStore, cfg: FlywheelConfig) -> OnlineTrainer:
    """The flywheel's trainer: resumed from `checkpoint_dir` when it holds anything (a checkpoint that cannot
    be read raises, never a silent fresh start), its weights published at once so that serving adopts them
    at the next step; else a fresh trainer on a copy of `head` (the served one is written by hot-swaps only)."""
    if checkpoint_dir is not None and Path(checkpoint_dir).is_dir() and any(Path(checkpoint_dir).iterdir()):
        trainer = OnlineTrainer.resume(checkpoint_dir, target, buffer, store, cfg)
        trainer.publish()
        return trainer
    return OnlineTrainer(trainer_copy(head), target_lm_rows(target, head), buffer, store, cfg)


# ---- what the trainer reads of the target -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Rows:
    weight: torch.Tensor  # [V, d]


@dataclass(frozen=True)
class TargetTables:
    """What the trainer reads of the target (`load_eagle`, `target_lm_rows`): its config, embedding and LM
    head. A trainer in another process never runs the target: it loads these tables only (the values served)."""

    cfg: ModelConfig
    embed: _Rows
    lm_head: _Rows


def save_target_tables(target, path: Path) -> None:
    from safetensors.torch import save_file

    embed, lm_head = target.embed.weight.detach().cpu(), target.lm_head.weight.detach().cpu()
    tensors = {"embed": embed.contiguous()}
    if lm_head.data_ptr() != embed.data_ptr():  # tied embeddings are written once
        tensors["lm_head"] = lm_head.contiguous()
    save_file(tensors, str(path), metadata={"config": json.dumps(asdict(target.cfg))})


def load_target_tables(path: Path) -> TargetTables:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        config = json.loads(f.metadata()["config"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    cfg = ModelConfig(**config | {"eos_token_ids": tuple(config["eos_token_ids"])})
    return TargetTables(cfg, _Rows(tensors["embed"]), _Rows(tensors.get("lm_head", tensors["embed"])))


def rest_after(busy_s: float, duty: float) -> float:
    """Seconds to rest after `busy_s` of work so that work is a `duty` share of the time."""
    return busy_s * (1.0 / duty - 1.0)


def latest_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint LATEST points to, if it is complete (its state file is written last), else None."""
    pointer = Path(path) / LATEST_FILE
    if not pointer.is_file():
        return None
    checkpoint = Path(path) / pointer.read_text().strip()
    return checkpoint if (checkpoint / STATE_FILE).is_file() else None


def target_lm_rows(target, head: EagleHead) -> torch.Tensor:  # [Vd, d]: the target's LM-head rows of the draft vocabulary
    return target.lm_head.weight.detach().float()[head.draft_to_target.cpu()]


def trainer_copy(head: EagleHead) -> EagleHead:
    """A separate, trainable copy of a served head (the served one is only ever written by hot-swaps)."""
    return copy_head(head)


def wait_for(predicate, timeout: float, poll: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return predicate()


