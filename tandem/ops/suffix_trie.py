"""A bounded-depth suffix trie with occurrence counts, updated one token at a time (pure Python, no torch).

The trie holds every substring of length <= `depth` of the sequences extended into it, and for each its
number of occurrences: `count[node]` is how many times the node's string occurs (end positions), `out[node]`
how many of those occurrences are followed by another token (the sum of its children's counts). So
`count[child] / out[node]` is the empirical probability that the node's string continues with the child's
token, which is what a suffix drafter proposes from.

A sequence is extended through a *cursor*: the list of nodes of its current suffixes, `cursor[l]` the node of
the suffix of length l (cursor[0] is the root). Appending a token walks each cursor node one step (O(depth)
dict operations), so a sequence can grow while it is decoded and a continuation can start from another
sequence's cursor (an output after its prompt: substrings that cross into the output are counted once per
output, the prompt's own substrings once). The longest suffix of a sequence that occurred before and was
continued there is then read off its cursor with no search (`longest_continued`).
"""
from __future__ import annotations

import heapq
from array import array
from typing import Iterable, Sequence

from tandem.errors import InvalidParameterError

_STRIDE = 1 << 32  # child key: node * _STRIDE + token (token ids < 2**32)


class SuffixTrie:
    def __init__(self, depth: int):
        if depth < 1:
            raise InvalidParameterError(f"suffix trie depth must be >= 1, got {depth}")
        self.depth = depth
        self._child: dict[int, int] = {}
        self.token = array("q", [-1])  # per node: its last token (root: -1)
        self.level = array("q", [0])  # per node: its string's length
        self.count = array("q", [0])  # per node: occurrences of its string
        self.out = array("q", [0])  # per node: occurrences followed by another token
        self.best = array("q", [-1])  # per node: its most frequent child (first to reach the top count), -1 = none
        self.first = array("q", [-1])  # per node: first child (children form a linked list)
        self.sibling = array("q", [-1])  # per node: next child of the same parent

    def __len__(self) -> int:
        return len(self.count)

    @staticmethod
    def start() -> list[int]:
        """A cursor for a new, empty sequence."""
        return [0]

    def extend(self, cursor: list[int], tokens: Iterable[int]) -> list[int]:
        """Append tokens to the sequence whose cursor this is; returns the new cursor (the old one is not changed)."""
        depth, child, count, out, best, level = self.depth, self._child, self.count, self.out, self.best, self.level
        for token in tokens:
            new = [0]
            for node in cursor:
                if level[node] >= depth:
                    break  # cursor nodes are ordered by length
                key = node * _STRIDE + token
                c = child.get(key)
                if c is None:
                    c = self._add(node, token, key)
                count[c] += 1
                out[node] += 1
                b = best[node]
                if b < 0 or (b != c and count[c] > count[b]):
                    best[node] = c
                new.append(c)
            cursor = new
        return cursor

    def _add(self, parent: int, token: int, key: int) -> int:
        node = len(self.count)
        self._child[key] = node
        self.token.append(token)
        self.level.append(self.level[parent] + 1)
        self.count.append(0)
        self.out.append(0)
        self.best.append(-1)
        self.first.append(-1)
        self.sibling.append(self.first[parent])
        self.first[parent] = node
        return node

    def find(self, tokens: Sequence[int]) -> int:
        """The node of this string, or -1 when it never occurred (or is longer than depth)."""
        node = 0
        for token in tokens:
            node = self._child.get(node * _STRIDE + token, -1)
            if node < 0:
                return -1
        return node

    def children(self, node: int) -> list[int]:
        out, c = [], self.first[node]
        while c >= 0:
            out.append(c)
            c = self.sibling[c]
        return out

    def longest_continued(self, cursor: list[int], max_len: int) -> int:
        """The node of the longest suffix (length <= max_len) of the cursor's sequence that was followed by a token
        somewhere (out > 0), or 0 (the root) when none was."""
        for length in range(min(max_len, len(cursor) - 1), 0, -1):
            if self.out[cursor[length]] > 0:
                return cursor[length]
        return 0

    def match(self, context: Sequence[int], max_len: int) -> int:
        """As longest_continued, for a context that is not in the trie: binary search on the suffix length (a suffix
        of a continued string is itself continued, so the property is monotone). Returns 0 when none matches."""
        lo, hi, found = 1, min(max_len, len(context), self.depth - 1), 0
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self.find(context[len(context) - mid:])
            if node > 0 and self.out[node] > 0:
                found, lo = node, mid + 1
            else:
                hi = mid - 1
        return found

    def draft(self, node: int, max_nodes: int, max_depth: int, min_prob: float, width: int, prior: float = 0.0) -> tuple[list[int], list[int], list[float]]:
        """The most probable continuations after `node`, best first: (tokens, parents, path probabilities).

        A node's path probability is the product of count[child] / (out[parent] + prior) along the path from `node`
        (prior > 0 discounts continuations seen only a few times); nodes
        are taken in decreasing path probability while it is >= min_prob, at most max_nodes, at most max_depth
        deep, at most `width` children per node (width 1: a chain). Parents index earlier entries (-1 = `node`)."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        if max_nodes <= 0 or max_depth <= 0 or self.out[node] == 0:
            return tokens, parents, probs
        heap: list[tuple[float, int, int, int]] = []  # (-prob, tiebreak, trie node, parent entry)
        order = 0
        for c in self._top_children(node, width):
            heapq.heappush(heap, (-self.count[c] / (self.out[node] + prior), order, c, -1))
            order += 1
        while heap and len(tokens) < max_nodes:
            neg, _, c, parent = heapq.heappop(heap)
            if -neg < min_prob:
                break
            index = len(tokens)
            tokens.append(self.token[c])
            parents.append(parent)
            probs.append(-neg)
            depth = 1 if parent < 0 else _depth(parents, index)
            if depth < max_depth and self.out[c] > 0:
                for cc in self._top_children(c, width):
                    heapq.heappush(heap, (neg * self.count[cc] / (self.out[c] + prior), order, cc, index))
                    order += 1
        return tokens, parents, probs

    def _top_children(self, node: int, width: int) -> list[int]:
        if width == 1:
            b = self.best[node]
            return [b] if b >= 0 else []
        return sorted(self.children(node), key=lambda c: -self.count[c])[:width]


def _depth(parents: list[int], index: int) -> int:
    depth, p = 1, parents[index]
    while p >= 0:
        depth, p = depth + 1, parents[p]
    return depth
