"""tandem.types: DraftTree's shape questions."""
import torch

from tandem.types import DraftTree


def test_is_chain():
    assert DraftTree.chain([5, 6, 7]).is_chain
    assert DraftTree.empty().is_chain
    assert not DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0])).is_chain  # two children of node 0
    assert not DraftTree(torch.tensor([5, 6]), torch.tensor([-1, -1])).is_chain  # two roots


def test_nodes_per_depth_of_a_chain_with_a_grafted_branch():
    draft = DraftTree(torch.tensor([1, 2, 3, 4, 9, 8]), torch.tensor([-1, 0, 1, 2, 1, 4]))  # chain of 4, branch off node 1
    assert draft.depths() == [0, 1, 2, 3, 2, 3]
    assert draft.nodes_per_depth() == [1, 1, 2, 2]
