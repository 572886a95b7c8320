"""Which tensors of a drafter head training changes, and so what a drafter weight version carries.

A head's persistent state (its state_dict: the shared target embedding and the RoPE table are not in it) splits
into what training can change and what the head rebuilds from the target at load (`derived_keys`: a shared LM
head, `EagleConfig.shared_lm_head`, the target's own rows of the draft vocabulary). The derived entries are
frozen: no optimiser touches them (`make_trainable`), no saved head file holds them (`save_eagle`), and no
weight version carries them (`trainable_state`: what a trainer publishes, the hot-swapper validates, checksums
and installs with `install_trainable`, which leaves them, and their packed copies, untouched).
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.errors import InvalidParameterError
from tandem.models.linear import Linear


def derived_keys(cfg) -> tuple[str, ...]:
    """State entries rebuilt from the target at load (a shared LM head): frozen, never saved, never published."""
    return ("lm_head.weight",) if getattr(cfg, "shared_lm_head", False) else ()


def trainable_state(head: nn.Module) -> dict[str, torch.Tensor]:
    """What a drafter weight version carries: the head's persistent state less `derived_keys`. The index buffer
    draft_to_target is carried (never trained) so that a version for another draft vocabulary is refused. The
    tensors are the head's own: writing them changes the head (while its Linears keep their dense weights, as
    a served head's pack() does)."""
    frozen = derived_keys(head.cfg)
    return {name: tensor for name, tensor in head.state_dict().items() if name not in frozen}


def make_trainable(head: nn.Module) -> nn.Module:
    """`head` in training mode, every parameter trainable except the derived (frozen) ones."""
    head.train().requires_grad_(True)
    for name in derived_keys(head.cfg):
        head.get_parameter(name).requires_grad_(False)
    return head


@torch.no_grad()
def install_trainable(head: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a weight version (exactly `trainable_state`'s names) into the head in place (no new tensors); each
    Linear it writes is repacked as it was (Linear's load_state_dict: same kernel, a dropped dense weight dropped
    again), and derived entries (a shared LM head) are neither written nor repacked. InvalidParameterError, with
    the head unchanged, when the names or shapes differ."""
    own = trainable_state(head)
    if set(own) != set(tensors):
        raise InvalidParameterError(f"a weight version must carry exactly the head's trainable tensors: missing {sorted(set(own) - set(tensors))}, "
                                    f"not taken {sorted(set(tensors) - set(own))}")
    for name, tensor in own.items():
        if tensors[name].shape != tensor.shape:
            raise InvalidParameterError(f"{name} is {tuple(tensors[name].shape)}, the head's {tuple(tensor.shape)}")
    in_linears = set()
    for prefix, lin in head.named_modules():
        if isinstance(lin, Linear):
            local = {key: tensors[f"{prefix}.{key}"] for key in ("weight", "bias") if f"{prefix}.{key}" in own}
            in_linears |= {f"{prefix}.{key}" for key in local}
            if local:
                lin.load_state_dict(local)  # copy_ into its Parameters, then its packed copy rebuilt
    for name, tensor in own.items():
        if name not in in_linears:
            tensor.copy_(tensors[name])
