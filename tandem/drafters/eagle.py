"""`eagle` / `eagle_tree`: an EAGLE-3-style head drafts from the target's own hidden states.

State per cache row (mirrors the engine's rows): the head's one-layer KV cache holds entries
(f_j, x_{j+1}) for committed positions j (see tandem.models.eagle), and `pending[row]` holds the target's
tap features [m, taps x d_t] of committed positions not yet written there, as the chunks they arrived in
(fused by the head's fc only when written: a row that stays plain for many steps costs one gather a step,
not a fuse and a copy of its whole queue). Invariant, with n committed target tokens: draft-cache length
(outside a proposal) + m == n. on_prefill queues the prompt's features, on_verified queues the features at
the accepted path (root + accepted nodes) and drops the proposal's draft entries; propose first writes the
queued entries (one batched forward: the "catch-up"), whose last output predicts the first draft token.

Proposals:
- chains (default, and always for sampled requests): k steps, one batched head forward per step.
  Greedy requests take the argmax (deterministic, draft_probs None); sampled requests draw from the
  target's sampling transform applied to the draft logits, with the request's generator, and report the
  rows (expanded to the target vocabulary with zeros outside the draft vocabulary, so verification stays
  exact).
- dynamic trees (`eagle_tree`, EAGLE-2), greedy batches only: at each depth the `topk` frontier nodes with
  the highest cumulative draft log-probability are run through the head (one forward per depth, with a
  tree mask over the draft cache) and each proposes its `topk` best children; finally the `max_nodes`
  best nodes overall are kept (a child never scores above its parent, so the set is a tree).
- static trees (`tree_parents`, data): node i is the r-th best child of its parent, r = its rank among
  its siblings.
A batch with any sampled request is drafted as chains.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.drafters.base import DrafterBase, draw_draft_tokens, register
from tandem.errors import InvalidParameterError
from tandem.models.eagle import EagleConfig, EagleHead, draft_vocab_from_tokens, expand_to_target, load_eagle, new_eagle_head, shipped_eagle_path, tree_cache_mask
from tandem.models.kv_cache import KVCache
from tandem.ops import tree as tree_ops
from tandem.ops.sampling import sampling_probs
from tandem.types import DraftShape, DraftTree, chain_shapes

DAY0_DRAFT_VOCAB = 8192  # draft vocabulary of an untrained head (the target's lowest ids)
PAD_LIMIT = 16  # longer queues (a new prompt) are written alone first, so a batched catch-up pads little


@dataclass(frozen=True)
class TreeOptions:
    """How greedy requests are drafted: chains, EAGLE-2 dynamic trees, or a fixed tree shape."""

    mode: str = "chain"  # "chain" | "dynamic" | "static"
    max_nodes: int = 12  # dynamic: node budget of one proposal
    topk: int = 3  # dynamic: frontier width and children per expanded node
    depth: int = 5  # dynamic: levels of the tree
    parents: tuple[int, ...] = ()  # static: the shape (parent index per node, -1 = the root)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        if self.mode not in ("chain", "dynamic", "static"):
            raise InvalidParameterError(f"tree mode must be chain, dynamic or static, got {self.mode!r}")
        if self.mode == "dynamic" and not (self.max_nodes >= 1 and self.topk >= 1 and self.depth >= 1):
            raise InvalidParameterError("dynamic trees need max_nodes, topk and depth >= 1")
        if self.mode == "static":
            if not self.parents:
                raise InvalidParameterError("a static tree needs tree_parents")
            tree_ops.validate_parents(torch.tensor(self.parents))

    def nodes(self, chain_k: int) -> int:
        """Most nodes one proposal may have (sampled requests still get chains of chain_k)."""
        return max(chain_k, {"chain": 0, "dynamic": self.max_nodes, "static": len(self.parents)}[self.mode])

    def cache_room(self, chain_k: int) -> int:
        """Most draft-cache entries one proposal appends after the catch-up."""
        levels = max(tree_ops.depths(torch.tensor(self.parents)).tolist()) if self.parents else 0
        return max(chain_k, {"chain": 0, "dynamic": self.topk * self.depth, "static": len(self.parents) + levels}[self.mode])


def sibling_ranks(parents: tuple[int, ...]) -> list[int]:
    """Rank of each node among its parent's children (0 = first child), in node order."""
    seen: dict[int, int] = {}
    ranks = []
    for parent in parents:
        ranks.append(seen.get(parent, 0))
        seen[parent] = ranks[-1] + 1
    return ranks


