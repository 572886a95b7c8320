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

Memory is bounded: each trie is rebuilt from its most recent sequences when it exceeds `max_group_nodes`,
and whole prompts are evicted least recently used past `max_prompts` or `max_total_nodes`. The history
persists across requests and policy updates (model-free: nothing goes stale); `reset()` forgets it.
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
    """One prompt's trie: the prompt once, then its outputs (live ones by request id, finished ones newest last)."""

    def __init__(self, prompt: list[int], depth: int, max_nodes: int, keep_finished: int):
        self.prompt, self.depth, self.max_nodes = prompt, depth, max_nodes
        self.limit = max_nodes  # rebuild past this many nodes (raised while the live outputs alone need more)
        self.finished: deque[list[int]] = deque(maxlen=keep_finished)
        self.live: dict[str, list[int]] = {}  # request id -> its output so far
        self.cursors: dict[str, list[int]] = {}
        self._build([])

    def _build(self, finished: list[list[int]]) -> None:
        self.trie = SuffixTrie(self.depth)
        self.prompt_cursor = self.trie.extend(SuffixTrie.start(), self.prompt)
        for output in finished:
            self.trie.extend(self.prompt_cursor, output)
        self.cursors = {rid: self.trie.extend(self.prompt_cursor, out) for rid, out in self.live.items()}

    def open(self, request_id: str) -> None:
        self.live[request_id] = []
        self.cursors[request_id] = self.prompt_cursor

    def append(self, request_id: str, tokens: list[int]) -> None:
        self.live[request_id].extend(tokens)
        self.cursors[request_id] = self.trie.extend(self.cursors[request_id], tokens)
        if len(self.trie) > self.limit:
            self._shrink()

    def close(self, request_id: str) -> list[int]:
        output = self.live.pop(request_id)
        self.cursors.pop(request_id)
        if output:
            self.finished.append(output)
        self.limit = self.max_nodes  # the live outputs that raised it may be gone
        return output

    def _shrink(self) -> None:
        """Rebuild from the prompt, the live outputs and the newest finished ones, halving those until the trie is at
        most half the cap. Live outputs are always kept, so the trie stays <= max(max_nodes, 2 * (1 + depth * (prompt +
        live tokens))): the rebuild threshold doubles while the live outputs alone need more (amortized O(1) per token)."""
        keep = list(self.finished)
        while True:
            keep = keep[(len(keep) + 1) // 2:]  # the newest half (a single one is dropped too)
            self._build(keep)
            if len(self.trie) <= self.max_nodes // 2 or not keep:
                break
        self.finished.clear()
        self.finished.extend(keep)
        self.limit = max(self.max_nodes, 2 * len(self.trie))


class _History:
    """Recent finished outputs of all prompts in one trie (each its own sequence), rebuilt from the newest half
    when it grows past max_nodes."""

    def __init__(self, depth: int, max_nodes: int, keep: int):
        self.depth, self.max_nodes = depth, max_nodes
        self.outputs: deque[list[int]] = deque(maxlen=keep)
        self.trie = SuffixTrie(depth)

    def add(self, output: list[int]) -> None:
        self.outputs.append(output)
        self.trie.extend(SuffixTrie.start(), output)
        if len(self.trie) > self.max_nodes:  # rebuild from the newest half (the newest one alone if it is all that is left)
            keep = list(self.outputs)[(len(self.outputs) + 1) // 2:] or list(self.outputs)[-1:]
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
        group = self._groups.get(prompt)
        if group is None:
            group = self._groups[prompt] = _Group(list(prompt), self.depth, self.max_group_nodes, self.keep_finished)
            self._evict()
        self._groups.move_to_end(prompt)
        if request.request_id in self._live:  # a reused id: the old request ended without release
            self.release(request)
        group.open(request.request_id)
        group.append(request.request_id, ids[-1:])
        self._live[request.request_id] = (group, len(prompt))

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

    def release(self, request) -> None:
        entry = self._live.pop(request.request_id, None)
        if entry is None:
            return
        output = entry[0].close(request.request_id)
        if self.cross_prompt and output:
            self._history.add(output)

    def _evict(self) -> None:
        live_groups = {id(g) for g, _ in self._live.values()}
        while len(self._groups) > 1:
            total = sum(len(g.trie) for g in self._groups.values()) + len(self._history.trie)
            if len(self._groups) <= self.max_prompts and total <= self.max_total_nodes:
                return
            victim = next((key for key, g in self._groups.items() if id(g) not in live_groups), None)
            if victim is None:
                return
            del self._groups[victim]

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
