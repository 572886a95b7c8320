"""What one trainer step reads of the memory that stays put between steps: the head's weights, the target's rows
of the draft vocabulary, the embedding rows it looks up, and the optimiser's state.

A trainer next to serving competes for memory bandwidth (docs/BENCHMARKS.md 10: a bandwidth-bound neighbour
slowed decoding 42 %), so these bytes are its cost to serving. They are counted op by op under a torch
dispatch mode: every operator (forward, backward and optimiser) that takes one of these tensors adds the bytes
it reads of it; a lookup (embedding, index) adds the rows it gathers, a view adds nothing. Activations,
gradients and the traces are left out: they depend on the batch, not on what the trainer keeps.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
GATHERS = (aten.embedding.default, aten.index_select.default, aten.index.Tensor)  # read the rows they return, not the table


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class _ReadCounter(TorchDispatchMode):
    def __init__(self, kinds: dict[int, str]):
        super().__init__()
        self.kinds = kinds
        self.read: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for i, tensor in enumerate(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            kind = self.kinds.get(_key(tensor))
            if kind is not None:
                self.read[kind] += out.nbytes if func in GATHERS and i == 0 else tensor.numel() * tensor.element_size()
        return out


def kept_tensors(trainer) -> dict[int, str]:
    """Storage -> kind of what a trainer keeps between steps: "lm_head", "embedding", "layer" (the other head
    tensors), "target_rows", "optimizer" (its moments; present after the first step)."""
    kinds = {_key(t): "layer" for t in list(trainer.head.parameters()) + list(trainer.head.buffers())}
    kinds[_key(trainer.head.lm_head.weight)] = "lm_head"
    kinds[_key(trainer.head.embed_weight)] = "embedding"
    kinds[_key(trainer.target_rows)] = "target_rows"
    for state in trainer.optimizer.state.values():
        kinds |= {_key(v): "optimizer" for v in state.values() if torch.is_tensor(v) and v.dim() > 0}
    return kinds


def step_reads(trainer) -> dict[str, int]:
    """Bytes one `trainer.train_step()` reads of each kind of kept tensor (the step is taken; {} if it took none)."""
    counter = _ReadCounter(kept_tensors(trainer))
    with counter:
        record = trainer.train_step()
    return dict(counter.read) if record is not None else {}
