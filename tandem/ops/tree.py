"""Draft trees: pure helpers over the `parents` representation.

A draft of N nodes is given in topological order by `parents` ([N] long): `parents[i] == -1` means node
i is a child of the root (the last committed token); otherwise `0 <= parents[i] < i`. A chain of k
drafted tokens is `parents = [-1, 0, 1, ..., k-2]`.

Row convention shared with `target_probs` ([N+1, V]): row 0 is the root, row i+1 is node i. Helpers
that return one entry per row (`children`) use it too, so `children(parents)[row]` and
`target_probs[row]` describe the same position.

Depth counts a node's ancestors among the drafted nodes: root children have depth 0, a chain has
depths 0..k-1, and a node's position in the sequence is `start + depth` where `start` is the position
of the first not-yet-committed token (the number of committed tokens).
"""
from __future__ import annotations

import torch

from tandem.errors import InvalidParameterError


def chain_parents(k: int) -> torch.Tensor:  # [k] long
    """Parents of a chain of k drafted tokens: [-1, 0, ..., k-2]."""
    if k < 0:
        raise InvalidParameterError(f"chain length must be >= 0, got {k}")
    return torch.arange(k, dtype=torch.long) - 1


def validate_parents(parents: torch.Tensor) -> None:  # parents: [N] long
    """Raise InvalidParameterError unless `parents` is a 1-D integer tensor in topological order."""
    if parents.dim() != 1:
        raise InvalidParameterError(f"parents must be 1-D, got shape {tuple(parents.shape)}")
    if parents.dtype.is_floating_point or parents.dtype.is_complex or parents.dtype == torch.bool:
        raise InvalidParameterError(f"parents must be an integer tensor, got {parents.dtype}")
    for i, parent in enumerate(parents.tolist()):
        if not -1 <= parent < i:
            raise InvalidParameterError(
                f"parents[{i}] = {parent}: a parent must be -1 (the root) or an earlier node in [0, {i})"
            )


def depths(parents: torch.Tensor) -> torch.Tensor:  # parents: [N] -> [N] long, on parents' device
    """Number of drafted ancestors of each node (root children: 0; a chain: 0..k-1)."""
    out: list[int] = []
    for parent in parents.tolist():
        out.append(0 if parent < 0 else out[parent] + 1)
    return torch.tensor(out, dtype=torch.long, device=parents.device)


def positions(parents: torch.Tensor, start: int) -> torch.Tensor:  # parents: [N] -> [N] long
    """Sequence (RoPE) positions of the nodes when the first uncommitted position is `start`."""
    return depths(parents) + start


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:  # parents: [N] -> [N, N] bool
    """mask[i, j] is True iff node j is node i or one of its ancestors (a chain gives causal tril)."""
    parent_list = parents.tolist()
    n = len(parent_list)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parent_list):
        if parent >= 0:
            mask[i] |= mask[parent]  # topological order: the parent's row is already complete
    return mask.to(parents.device)


def batch_tree_attention_mask(
    parents_list: list[torch.Tensor],  # B tensors, each [N_b] long
    num_nodes: int | None = None,  # pad to this many nodes; None = max N_b
) -> torch.Tensor:  # [B, num_nodes, num_nodes] bool
    """Tree masks of B drafts padded to a common size; a padding node attends only to itself.

    Padding nodes are never attended to by real nodes, so their values cannot leak into real rows, and
    attending to themselves keeps every softmax row non-empty.
    """
    sizes = [int(p.numel()) for p in parents_list]
    width = max(sizes, default=0) if num_nodes is None else num_nodes
    if any(size > width for size in sizes):
        raise InvalidParameterError(f"num_nodes={width} is smaller than the largest tree ({max(sizes)})")
    device = parents_list[0].device if parents_list else torch.device("cpu")
    out = torch.eye(width, dtype=torch.bool, device=device).repeat(len(parents_list), 1, 1)
    for b, parents in enumerate(parents_list):
        out[b, : sizes[b], : sizes[b]] = tree_attention_mask(parents).to(device)
    return out


def children(parents: torch.Tensor) -> list[list[int]]:  # parents: [N]; returns N+1 lists
    """Children in index order, by row: entry 0 is the root's children, entry i+1 is node i's."""
    parent_list = parents.tolist()
    out: list[list[int]] = [[] for _ in range(len(parent_list) + 1)]
    for i, parent in enumerate(parent_list):
        out[parent + 1].append(i)
    return out


def leaves(parents: torch.Tensor) -> list[int]:  # parents: [N]
    """Nodes without children, in index order."""
    kids = children(parents)
    return [i for i in range(len(kids) - 1) if not kids[i + 1]]


def path_to(node: int, parents: torch.Tensor) -> list[int]:  # parents: [N]
    """Node indices from the root's first child down to `node` inclusive; [] for node -1 (the root).

    For the last accepted node this is the accepted path the engine keeps when compacting the KV cache.
    """
    parent_list = parents.tolist()
    if not -1 <= node < len(parent_list):
        raise InvalidParameterError(f"node {node} is out of range for a tree of {len(parent_list)} nodes")
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parent_list[node]
    return path[::-1]


def root_to_leaf_paths(parents: torch.Tensor) -> list[list[int]]:  # parents: [N]
    """One root-to-leaf node path per leaf, in leaf index order ([] for an empty tree: no paths)."""
    return [path_to(leaf, parents) for leaf in leaves(parents)]


def is_chain(parents: torch.Tensor) -> bool:  # parents: [N]
    """True iff the tree is a single chain [-1, 0, ..., N-2] (so chain fast paths apply)."""
    return torch.equal(parents.cpu().long(), chain_parents(parents.numel()))


def trie_from_sequences(sequences: list[list[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """Merge token sequences into a prefix tree (tokens, parents) in topological order.

    Shared prefixes become one path; sequences are inserted in order, so earlier ones own the first
    nodes; insertion stops when `max_nodes` nodes exist.
    """
    tokens: list[int] = []
    parents: list[int] = []
    child_of: dict[tuple[int, int], int] = {}
    for sequence in sequences:
        node = -1
        for token in sequence:
            nxt = child_of.get((node, token))
            if nxt is None:
                if len(tokens) == max_nodes:
                    return tokens, parents
                nxt = len(tokens)
                tokens.append(token)
                parents.append(node)
                child_of[(node, token)] = nxt
            node = nxt
    return tokens, parents


def graft_sequence(tokens: list[int], parents: list[int], sequence: list[int], max_nodes: int) -> tuple[list[int], list[int]]:
    """The tree (tokens, parents) with `sequence` added as a path from the root: nodes already holding the
    sequence's prefix are reused, the rest is appended (so the order stays topological), up to `max_nodes`."""
    tokens, parents = list(tokens), list(parents)
    node = -1
    for token in sequence:
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == token), None)
        if child is None:
            if len(tokens) >= max_nodes:
                break
            tokens.append(token)
            parents.append(node)
            child = len(tokens) - 1
        node = child
    return tokens, parents
