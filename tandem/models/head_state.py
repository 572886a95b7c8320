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
    """Copy a weight version (exactly `trainable_state`'s names) into the head in place (no new tensors) and
    rebuild the packed copies of the packed Linears it wrote; derived entries (a shared LM head) are neither
    written nor repacked. InvalidParameterError, with the head unchanged, when the names differ."""
    own = trainable_state(head)
    if set(own) != set(tensors):
        raise InvalidParameterError(f"a weight version must carry exactly the head's trainable tensors: missing {sorted(set(own) - set(tensors))}, "
                                    f"not taken {sorted(set(tensors) - set(own))}")
    written = [lin for name, lin in head.named_modules() if isinstance(lin, Linear) and f"{name}.weight" in own]
    packed = [lin for lin in written if lin.is_packed]
    for lin in written:
        if lin.dense_dropped:  # its state_dict entry is a copy: write the restored Parameter instead
            lin.unpack()
    for name, tensor in trainable_state(head).items():
        tensor.copy_(tensors[name])
    if packed:
        head.pack(linears=packed)
