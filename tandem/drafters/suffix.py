"""`suffix` / `suffix_tree`: group suffix drafting, model-free (a suffix trie over the group's rollouts).

GRPO decodes n samples of one prompt at once, and earlier RL steps (or earlier requests, when serving) decoded
the same prompt: their text is the best predictor of a sample's next tokens. Per distinct prompt the drafter
keeps a `SuffixTrie` (tandem.ops.suffix_trie) holding the prompt once, then every output of that prompt, in
flight (extended as each sibling's tokens commit) and finished; a second trie holds recent finished outputs of
all prompts (lower priority: used only where its match is strictly longer). A proposal follows the longest
suffix of the request's context that occurred before and was continued there, and drafts the most frequent
continuations while their estimated path probability stays >= `min_prob` (no budget spent on guesses): count / (seen
+ prior) for sampled requests (a continuation seen once is weak evidence of what a sample does next), count / seen
for greedy ones (the target is deterministic there: what followed the same context once follows it again). The
proposal is deterministic (draft_probs None: a point mass), so the engine's verification keeps it lossless, at
any temperature. `suffix` drafts a chain, `suffix_tree` a tree (the top `width` continuations per node).

Memory is bounded, hard: after every on_prefill / on_verified / release, each prompt's trie holds at most
`max_group_nodes` nodes and all tries together (groups and the cross-prompt history) at most `max_total_nodes`.
Past a cap the drafter loses the least useful first: prompts with no live request (least recently used), then
the history's oldest outputs, then, in the largest live groups, their finished outputs (oldest first) and last
each live context cut to its newest tokens (halving the window, down to an empty trie): a live group is trimmed,
never evicted. A prompt is evicted past `max_prompts` only when no request of it is live. The history persists
across requests and policy updates (model-free: nothing goes stale); `reset()` forgets it.
Requests are duck-typed (DraftContext): on_prefill sees prompt + first token, so the prompt is all_ids[:-1].
"""
from __future__ import annotations

from collections import OrderedDict, deque

import torch

from tandem.drafters.base import DrafterBase, register
from tandem.errors import InvalidParameterError
from tandem.ops.suffix_trie import SuffixTrie
from tandem.types import DraftTree, chain_shapes


