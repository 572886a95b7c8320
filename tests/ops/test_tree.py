"""Draft-tree helpers on hand-made trees."""
from __future__ import annotations

import pytest
import torch

from tandem.errors import InvalidParameterError
from tandem.ops.tree import (
    batch_tree_attention_mask,
    chain_parents,
    children,
    depths,
    is_chain,
    leaves,
    path_to,
    positions,
    root_to_leaf_paths,
    tree_attention_mask,
    validate_parents,
)

#        root
#       /    \
#      0      1
#     / \     |
#    2   3    4
#    |
#    5
TREE = torch.tensor([-1, -1, 0, 0, 1, 2])


def test_chain_parents():
    assert chain_parents(4).tolist() == [-1, 0, 1, 2]
    assert chain_parents(0).tolist() == []
    assert is_chain(chain_parents(3)) and not is_chain(TREE) and is_chain(chain_parents(0))
    with pytest.raises(InvalidParameterError):
        chain_parents(-1)


def test_depths_and_positions():
    assert depths(TREE).tolist() == [0, 0, 1, 1, 1, 2]
    assert depths(chain_parents(4)).tolist() == [0, 1, 2, 3]
    assert positions(TREE, start=10).tolist() == [10, 10, 11, 11, 11, 12]
    assert depths(torch.empty(0, dtype=torch.long)).tolist() == []


def test_tree_attention_mask():
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree_attention_mask(TREE), expected)


def test_chain_mask_is_causal():
    assert torch.equal(tree_attention_mask(chain_parents(5)), torch.ones(5, 5, dtype=torch.bool).tril())


def test_mask_agrees_with_paths():
    mask = tree_attention_mask(TREE)
    for node in range(len(TREE)):
        assert mask[node].nonzero().flatten().tolist() == path_to(node, TREE)
        assert int(mask[node].sum()) == int(depths(TREE)[node]) + 1


def test_batch_mask_pads_with_self_attention():
    masks = batch_tree_attention_mask([TREE, chain_parents(2)])
    assert masks.shape == (2, 6, 6)
    assert torch.equal(masks[0], tree_attention_mask(TREE))
    assert torch.equal(masks[1, :2, :2], tree_attention_mask(chain_parents(2)))
    assert torch.equal(masks[1, 2:, :], torch.eye(6, dtype=torch.bool)[2:])  # padding: only itself
    assert not masks[1, :2, 2:].any()  # real nodes never see padding
    assert batch_tree_attention_mask([chain_parents(1)], num_nodes=3).shape == (1, 3, 3)
    with pytest.raises(InvalidParameterError):
        batch_tree_attention_mask([TREE], num_nodes=4)


def test_children_by_row():
    # Row convention of target_probs: entry 0 = the root, entry i + 1 = node i.
    assert children(TREE) == [[0, 1], [2, 3], [4], [5], [], [], []]
    assert children(torch.empty(0, dtype=torch.long)) == [[]]
    assert leaves(TREE) == [3, 4, 5]


def test_paths():
    assert path_to(5, TREE) == [0, 2, 5]
    assert path_to(4, TREE) == [1, 4]
    assert path_to(-1, TREE) == []
    assert root_to_leaf_paths(TREE) == [[0, 3], [1, 4], [0, 2, 5]]
    assert root_to_leaf_paths(chain_parents(3)) == [[0, 1, 2]]
    with pytest.raises(InvalidParameterError):
        path_to(6, TREE)


@pytest.mark.parametrize(
    "parents",
    [
        torch.tensor([0]),  # own index
        torch.tensor([-1, 2, 1]),  # forward reference
        torch.tensor([-2]),  # below -1
        torch.tensor([[-1, 0]]),  # not 1-D
        torch.tensor([-1.0, 0.0]),  # not integer
    ],
)
def test_validate_parents_rejects(parents):
    with pytest.raises(InvalidParameterError):
        validate_parents(parents)


def test_validate_parents_accepts():
    validate_parents(TREE)
    validate_parents(chain_parents(0))
    validate_parents(torch.tensor([-1, -1, -1], dtype=torch.int32))


def test_graft_sequence_reuses_the_shared_prefix_and_appends_the_rest():
    from tandem.ops.tree import graft_sequence

    tokens, parents = [5, 6, 7], [-1, 0, 1]  # chain 5 6 7
    assert graft_sequence(tokens, parents, [5, 6, 9, 10], 10) == ([5, 6, 7, 9, 10], [-1, 0, 1, 1, 3])
    assert graft_sequence(tokens, parents, [8], 10) == ([5, 6, 7, 8], [-1, 0, 1, -1])
    assert graft_sequence(tokens, parents, [5, 6, 7], 10) == (tokens, parents)  # already there
    assert graft_sequence(tokens, parents, [5, 9, 10], 4) == ([5, 6, 7, 9], [-1, 0, 1, 0])  # stops at max_nodes
    assert graft_sequence([], [], [1, 2], 5) == ([1, 2], [-1, 0])

