"""A calibration record: the fitted cost model of one target (and its drafters) on one machine.

Written by `tandem calibrate` (tandem.engine.calibrate measures and fits), read by the speculation
controller at start and by `tandem simulate --calibration`. JSON only.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.errors import InvalidParameterError
from tandem.sim.roofline import Machine, ModelWork
from tandem.sim.speculative import DraftCost

CALIBRATION_SCHEMA = 1
MAX_AGE_S = 30 * 24 * 3600  # older calibrations count as stale (drivers, kernels, load change)


@dataclass(frozen=True)
class Calibration:
    model: str
    fingerprint: dict  # the machine (cpu, cores, threads, torch): a different one makes the record stale
    work: ModelWork
    machine: Machine  # fitted: forward_seconds(work, machine, B, T, C)
    drafters: dict[str, DraftCost] = field(default_factory=dict)  # fitted drafter cost per drafter name
    measured: dict = field(default_factory=dict)  # raw numbers: bandwidth, matmul FLOP/s, timings, fit errors
    created: float = 0.0  # unix seconds
    schema: int = CALIBRATION_SCHEMA

    def to_json(self) -> dict:
        out = asdict(self)
        out["drafters"] = {k: asdict(v) for k, v in self.drafters.items()}
        return out

    @staticmethod
    def from_json(data: dict) -> "Calibration":
        try:
            return Calibration(
                model=data["model"], fingerprint=dict(data["fingerprint"]), work=ModelWork(**data["work"]),
                machine=Machine(**data["machine"]), drafters={k: DraftCost(**v) for k, v in data.get("drafters", {}).items()},
                measured=dict(data.get("measured", {})), created=float(data.get("created", 0.0)), schema=int(data.get("schema", 0)),
            )
        except (KeyError, TypeError) as e:
            raise InvalidParameterError(f"not a tandem calibration record: {e}") from e

    def stale_reason(self, fingerprint: dict, now: float | None = None) -> str | None:
        """Why this record should not be trusted on the machine with `fingerprint` (None = fresh)."""
        if self.schema != CALIBRATION_SCHEMA:
            return f"schema {self.schema} != {CALIBRATION_SCHEMA}"
        if self.fingerprint != fingerprint:
            return f"calibrated on another machine or kernel build ({self.fingerprint} vs {fingerprint})"
        age = (now or time.time()) - self.created
        if age > MAX_AGE_S:
            return f"{age / 86400:.0f} days old"
        return None


def save_calibration(calibration: Calibration, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(calibration.to_json(), indent=2) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a record
    return path


def load_calibration(path: str | Path) -> Calibration:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidParameterError(f"cannot read calibration {path}: {e}") from e
    return Calibration.from_json(data)
