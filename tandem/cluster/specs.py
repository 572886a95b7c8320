"""What the cluster's actors are built from (frozen, plain values: they travel to other processes and nodes)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.errors import InvalidParameterError
from tandem.flywheel.trainer import FlywheelConfig


@dataclass(frozen=True)
class Placement:
    """Resources Ray reserves for an actor, and optionally the cores it is bound to on its node."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    cores: tuple[int, ...] | None = None  # os.sched_setaffinity inside the actor (num_cpus only reserves capacity)
    max_restarts: int = 1  # Ray restarts a dead actor this many times (-1: always)

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0 or self.max_restarts < -1:
            raise InvalidParameterError(f"num_cpus/num_gpus must be >= 0 and max_restarts >= -1, got {self}")

    def options(self, **extra) -> dict:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "max_restarts": self.max_restarts, **extra}


@dataclass(frozen=True)
class TrainerSpec:
    """The trainer actor: the drafter it trains (built as the replicas build theirs), loss, buffer, checkpoints."""

    model: str  # zoo name or model directory (on every node that may host the trainer)
    drafter_path: str | None = None  # eagle head directory (None: the day-0 head, as the replicas)
    draft_vocab_size: int | None = None
    num_draft_tokens: int = 4
    loss: FlywheelConfig = field(default_factory=FlywheelConfig)
    buffer_bytes: int = 256 << 20
    buffer_policy: str = "balance_domains"
    state_dir: str | None = None  # checkpoint/ and traces/ (spill) under it: a restarted trainer resumes from them
    spill: bool = True  # write traces to Parquet under state_dir/traces (False: memory only; a restart starts with an empty buffer)
    spill_max_bytes: int | None = 2 << 30  # spilled traces kept (the oldest shards are deleted beyond), as `tandem serve`
    spill_max_age_s: float | None = 7 * 86_400.0  # spilled shards older than this are deleted
    checkpoint_every: int = 100
    threads: int = 1
    placement: Placement = field(default_factory=Placement)

    @property
    def checkpoint_dir(self) -> str | None:
        return None if self.state_dir is None else f"{self.state_dir}/checkpoint"

    @property
    def spill_dir(self) -> str | None:
        return None if self.state_dir is None or not self.spill else f"{self.state_dir}/traces"
