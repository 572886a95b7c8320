"""Validated in-place updates of the target's (the RL policy's) weights between engine steps.

Everything is checked before anything is written, so a refused update leaves the served weights
untouched: names must be parameters of the target, shapes and dtypes must match exactly, values must be
finite. The copy is `copy_` into the existing tensors (pointers unchanged), so anything that shares them
(a self-draft copy's embedding and norms) follows automatically; derived state (prepacked weights, KV
entries computed with the old weights) is the caller's to rebuild.
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.errors import PolicyUpdateError
from tandem.ops.checks import all_finite


def validate_named_tensors(model: nn.Module, named_tensors: dict[str, torch.Tensor]) -> None:
    """PolicyUpdateError on the first problem found; reads the model's state_dict (whatever the Linear
    layers' packing), writes nothing."""
    if not isinstance(named_tensors, dict):
        raise PolicyUpdateError(f"named_tensors must be a dict of name -> tensor, got {type(named_tensors).__name__}")
    buffers = {name for name, _ in model.named_buffers()}
    specs = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items() if name not in buffers}
    for name, tensor in named_tensors.items():
        if name not in specs:
            raise PolicyUpdateError(f"{name!r} is not a parameter of the target")
        if not isinstance(tensor, torch.Tensor):
            raise PolicyUpdateError(f"{name}: expected a tensor, got {type(tensor).__name__}")
        shape, dtype = specs[name]
        if tuple(tensor.shape) != shape:
            raise PolicyUpdateError(f"{name}: shape {tuple(tensor.shape)} != the target's {shape}")
        if tensor.dtype != dtype:
            raise PolicyUpdateError(f"{name}: dtype {tensor.dtype} != the target's {dtype}")
        if not all_finite(tensor):
            raise PolicyUpdateError(f"{name}: non-finite values")


@torch.no_grad()
def copy_named_(model: nn.Module, named_tensors: dict[str, torch.Tensor]) -> None:
    """Write validated tensors into the model's parameters in place. The model must hold its dense
    parameters (call its public `unpack()` first); tied weights are reachable under either name."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in named_tensors.items():
        params[name].copy_(tensor)