class _Group:
    """One prompt's trie: the prompt once, then its outputs (live ones by request id, finished ones newest last).

    `window` None: the trie holds the prompt, the finished outputs and each live output after the prompt. An int: it
    was trimmed to each live request's newest `window` context tokens (prompt + output) and the prompt's newest
    `window` tokens, each from the root (no finished outputs); 0 leaves the root alone."""

    def __init__(self, prompt: list[int], depth: int, max_nodes: int, keep_finished: int):
        self.prompt, self.depth, self.max_nodes = prompt, depth, max_nodes
        self.finished: deque[list[int]] = deque(maxlen=keep_finished)
        self.live: dict[str, list[int]] = {}  # request id -> its whole output so far (in the trie or not)
        self.cursors: dict[str, list[int]] = {}
        self._build([], None)

    def _build(self, finished: list[list[int]], window: int | None) -> None:
        self.trie = SuffixTrie(self.depth)
        if window is None:
            self.prompt_cursor = self.trie.extend(SuffixTrie.start(), self.prompt)
            for output in finished:
                self.trie.extend(self.prompt_cursor, output)
            self.cursors = {rid: self.trie.extend(self.prompt_cursor, out) for rid, out in self.live.items()}
            return
        self.prompt_cursor = self.trie.extend(SuffixTrie.start(), _newest(self.prompt, window))
        self.cursors = {rid: self.trie.extend(SuffixTrie.start(), _newest(self.prompt + out, window)) for rid, out in self.live.items()}

    def open(self, request_id: str) -> None:
        self.live[request_id] = []
        self.cursors[request_id] = self.prompt_cursor

    def append(self, request_id: str, tokens: list[int]) -> None:
        self.live[request_id].extend(tokens)
        self.cursors[request_id] = self.trie.extend(self.cursors[request_id], tokens)
        if len(self.trie) > self.max_nodes:
            self.trim(max(1, self.max_nodes // 2))  # half: the next trim is >= max_nodes / 2 new nodes away

    def close(self, request_id: str) -> list[int]:
        output = self.live.pop(request_id)
        self.cursors.pop(request_id)
        if output:
            self.finished.append(output)
        return output

    def trim(self, target: int) -> None:
        """Rebuild with at most `target` (>= 1) nodes, losing the least: the oldest finished outputs (keeping the newest
        half, then its newest half, ...), then every live context cut to its newest `window` tokens (halving), down to
        the root alone. Every live request keeps a cursor: it goes on decoding and drafting from what is left."""
        keep = list(self.finished)
        while keep:
            keep = keep[(len(keep) + 1) // 2:]  # the newest half (a single one is dropped too)
            self._build(keep, None)
            if len(self.trie) <= target:
                self.finished = deque(keep, maxlen=self.finished.maxlen)
                return
        self.finished.clear()
        self._build([], None)
        window = len(self.prompt) + max((len(out) for out in self.live.values()), default=0)
        while len(self.trie) > target:
            window //= 2
            self._build([], window)


def _newest(tokens: list[int], n: int) -> list[int]:
    return tokens[max(0, len(tokens) - n):] if n > 0 else []


class _History:
    """Recent finished outputs of all prompts in one trie (each its own sequence), rebuilt from the newest half
    (repeatedly, down to none) when it grows past max_nodes."""

    def __init__(self, depth: int, max_nodes: int, keep: int):
        self.depth, self.max_nodes = depth, max_nodes
        self.outputs: deque[list[int]] = deque(maxlen=keep)
        self.trie = SuffixTrie(depth)

    def add(self, output: list[int]) -> None:
        self.outputs.append(output)
        self.trie.extend(SuffixTrie.start(), output)
        if len(self.trie) > self.max_nodes:
            self.trim(max(1, self.max_nodes // 2))

    def trim(self, target: int) -> None:
        """Keep the newest half of the outputs until the trie has at most `target` (>= 1) nodes (none: the root)."""
        while len(self.trie) > target:
            keep = list(self.outputs)[(len(self.outputs) + 1) // 2:]
            self.outputs.clear()
            self.outputs.extend(keep)
            self.trie = SuffixTrie(self.depth)
            for out in keep:
                self.trie.extend(SuffixTrie.start(), out)


class SuffixDrafter(DrafterBase):
    name = "suffix"

    def __init__(self, num_draft_tokens: int = 8, width: int = 1, max_nodes: int | None = None, max_match: int = 16,
                 min_prob: float = 0.1, min_match: int = 1, depth: int | None = None, max_prompts: int = 256,
                 max_group_nodes: int = 200_000, max_total_nodes: int = 1_000_000, keep_finished: int = 64,
                 cross_prompt: bool = True, prior: float = 1.0):
        if num_draft_tokens < 1 or width < 1 or max_match < 1 or min_match < 1 or not 0.0 <= min_prob <= 1.0 or max_prompts < 1:
            raise InvalidParameterError(
                f"suffix needs num_draft_tokens, width, max_match, min_match, max_prompts >= 1 and 0 <= min_prob <= 1, got "
                f"{num_draft_tokens}, {width}, {max_match}, {min_match}, {max_prompts}, {min_prob}")
        self.k, self.width, self.max_match, self.min_prob, self.min_match = num_draft_tokens, width, max_match, min_prob, min_match
        self.max_nodes = max_nodes or (num_draft_tokens if width == 1 else 2 * num_draft_tokens)
        self.depth = depth or max_match + num_draft_tokens
        self.max_prompts, self.max_group_nodes, self.max_total_nodes, self.keep_finished = max_prompts, max_group_nodes, max_total_nodes, keep_finished
        if prior < 0:
            raise InvalidParameterError(f"suffix prior must be >= 0, got {prior}")
        if max_group_nodes < 2 or max_total_nodes < 2:  # a trie is at least its root; the history has one too
            raise InvalidParameterError(f"suffix needs max_group_nodes, max_total_nodes >= 2, got {max_group_nodes}, {max_total_nodes}")
        self.cross_prompt, self.prior = cross_prompt, prior
        self.reset()

    def reset(self) -> None:
        """Forget all history (live requests must not be running)."""
        self._groups: OrderedDict[tuple[int, ...], _Group] = OrderedDict()
        self._live: dict[str, tuple[_Group, int]] = {}  # request id -> (its group, prompt length)
        self._history = _History(self.depth, self.max_group_nodes, 4 * self.keep_finished)

    # ---- state -----------------------------------------------------------------------------------
    def on_prefill(self, request, target_out) -> None:
        ids = list(request.all_ids)
        prompt = tuple(ids[:-1])
        if request.request_id in self._live:  # a reused id: the old request ended without release
            self.release(request)
        group = self._groups.get(prompt)
        if group is None:
            if self._live_groups() + 2 > self.max_total_nodes:  # no room for one more root next to the live ones
                return  # untracked: the request drafts nothing
            group = self._groups[prompt] = _Group(list(prompt), self.depth, self.max_group_nodes, self.keep_finished)
        self._groups.move_to_end(prompt)
        group.open(request.request_id)
        self._live[request.request_id] = (group, len(prompt))
        group.append(request.request_id, ids[-1:])
        self._fit()

    def on_verified(self, requests, drafts, results, starts, target_out) -> None:
        for request in requests:
            entry = self._live.get(request.request_id)
            if entry is None:
                continue
            group, prompt_len = entry
            ids = request.all_ids
            new = ids[prompt_len + len(group.live[request.request_id]):]
            if new:
                group.append(request.request_id, list(new))
        self._fit()

    def release(self, request) -> None:
        entry = self._live.pop(request.request_id, None)
        if entry is None:
            return
        output = entry[0].close(request.request_id)
        if self.cross_prompt and output:
            self._history.add(output)
            self._fit()

    def nodes(self) -> int:
        """Nodes of all tries together: what max_total_nodes bounds."""
        return sum(len(g.trie) for g in self._groups.values()) + len(self._history.trie)

    def _live_groups(self) -> int:
        return len({id(g) for g, _ in self._live.values()})

    def _fit(self) -> None:
        """Back within max_prompts and max_total_nodes: evict prompts with no live request (least recently used first);
        if the nodes are still over, trim the history, then the largest live groups, to 3/4 of the cap (room to grow
        before the next trim). Live groups are never evicted, so the one just opened survives."""
        live = {id(g) for g, _ in self._live.values()}
        while len(self._groups) > self.max_prompts or self.nodes() > self.max_total_nodes:
            victim = next((key for key, g in self._groups.items() if id(g) not in live), None)
            if victim is None:
                break
            del self._groups[victim]
        if self.nodes() <= self.max_total_nodes:
            return
        over = self.nodes() - (self.max_total_nodes - self.max_total_nodes // 4)
        for trie_owner in [self._history] + sorted(self._groups.values(), key=lambda g: -len(g.trie)):
            if over <= 0:
                break
            before = len(trie_owner.trie)
            trie_owner.trim(max(1, before - over))
            over -= before - len(trie_owner.trie)

    def stats(self) -> dict:
        return {"prompts": len(self._groups), "nodes": sum(len(g.trie) for g in self._groups.values()),
                "history_nodes": len(self._history.trie), "live": len(self._live)}

    # ---- proposing -------------------------------------------------------------------------------
    def shapes(self):
        """One walk of the trie per request whatever the length asked for."""
        return chain_shapes(self.max_nodes, lambda n: 1, "suffix")

    def propose(self, requests, budgets: list[int]) -> list[DraftTree]:
        return [self._propose_one(r, min(b, self.max_nodes)) for r, b in zip(requests, budgets)]

    def _propose_one(self, request, budget: int) -> DraftTree:
        found = self.lookup(request, budget)
        if found is None:
            return DraftTree.empty()
        tokens, parents, _ = found
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def lookup(self, request, budget: int) -> tuple[list[int], list[int], list[float]] | None:
        """(tokens, parents, path probabilities) of the request's draft, or None when nothing is worth drafting."""
        entry = self._live.get(request.request_id)
        if budget <= 0 or entry is None:
            return None
        group = entry[0]
        trie, node = group.trie, group.trie.longest_continued(group.cursors[request.request_id], self.max_match)
        level = trie.level[node]
        if self.cross_prompt and level < self.max_match and len(self._history.trie) > 1:
            other = self._history.trie.match(request.all_ids, self.max_match)
            if self._history.trie.level[other] > level:
                trie, node, level = self._history.trie, other, self._history.trie.level[other]
        if level < self.min_match:
            return None
        depth = min(self.k, trie.depth - level)
        tokens, parents, probs = trie.draft(node, budget, depth, self.min_prob, self.width, 0.0 if request.params.greedy else self.prior)
        return (tokens, parents, probs) if tokens else None


def _builder(width: int):
    def build(num_draft_tokens: int = 8, **kwargs) -> SuffixDrafter:
        options = {k: kwargs[k] for k in ("max_match", "min_prob", "min_match", "max_prompts", "max_group_nodes", "max_total_nodes",
                                          "keep_finished", "cross_prompt", "prior") if k in kwargs}
        return SuffixDrafter(num_draft_tokens=num_draft_tokens, width=width, **options)

    return build


register("suffix")(_builder(1))
register("suffix_tree")(_builder(3))


class SuffixSelfDrafter:
    """`suffix_self`: per request, the suffix draft where it is confident (its expected accepted tokens under the
    trie's counts, the sum of the chain's path probabilities, >= min_expected), the int8 self-draft elsewhere.
    Each request's draft comes whole from one drafter, so verification stays lossless at any temperature (the
    self-draft's sampled draft_probs, or the suffix's point mass). The self-draft's forward runs for the whole
    batch whenever one request needs it: the saving is in acceptance, not in drafting time."""

    name = "suffix_self"
    taps: tuple[int, ...] = ()

    def __init__(self, suffix: SuffixDrafter, self_draft, min_expected: float = 1.5):
        self.suffix, self.self_draft, self.min_expected = suffix, self_draft, min_expected
        self.max_nodes = max(suffix.max_nodes, self_draft.max_nodes)
        self.chosen = {"suffix": 0, "self_draft": 0}  # requests drafted by each, over the drafter's life

    @property
    def version(self) -> int:
        return self.self_draft.version

    @version.setter
    def version(self, value: int) -> None:
        self.self_draft.version = value

    def resync(self) -> None:
        self.self_draft.resync()

    def shapes(self):
        """Chains, one self-draft pass per node (what a request costs when the suffix is not confident)."""
        return chain_shapes(self.max_nodes)

    def propose(self, requests, budgets: list[int]) -> list[DraftTree]:
        found = [self.suffix.lookup(r, min(b, self.suffix.max_nodes)) for r, b in zip(requests, budgets)]
        use_suffix = [f is not None and sum(f[2]) >= self.min_expected for f in found]
        model = self.self_draft.propose(requests, [0 if s else b for s, b in zip(use_suffix, budgets)])
        drafts = []
        for f, s, m in zip(found, use_suffix, model):
            self.chosen["suffix" if s else "self_draft"] += 1
            drafts.append(DraftTree(torch.tensor(f[0], dtype=torch.long), torch.tensor(f[1], dtype=torch.long)) if s else m)
        return drafts

    def on_prefill(self, request, target_out) -> None:
        self.suffix.on_prefill(request, target_out)
        self.self_draft.on_prefill(request, target_out)

    def on_verified(self, requests, drafts, results, starts, target_out) -> None:
        self.suffix.on_verified(requests, drafts, results, starts, target_out)
        self.self_draft.on_verified(requests, drafts, results, starts, target_out)

    def release(self, request) -> None:
        self.suffix.release(request)
        self.self_draft.release(request)

    def move_row(self, src_row: int, dst_row: int) -> None:
        self.self_draft.move_row(src_row, dst_row)

    def attach_target_cache(self, cache) -> None:
        self.self_draft.attach_target_cache(cache)


@register("suffix_self")
def _build_self(target, num_draft_tokens: int = 8, max_batch: int = 8, max_len: int | None = None, **kwargs) -> SuffixSelfDrafter:
    from tandem.drafters.self_draft import SelfDrafter

    suffix = _builder(1)(num_draft_tokens=num_draft_tokens, **kwargs)
    return SuffixSelfDrafter(suffix, SelfDrafter(target, num_draft_tokens, max_batch, max_len or target.cfg.max_position),
                             min_expected=kwargs.get("min_expected", 1.5))
