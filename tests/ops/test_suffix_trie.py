"""The suffix trie's counts, matches and drafts against brute force over random token strings."""
import random

import pytest

from tandem.errors import InvalidParameterError
from tandem.ops.suffix_trie import SuffixTrie

DEPTH = 5


def brute_counts(prompt, outputs, depth):
    """occurrences of every substring (len <= depth): the prompt's once, and per output those ending inside it."""
    counts = {}
    texts = [(prompt, 0)] + [(prompt + out, len(prompt)) for out in outputs]
    for text, first_end in texts:
        for end in range(max(first_end, 0), len(text)):
            for length in range(1, min(depth, end + 1) + 1):
                key = tuple(text[end - length + 1: end + 1])
                counts[key] = counts.get(key, 0) + 1
    return counts


def brute_continued(prompt, outputs, depth):
    """occurrences of each substring that are followed by another token within the same text."""
    counts = {}
    texts = [(prompt, 0)] + [(prompt + out, len(prompt)) for out in outputs]
    for text, first_end in texts:
        for end in range(max(first_end - 1, 0), len(text) - 1):  # an output continues its prompt's last token
            for length in range(1, min(depth - 1, end + 1) + 1):
                key = tuple(text[end - length + 1: end + 1])
                counts[key] = counts.get(key, 0) + 1
    return counts


def string_of(trie, node):
    out = []
    while node:
        out.append(trie.token[node])
        node = next(p for p in range(len(trie)) if node in trie.children(p))
    return tuple(reversed(out))


def build(prompt, outputs, depth=DEPTH, chunks=3):
    trie = SuffixTrie(depth)
    base = trie.extend(trie.start(), prompt)
    cursors = [base] * len(outputs)
    for i in range(0, max(map(len, outputs), default=0), chunks):  # interleaved, as siblings decode together
        for j, out in enumerate(outputs):
            cursors[j] = trie.extend(cursors[j], out[i: i + chunks])
    return trie, cursors


@pytest.mark.parametrize("seed", range(6))
def test_counts_match_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5])
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 15))]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 20))] for _ in range(rng.randrange(1, 5))]
    trie, _ = build(prompt, outputs)
    expected = brute_counts(prompt, outputs, DEPTH)
    got = {string_of(trie, n): trie.count[n] for n in range(1, len(trie))}
    assert got == expected
    continued = brute_continued(prompt, outputs, DEPTH)
    for node in range(1, len(trie)):
        key = string_of(trie, node)
        assert trie.out[node] == continued.get(key, 0) if len(key) < DEPTH else trie.out[node] == 0
        assert trie.out[node] == sum(trie.count[c] for c in trie.children(node))
        if trie.children(node):
            top = max(trie.count[c] for c in trie.children(node))
            assert trie.count[trie.best[node]] == top
    assert trie.out[0] == len(prompt) + sum(map(len, outputs))


@pytest.mark.parametrize("seed", range(6))
def test_longest_continued_and_match_agree_with_brute_force(seed):
    rng = random.Random(100 + seed)
    vocab = 3
    prompt = [rng.randrange(vocab) for _ in range(12)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 16))] for _ in range(3)]
    trie, cursors = build(prompt, outputs, depth=8)
    continued = brute_continued(prompt, outputs, 8)
    for out, cursor in zip(outputs, cursors):
        context = prompt + out
        for max_len in (1, 3, 7):
            want = max((n for n in range(1, max_len + 1) if continued.get(tuple(context[-n:]), 0) > 0), default=0)
            node = trie.longest_continued(cursor, max_len)
            assert trie.level[node] == want
            if want:
                assert string_of(trie, node) == tuple(context[-want:])
    for _ in range(20):  # contexts not in the trie: the binary search
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
        want = max((n for n in range(1, min(7, len(context)) + 1) if continued.get(tuple(context[-n:]), 0) > 0), default=0)
        assert trie.level[trie.match(context, 7)] == want


def test_draft_follows_the_most_frequent_continuation_and_stops_below_min_prob():
    trie = SuffixTrie(8)
    for text in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]):
        trie.extend(trie.start(), text)
    node = trie.find([1, 2])  # continued 3x by 3 then 3->4 (2 of 3), 3->5 (1 of 3); 1x by 9
    tokens, parents, probs = trie.draft(node, max_nodes=8, max_depth=8, min_prob=0.0, width=1)
    assert tokens == [3, 4] and parents == [-1, 0]
    assert probs == pytest.approx([0.75, 0.5])
    tokens, _, _ = trie.draft(node, 8, 8, min_prob=0.6, width=1)
    assert tokens == [3]  # 0.75 * 2/3 = 0.5 < 0.6
    tokens, parents, probs = trie.draft(node, 8, 8, min_prob=0.2, width=3)
    assert tokens == [3, 4, 9, 5] and parents == [-1, 0, -1, 0]  # best first: .75, .5, .25, .25 (ties: first pushed first)
    assert probs == pytest.approx([0.75, 0.5, 0.25, 0.25])
    assert trie.draft(node, 2, 8, 0.0, 3)[0] == [3, 4]
    assert trie.draft(node, 8, 1, 0.0, 3)[0] == [3, 9]


def test_depth_bounds_the_stored_substrings():
    trie = SuffixTrie(2)
    trie.extend(trie.start(), [1, 2, 3, 1, 2, 3])
    assert max(trie.level) == 2
    assert trie.find([1, 2, 3]) == -1 and trie.count[trie.find([1, 2])] == 2
    with pytest.raises(InvalidParameterError):
        SuffixTrie(0)
