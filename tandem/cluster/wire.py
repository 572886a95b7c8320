"""What crosses Ray's object store: bytes only (safetensors + JSON metadata), never pickled tensors or tandem objects.

A drafter version is `version_to_bytes`'d and `ray.put` once by the trainer actor; every replica fetches the
same object and `version_from_bytes` rebuilds it with its checksum recomputed (a replica's HotSwapper then
validates it against the served head as it does in one process). Policy weights for RL rollout workers go
the same way (`tensors_to_bytes`). Traces use tandem.flywheel.traces.trace_to_bytes.
"""
from __future__ import annotations

import json

import torch

from tandem.flywheel.weights import WeightRefused, WeightVersion, checksum


def tensors_to_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, metadata=metadata)


def tensors_from_bytes(blob: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors.torch import load

    tensors = load(blob)
    header_len = int.from_bytes(blob[:8], "little")
    metadata = json.loads(blob[8:8 + header_len]).get("__metadata__", {})
    return tensors, metadata


def version_to_bytes(version: WeightVersion) -> bytes:
    return tensors_to_bytes(version.tensors, {"version": str(version.version), "checksum": version.checksum, "meta": json.dumps(version.meta)})


def version_from_bytes(blob: bytes) -> WeightVersion:
    """A WeightVersion from `version_to_bytes`; WeightRefused when the blob is unreadable or its checksum differs."""
    try:
        tensors, metadata = tensors_from_bytes(blob)
        version = WeightVersion(int(metadata["version"]), tensors, metadata["checksum"], json.loads(metadata.get("meta", "{}")))
    except Exception as e:  # noqa: BLE001 - safetensors/json raise their own types on a corrupt blob
        raise WeightRefused(f"unreadable drafter version blob: {e}") from e
    if checksum(tensors) != version.checksum:
        raise WeightRefused(f"version {version.version}: checksum mismatch after the object store")
    return version
