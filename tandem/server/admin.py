"""Operator control of the served drafter: version history, adopt a version, roll back, training, checkpoint.

Every change goes through the validated hot-swap path: adopting version v re-publishes v's weights
(read back from disk with their checksum verified) as a new version to the WeightStore, and the engine's
HotSwapper validates and installs it between steps, so a step never mixes versions. In online mode the
trainer would supersede an adopted version at its next publish, so adopt/rollback pause training first.
Versions are kept as safetensors files in `versions_dir` (the newest `keep` plus the one being served), each
holding the head's trainable tensors only (never a shared LM head).
"""
from __future__ import annotations

import threading
from pathlib import Path

from tandem.errors import InvalidParameterError, TandemError
from tandem.flywheel.weights import HotSwapper, WeightStore, WeightVersion, checksum, load_version, save_version
from tandem.models.head_state import derived_keys, trainable_state

KEEP_VERSIONS = 16


class DrafterControl:
    def __init__(self, drafter, store: WeightStore, swapper: HotSwapper, versions_dir: Path, flywheel=None, keep: int = KEEP_VERSIONS):
        self.drafter, self.store, self.swapper, self.flywheel = drafter, store, swapper, flywheel
        self.versions_dir = versions_dir
        self.keep = keep
        self._lock = threading.Lock()
        store.directory = versions_dir  # every published version is also written here (WeightStore's own option)
        initial = {k: v.detach().to("cpu", copy=True) for k, v in trainable_state(drafter.head).items()}
        save_version(WeightVersion(drafter.version, initial, checksum(initial)), versions_dir)
        self._stop = threading.Event()
        threading.Thread(target=self._prune_forever, name="tandem-versions", daemon=True).start()

    @classmethod
    def build(cls, engine, flywheel, versions_dir: Path) -> "DrafterControl | None":
        """Control over the engine's drafter when it has swappable weights (an EAGLE head), else None."""
        if flywheel is not None:
            return cls(engine.drafter, flywheel.store, flywheel.swapper, versions_dir, flywheel)
        if engine.drafter is None or not hasattr(engine.drafter, "head"):
            return None
        store = WeightStore(first_version=engine.drafter.version + 1)
        return cls(engine.drafter, store, HotSwapper(engine.drafter, store).attach(engine), versions_dir)

    @property
    def trainer(self):
        return self.flywheel.trainer if self.flywheel is not None else None

    # ---- reading ----------------------------------------------------------------------------------------
    def status(self) -> dict:
        trainer = self.trainer
        return {
            "version": self.swapper.stats.version,
            "swaps": self.swapper.stats.as_dict(),
            "history": list(self.swapper.stats.events[-100:]),
            "available_versions": self.available(),
            "training": None if trainer is None else {"alive": trainer.alive, "steps": trainer.steps, "published": trainer.published,
                                                      "error": repr(trainer.error) if trainer.error else None},
        }

    def available(self) -> list[int]:
        return sorted(int(p.stem.rsplit("v", 1)[1]) for p in self.versions_dir.glob("drafter-v*.safetensors"))

    # ---- changing -----------------------------------------------------------------------------------------
    def adopt(self, version: int, reason: str = "adopt") -> dict:
        """Publish version `version`'s weights again; the engine swaps them in at a step boundary."""
        path = self.versions_dir / f"drafter-v{version:06d}.safetensors"
        if not path.exists():
            raise InvalidParameterError(f"drafter version {version} is not available; available: {self.available()}")
        weights = load_version(path, frozen=derived_keys(self.drafter.head.cfg))  # checksum verified; an older file: without its shared LM head
        with self._lock:
            self.pause_training()
            # operator-chosen weights do not descend from a collapsed version: pass the swapper's post-rollback gate
            restores = self.trainer.restores + 1 if self.trainer is not None else 0
            published = self.store.publish(weights.tensors, {"adopted_from": version, "reason": reason, "restores": restores})
        self.prune()
        return {"requested": version, "published_as": published.version}

    def rollback(self) -> dict:
        """Adopt the version served before the current one."""
        swaps = [e for e in self.swapper.stats.events if e["kind"] == "swap" and "from" in e]
        if not swaps:
            raise InvalidParameterError("no earlier drafter version to roll back to")
        return self.adopt(int(swaps[-1]["from"]), reason="rollback")

    def pause_training(self) -> bool:
        trainer = self.trainer
        if trainer is None or not trainer.alive:
            return False
        trainer.stop()
        return True

    def resume_training(self) -> bool:
        if self.trainer is None:
            raise InvalidParameterError("no trainer: start the server with --online")
        if self.trainer.error is not None:
            raise TandemError(f"the trainer stopped on an error and cannot resume: {self.trainer.error!r}")
        options = self.flywheel.options
        self.trainer.start(options.trainer_threads, checkpoint_dir=options.checkpoint_dir, checkpoint_every=options.checkpoint_every)
        return True

    def checkpoint(self) -> str:
        if self.trainer is None:
            raise InvalidParameterError("no trainer: start the server with --online")
        return str(self.trainer.save_checkpoint(self.flywheel.options.checkpoint_dir))

    def prune(self) -> None:
        """Delete version files beyond the newest `keep`, never the one being served."""
        serving = self.swapper.stats.version
        for version in self.available()[: -self.keep]:
            if version != serving:
                (self.versions_dir / f"drafter-v{version:06d}.safetensors").unlink(missing_ok=True)

    def _prune_forever(self, every_s: float = 10.0) -> None:
        """The trainer publishes continuously in online mode: keep the version directory bounded."""
        while not self._stop.wait(every_s):
            self.prune()

    def close(self) -> None:
        self._stop.set()
        if self.flywheel is None:
            self.swapper.close()
