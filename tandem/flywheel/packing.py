"""A trainer step's traces packed end to end, so the head's layer runs once per unroll step for the whole batch.

Run trace by trace, a step of B traces and an unroll of S read every weight of the draft layer B x S times
forward and again backward, at a few dozen rows a GEMM: a SmolLM2 head's step read 0.7 GB of layer weights for
4 traces (docs/BENCHMARKS.md 10), memory traffic that serving on the other core pays for. Packed, each unroll
step is one GEMM per weight over every trace's rows, and the branch nodes of every trace one more pass.

Layout: trace i's committed entries (feature f_t with token x_{t+1}, t = 0 .. m_i - 2) start at offsets[i],
followed by S - 1 padding entries, so a chain's step s (reading entry root + s) never leaves its own block. Each
entry carries its trace's segment id and its position within the trace (RoPE sees the positions the trace alone
would have); a chain attends within its own segment only (eagle_train.unroll_states with `segment`). Per trace,
the outputs equal those of its own unroll up to float rounding (tests/flywheel/test_packing.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from tandem.models.eagle import EagleHead
from tandem.models.eagle_train import forward_on, unroll_states
from tandem.training.offline import Example


class Packed(NamedTuple):
    hidden: list[list[torch.Tensor]]  # per trace, per unroll step: normed hidden states [1, R_s, d]
    context: tuple[torch.Tensor, torch.Tensor]  # step 0's keys and values at every packed entry [1, Hkv, N, D]
    offsets: list[int]  # where each trace's entries start


def pack_layout(examples: list[Example], unroll: int) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(offsets, input ids [1, N], taps [1, N, 3 d], segment [N], positions [N]) of the packed entries."""
    blocks = [len(e.tokens) - 1 + unroll - 1 for e in examples]
    offsets = [0]
    for b in blocks[:-1]:
        offsets.append(offsets[-1] + b)
    n = sum(blocks)
    ids = torch.zeros(1, n, dtype=torch.long)
    taps = torch.zeros(1, n, examples[0].taps.shape[-1])
    segment, positions = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long)
    for i, (e, o, b) in enumerate(zip(examples, offsets, blocks)):
        t = len(e.tokens) - 1
        ids[0, o : o + t] = e.tokens[1:]
        taps[0, o : o + t] = e.taps[:t].float()
        segment[o : o + b] = i
        positions[o : o + b] = torch.arange(b)
    return offsets, ids, taps, segment, positions


def packed_unroll(head: EagleHead, examples: list[Example], unroll: int, chains: list[torch.Tensor], firsts: list[torch.Tensor]) -> Packed:
    """The training-time-test unroll of every example at once: example i's step-0 states at roots firsts[i], its
    later steps at chains[i] (both increasing), as `eagle_states(head, [example], unroll, chains[i], firsts[i],
    project=False)` would give them one example at a time."""
    offsets, ids, taps, segment, positions = pack_layout(examples, unroll)
    first = torch.cat([f + o for f, o in zip(firsts, offsets)])
    chain = torch.cat([c + o for c, o in zip(chains, offsets)])
    steps, context = unroll_states(head, ids, head.fuse([taps]), unroll, chain, first, project=False, segment=segment, positions=positions)
    split = [steps[0].split([len(f) for f in firsts], dim=1)] + [s.split([len(c) for c in chains], dim=1) for s in steps[1:]]
    return Packed([[per_step[i] for per_step in split] for i in range(len(examples))], context, offsets)


def packed_branch_hidden(head: EagleHead, branches: list, packed: Packed) -> list[torch.Tensor | None]:  # per trace: [Nb, d] normed, or None
    """branches: per trace, its objective.BranchBatch or None. Every trace's branch nodes in one pass over the packed step-0 context: a node of trace i sees trace i's
    committed entries its own mask lets it see (`BranchBatch.mask`, shifted to the trace's offset) and its
    branch ancestors, nothing of another trace."""
    present = [(i, b) for i, b in enumerate(branches) if b is not None]
    if not present:
        return [None] * len(branches)
    sizes = [b.ids.shape[1] for _, b in present]
    entries, nodes = packed.context[0].shape[2], sum(sizes)
    mask = torch.zeros(nodes, entries + nodes, dtype=torch.bool)
    row = 0
    for (i, b), k in zip(present, sizes):
        o, c = packed.offsets[i], b.committed
        mask[row : row + k, o : o + c] = b.mask[:, :c]
        mask[row : row + k, entries + row : entries + row + k] = b.mask[:, c:]
        row += k
    ids = torch.cat([b.ids for _, b in present], dim=1)
    features = torch.cat([b.features.float() for _, b in present], dim=1)
    positions = torch.cat([b.positions for _, b in present], dim=1)
    group = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    hidden = head.norm(forward_on(head, packed.context, ids, head.fuse([features]), positions, mask, group)[0]).split(sizes)
    out: list[torch.Tensor | None] = [None] * len(branches)
    for (i, _), h in zip(present, hidden):
        out[i] = h
    return out