class EagleDrafter(DrafterBase):
    name = "eagle"

    def __init__(self, head: EagleHead, num_draft_tokens: int, max_batch: int, max_len: int, tree: TreeOptions = TreeOptions(),
                 min_confidence: float = 0.0):
        if num_draft_tokens < 1:
            raise InvalidParameterError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if not 0.0 <= min_confidence < 1.0:
            raise InvalidParameterError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.head = head
        self.k = num_draft_tokens
        self.tree = tree
        self.taps = head.cfg.taps
        self.max_nodes = tree.nodes(num_draft_tokens)
        self.target_vocab = head.cfg.target_vocab_size
        device = head.fc.weight.device
        self.draft_to_target = head.draft_to_target.to(device)  # [Vd]
        self.cache = KVCache(head.cfg.layer_config(), max_batch, max_len + tree.cache_room(num_draft_tokens) + 2, torch.float32, device)
        self.pending: dict[int, list[torch.Tensor]] = {}  # row -> chunks [m_i, taps x d_t] of tap features not yet in the draft cache
        self.queued: dict[int, int] = {}  # row -> sum of m_i
        self.min_confidence = min_confidence  # chains end where the path confidence falls below it (0: always k tokens)

    # ---- engine hooks -------------------------------------------------------------------------------
    @torch.inference_mode()
    def on_prefill(self, request, target_out) -> None:
        self.cache.reset(request.row)
        features = torch.cat([h[0] for h in self._taps(target_out)], dim=-1)  # [P, taps x d_t]
        self.pending[request.row], self.queued[request.row] = [features], len(features)

    @torch.inference_mode()
    def on_verified(self, requests, drafts, results, starts, target_out) -> None:
        taps = self._taps(target_out)
        counts = [1 + len(result.accepted_nodes) for result in results]
        if max(counts) == 1:  # nothing accepted (plain rows, rejected drafts): every row's root
            features = torch.cat([h[:, 0] for h in taps], dim=-1)  # [B, taps x d_t]
        else:
            rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
            columns = torch.tensor([j for result in results for j in (0, *[1 + n for n in result.accepted_nodes])])
            features = torch.cat([h[rows.to(h.device), columns.to(h.device)] for h in taps], dim=-1)  # [sum(a+1), taps x d_t]
        for request, start, chunk in zip(requests, starts, features.split(counts)):
            row = request.row
            self.cache.truncate(row, start - self.queued.get(row, 0))  # drop this proposal's draft entries
            self.pending.setdefault(row, []).append(chunk)
            self.queued[row] = self.queued.get(row, 0) + len(chunk)

    def release(self, request) -> None:
        self.pending.pop(request.row, None)
        self.queued.pop(request.row, None)

    def move_row(self, src_row: int, dst_row: int) -> None:
        self.cache.move_row(src_row, dst_row)
        self.pending[dst_row] = self.pending.pop(src_row)
        self.queued[dst_row] = self.queued.pop(src_row)

    def _taps(self, target_out) -> tuple[torch.Tensor, ...]:
        if len(target_out.hidden) != len(self.taps):
            raise InvalidParameterError(
                f"the target returned {len(target_out.hidden)} hidden states; eagle needs exactly its taps {self.taps}"
            )
        return target_out.hidden

    # ---- proposals ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def shapes(self) -> tuple[DraftShape, ...]:
        """Chains of 1..k (one head pass per node); in tree modes also trees of k+1..max_nodes nodes, each as deep
        as the tree grows (its levels; a chain of k for sampled requests)."""
        chains = chain_shapes(self.k)
        if self.tree.mode == "chain":
            return chains
        levels = self.tree.depth if self.tree.mode == "dynamic" else 1 + max(tree_ops.depths(torch.tensor(self.tree.parents)).tolist())
        return chains + tuple(DraftShape(n, max(levels, self.k), f"tree{n}") for n in range(self.k + 1, self.max_nodes + 1))

    def propose(self, requests, budgets: list[int]) -> list[DraftTree]:
        if max(budgets, default=0) == 0:
            return [DraftTree.empty() for _ in requests]
        logits, hidden = self._catch_up(requests, [b > 0 for b in budgets])  # [B, Vd], [B, d]
        if self.tree.mode != "chain" and all(r.params.greedy for r in requests):
            grow = self._dynamic_tree if self.tree.mode == "dynamic" else self._static_tree
            return grow(budgets, logits, hidden)
        return self._chain(requests, [min(self.k, b) for b in budgets], logits, hidden)

    def _catch_up(self, requests, drafting: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:  # -> logits [B, Vd], hidden [B, d] at each row's last entry
        """Fuse the drafting rows' queued tap features in one call, write them in one batched forward (right-padded; the
        padding is cut off after). A queue longer than PAD_LIMIT (a new prompt, a row that stayed plain) is written alone
        first. A row that does not draft keeps its queue (its catch-up waits for its next draft: at 16 rows, catching
        every row up for a probe on a few cost 100-230 ms); it takes one placeholder entry, dropped again, and its
        outputs are not used."""
        raw = []
        for request, drafts in zip(requests, drafting):
            if not drafts:
                raw.append(None)
                continue
            if not self.queued.get(request.row):
                raise InvalidParameterError(f"eagle: nothing new for row {request.row} since its last proposal (propose without on_verified?)")
            raw.append(torch.cat(self.pending.pop(request.row)))
            self.queued[request.row] = 0
        counts = [len(q) if q is not None else 0 for q in raw]
        fused = iter(self.head.fuse([torch.cat([q for q in raw if q is not None])]).split([c for c in counts if c]))
        queued = [next(fused) if c else None for c in counts]  # [m_b, d] fused features per drafting row
        some = next(q for q in queued if q is not None)
        queued = [q if q is not None else some.new_zeros(1, some.shape[-1]) for q in queued]
        counts = [max(c, 1) for c in counts]
        for b, request in enumerate(requests):
            if counts[b] > PAD_LIMIT:  # (a drafting row: a placeholder is one entry)
                self._write(request, queued[b][:-1])
                queued[b], counts[b] = queued[b][-1:], 1
        starts = self.cache.lengths[: len(requests)].tolist()
        device = queued[0].device
        ids = torch.zeros(len(requests), max(counts), dtype=torch.long)
        features = queued[0].new_zeros(len(requests), max(counts), queued[0].shape[-1])
        for b, (request, q) in enumerate(zip(requests, queued)):
            if drafting[b]:  # a placeholder row keeps token id 0 and zero features
                ids[b, : len(q)] = torch.tensor(request.all_ids[starts[b] + 1 : starts[b] + 1 + len(q)])
                features[b, : len(q)] = q
        last = torch.tensor(counts) - 1
        logits, hidden = self.head(ids.to(device), features, cache=self.cache, rows=slice(0, len(requests)), logits_at=last)
        for b, count in enumerate(counts):
            self.cache.truncate(b, starts[b] + (count if drafting[b] else 0))
        return logits[:, 0], hidden[torch.arange(len(requests)), last.to(device)]

    def _write(self, request, features: torch.Tensor) -> None:  # features [m, d]: entries whose outputs are not needed
        seen = int(self.cache.lengths[request.row])
        ids = torch.tensor([request.all_ids[seen + 1 : seen + 1 + len(features)]], device=features.device)
        self.head(ids, features.unsqueeze(0), cache=self.cache, rows=slice(request.row, request.row + 1), logits_at=torch.zeros(1, dtype=torch.long))

    def _chain(self, requests, ks: list[int], logits: torch.Tensor, hidden: torch.Tensor) -> list[DraftTree]:
        """k_b steps per row; with `min_confidence`, a row's chain ends before the first token whose path
        confidence (the product of the head's top softmax probabilities along the chain, EAGLE-2's score) falls
        below it: the draft alone decides, so verification stays exact. Drafting stops once every row has ended."""
        tokens, probs = [], []
        ks = list(ks)
        path = torch.ones(len(requests))
        for step in range(max(ks)):
            if step:
                out_logits, out_hidden = self.head(tokens[-1].unsqueeze(1), hidden.unsqueeze(1), cache=self.cache, rows=slice(0, len(requests)))
                logits, hidden = out_logits[:, 0], out_hidden[:, 0]
            if self.min_confidence > 0:
                path = path * torch.softmax(logits.float(), -1).amax(-1).cpu()
                sure = (path >= self.min_confidence).tolist()
                ks = [k if k <= step or sure[b] else step for b, k in enumerate(ks)]
                if max(ks) <= step:
                    break
            token, prob = self._pick(requests, logits, step)
            tokens.append(self.draft_to_target[token])
            probs.append(prob)
        return [self._chain_draft(b, k, tokens, probs) for b, k in enumerate(ks)]

    def _pick(self, requests, logits: torch.Tensor, step: int):  # logits [B, Vd] -> draft ids [B], probs [B, V] or None
        if all(r.params.greedy for r in requests):
            return logits.argmax(-1), None
        temperature = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32)
        top_k = torch.tensor([r.params.top_k for r in requests])
        top_p = torch.tensor([r.params.top_p for r in requests], dtype=torch.float32)
        probs = sampling_probs(logits.float().cpu(), temperature, top_k, top_p)  # [B, Vd]; greedy rows one-hot
        vocab_ids = self.draft_to_target.cpu()
        token = draw_draft_tokens(requests, probs, step, vocab_ids)
        return token.to(logits.device), expand_to_target(probs, vocab_ids, self.target_vocab)

    @staticmethod
    def _chain_draft(b: int, k: int, tokens: list[torch.Tensor], probs: list) -> DraftTree:
        if k == 0:
            return DraftTree.empty()
        chain = torch.stack([t[b] for t in tokens[:k]]).cpu()
        rows = None if probs[0] is None else torch.stack([p[b] for p in probs[:k]])
        return DraftTree.chain(chain, rows)

    def _dynamic_tree(self, budgets: list[int], logits: torch.Tensor, hidden: torch.Tensor) -> list[DraftTree]:
        """EAGLE-2: expand the topk best frontier nodes per depth, keep the max_nodes best nodes overall."""
        k, batch = self.tree.topk, logits.shape[0]
        floor = math.log(self.min_confidence) if self.min_confidence > 0 else -math.inf  # nodes scoring below are not kept
        walk = _TreeWalk(self.head, self.cache, batch)
        scores, tokens = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)  # [B, k] root children
        nodes = _Nodes(tokens, scores, torch.full((batch, k), -1, dtype=torch.long), depth=0)
        frontier = torch.arange(k).expand(batch, k)  # node ids being expanded
        parent_entry = torch.full((batch, k), -1, dtype=torch.long)  # their parents' draft-cache entries
        features = hidden.unsqueeze(1).expand(batch, k, -1)
        for depth in range(1, self.tree.depth):
            ids = self.draft_to_target[nodes.tokens.gather(1, frontier.to(nodes.tokens.device))]
            out_logits, out_hidden = walk.forward(ids, features, parent_entry, depth - 1)  # [B, k, Vd], [B, k, d]
            child_scores, child_tokens = torch.log_softmax(out_logits.float(), -1).topk(k, dim=-1)  # [B, k, k]
            child_scores = child_scores + nodes.scores.gather(1, frontier).unsqueeze(-1).to(child_scores.device)
            first = nodes.add(child_tokens.reshape(batch, -1), child_scores.reshape(batch, -1), frontier.repeat_interleave(k, dim=1), depth)
            best = child_scores.reshape(batch, -1).topk(k, dim=-1).indices.cpu()  # [B, k] among the k*k children
            parent_entry = walk.entries_of(best // k)
            features = out_hidden.gather(1, (best // k).to(out_hidden.device).unsqueeze(-1).expand(-1, -1, out_hidden.shape[-1]))
            frontier = first + best
            if self.min_confidence > 0 and float(nodes.scores.gather(1, frontier).max()) < floor:
                break  # no frontier node of any row is sure enough to be kept, let alone its children
        return [nodes.best_tree(b, min(self.tree.max_nodes, budgets[b]), self.draft_to_target, floor) for b in range(batch)]

    def _static_tree(self, budgets: list[int], logits: torch.Tensor, hidden: torch.Tensor) -> list[DraftTree]:
        """A fixed shape: node i is the rank-th best child of its parent, level by level."""
        parents = torch.tensor(self.tree.parents)
        ranks = torch.tensor(sibling_ranks(self.tree.parents))
        depth_of = tree_ops.depths(parents)
        batch, n = logits.shape[0], len(parents)
        walk = _TreeWalk(self.head, self.cache, batch)
        draft_ids = torch.zeros(batch, n, dtype=torch.long, device=logits.device)
        entry_of = torch.full((n,), -1, dtype=torch.long)
        level_logits, level_hidden, level_nodes = logits.unsqueeze(1), hidden.unsqueeze(1), torch.tensor([-1])
        for depth in range(int(depth_of.max()) + 1):
            nodes = (depth_of == depth).nonzero().flatten()
            slot = (parents[nodes].unsqueeze(1) == level_nodes.unsqueeze(0)).int().argmax(1)  # parent's index in the last level
            best = level_logits[:, slot].topk(int(ranks.max()) + 1, dim=-1).indices  # [B, len(nodes), r]
            draft_ids[:, nodes] = best.gather(2, ranks[nodes].to(best.device).view(1, -1, 1).expand(batch, -1, 1)).squeeze(-1)
            if depth < int(depth_of.max()):
                parent_entry = entry_of[parents[nodes].clamp(min=0)].masked_fill(parents[nodes] < 0, -1).expand(batch, -1)
                entry_of[nodes] = walk.size + torch.arange(len(nodes))
                level_logits, level_hidden = walk.forward(self.draft_to_target[draft_ids[:, nodes]], level_hidden[:, slot], parent_entry, depth)
                level_nodes = nodes
        tokens = self.draft_to_target[draft_ids].cpu()
        return [DraftTree(tokens[b, : min(n, budgets[b])], parents[: min(n, budgets[b])]) for b in range(batch)]


class _TreeWalk:
    """Draft-cache bookkeeping while one proposal grows a tree: which entries each new entry may see."""

    def __init__(self, head: EagleHead, cache: KVCache, batch: int):
        self.head, self.cache, self.batch = head, cache, batch
        self.prefix = cache.lengths[:batch].clone()  # [B] committed entries (visible to every node)
        self.ancestors = torch.zeros(batch, 0, 0, dtype=torch.bool)  # [B, M, M] among this proposal's entries
        self._last = 0  # entries added by the latest forward

    @property
    def size(self) -> int:
        return self.ancestors.shape[1]

    def entries_of(self, index: torch.Tensor) -> torch.Tensor:  # [B, T] index into the last forward's nodes
        return self.size - self._last + index

    def forward(
        self,
        ids: torch.Tensor,  # [B, T] target token ids of the new entries
        features: torch.Tensor,  # [B, T, d] their parents' output hidden states
        parent_entry: torch.Tensor,  # [B, T] long: parent's entry among this proposal's, -1 = the root
        depth: int,  # tree depth of the new entries (position = prefix + depth)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [B, T, Vd], hidden [B, T, d]
        batch, t = ids.shape
        m = self.size
        seen = torch.zeros(batch, m + t, m + t, dtype=torch.bool)
        seen[:, :m, :m] = self.ancestors
        with_root = torch.cat([torch.zeros(batch, 1, m, dtype=torch.bool), self.ancestors], dim=1)  # row 0: the root
        seen[:, m:, :m] = with_root.gather(1, (parent_entry + 1).unsqueeze(-1).expand(batch, t, m))
        seen[:, m:, m:] = torch.eye(t, dtype=torch.bool)
        self.ancestors, self._last = seen, t
        positions = (self.prefix + depth).unsqueeze(1).expand(batch, t).to(ids.device)
        mask = tree_cache_mask(self.prefix, seen, t)
        return self.head(ids, features, positions, self.cache, slice(0, batch), cache_mask=mask)


class _Nodes:
    """All candidate nodes of a dynamic tree, per row: draft ids, cumulative log-probs, parents, depths."""

    def __init__(self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depth: int):  # [B, k] each
        self.tokens, self.scores, self.parents = tokens, scores.cpu(), parents
        self.depths = [depth] * tokens.shape[1]

    def add(self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depth: int) -> int:  # -> id of the first new node
        first = self.tokens.shape[1]
        self.tokens = torch.cat([self.tokens, tokens], dim=1)
        self.scores = torch.cat([self.scores, scores.cpu()], dim=1)
        self.parents = torch.cat([self.parents, parents], dim=1)
        self.depths += [depth] * tokens.shape[1]
        return first

    def best_tree(self, b: int, budget: int, draft_to_target: torch.Tensor, floor: float = -math.inf) -> DraftTree:
        """The `budget` best nodes scoring at least `floor` (ties: shallower first), in depth order so parents precede
        children (a child never scores above its parent, so the kept nodes form a tree)."""
        scores = self.scores[b].tolist()
        order = [i for i in sorted(range(len(scores)), key=lambda i: (-scores[i], self.depths[i], i))[:budget] if scores[i] >= floor]
        if not order:
            return DraftTree.empty()
        kept = sorted(order, key=lambda i: (self.depths[i], i))
        index = {node: i for i, node in enumerate(kept)}
        parents = [index[p] if p >= 0 else -1 for p in self.parents[b, kept].tolist()]
        return DraftTree(draft_to_target[self.tokens[b, kept]].cpu(), torch.tensor(parents, dtype=torch.long))


DAY0 = "day0"  # drafter_path that asks for the untrained head even where a shipped one exists
TRAINED_MIN_CONFIDENCE = 0.08  # a trained head's chains end below this path confidence (docs/BENCHMARKS.md 3.4): on the
# peer prompts 1.71 -> 1.65 accepted per step for 3.9 -> 1.7 drafted tokens, 1.12x tokens/s; an untrained head's
# drafts all score ~1/Vd, so it drafts full chains (the flywheel learns from its rejected proposals)


def build_eagle_drafter(
    target, num_draft_tokens: int = 4, drafter_path: str | None = None, max_batch: int = 8, max_len: int | None = None,
    device: str = "cpu", tree: TreeOptions = TreeOptions(), draft_vocab_size: int = DAY0_DRAFT_VOCAB, min_confidence: float | None = None,
) -> EagleDrafter:
    """A drafter from a trained head: `drafter_path`, or without one the head shipped for this target
    (tandem/heads/, checksum-verified); "day0" or no shipped head: an untrained head sized for the target.
    min_confidence None: TRAINED_MIN_CONFIDENCE for a trained head, 0 (full chains) for an untrained one."""
    if drafter_path is None:
        drafter_path = shipped_eagle_path(target.cfg)
    trained = drafter_path is not None and str(drafter_path) != DAY0
    if min_confidence is None:
        min_confidence = TRAINED_MIN_CONFIDENCE if trained else 0.0
    if trained:
        head = load_eagle(drafter_path, target)
    else:
        cfg = EagleConfig.for_target(target.cfg, draft_vocab_size)
        head = new_eagle_head(target, cfg, draft_vocab_from_tokens([], cfg.draft_vocab_size, target.cfg.vocab_size), torch.Generator().manual_seed(0))
    head = head.to(device).eval().requires_grad_(False)
    head.pack()
    return EagleDrafter(head, num_draft_tokens, max_batch, max_len or target.cfg.max_position, tree, min_confidence)


def _tree_options(tree: str, max_nodes: int, tree_topk: int, tree_depth: int | None, tree_parents, num_draft_tokens: int) -> TreeOptions:
    if tree_parents:
        return TreeOptions("static", parents=tuple(tree_parents))
    return TreeOptions(tree, max_nodes, tree_topk, tree_depth or num_draft_tokens + 1)


@register("eagle")
def _build(target, num_draft_tokens: int = 4, drafter_path: str | None = None, max_batch: int = 8, max_len: int | None = None,
           device: str = "cpu", tree: str = "chain", max_nodes: int = 12, tree_topk: int = 3, tree_depth: int | None = None,
           tree_parents=None, draft_vocab_size: int = DAY0_DRAFT_VOCAB, min_confidence: float | None = None, **_) -> EagleDrafter:
    options = _tree_options(tree, max_nodes, tree_topk, tree_depth, tree_parents, num_draft_tokens)
    return build_eagle_drafter(target, num_draft_tokens, drafter_path, max_batch, max_len, device, options, draft_vocab_size, min_confidence)


@register("eagle_tree")
def _build_tree(target, num_draft_tokens: int = 4, tree: str = "dynamic", **kwargs) -> EagleDrafter:
    return _build(target, num_draft_tokens, tree=tree, **kwargs)  # named by build_drafter
