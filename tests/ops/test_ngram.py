import numpy as np

from tandem.ops.ngram import ngram_candidates, ngram_propose
from tandem.ops.tree import trie_from_sequences


def test_longest_most_recent_match_wins():
    ctx = np.array([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # suffix [2, 3] matched at 1 and 6; the most recent earlier match (6) continues with 7, 8
    assert ngram_propose(ctx, 1, 4, 3) == [7, 8, 5]


def test_no_match_gives_empty_draft():
    assert ngram_propose(np.array([1, 2, 3, 4]), 1, 3, 4) == []


def test_candidates_are_distinct_and_ordered():
    ctx = np.array([5, 1, 2, 5, 3, 4, 5, 1, 9, 5])
    assert ngram_candidates(ctx, 1, 2, 2, 3) == [[1, 9], [3, 4], [1, 2]]


def test_trie_merges_prefixes_and_respects_budget():
    tokens, parents = trie_from_sequences([[1, 2, 3], [1, 4], [5]], max_nodes=10)
    assert tokens == [1, 2, 3, 4, 5] and parents == [-1, 0, 1, 0, -1]
    tokens, parents = trie_from_sequences([[1, 2, 3], [1, 4], [5]], max_nodes=4)
    assert tokens == [1, 2, 3, 4] and parents == [-1, 0, 1, 0]
