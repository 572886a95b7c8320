"""Small records that cross component boundaries (ops -> engine -> observers)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.errors import InvalidParameterError


@dataclass(frozen=True)
class DraftShape:
    """One kind of draft a drafter can be asked for: `propose` with this budget gives at most `budget` nodes after
    `depth` sequential drafting passes (drafter forwards; a lookup is one pass). The speculation controller prices
    every offered shape by what it measured it to emit and to cost (tandem.engine.control)."""

    budget: int  # the nodes asked of propose (>= 1)
    depth: int  # sequential passes it takes (>= 1): what the drafter's time grows with besides the nodes
    label: str = ""  # e.g. "chain3", "chain4+lookup3", "tree12": what metrics and reports call it
    prefix: int = 0  # the draft of every budget b <= prefix is this shape's draft's first b nodes (nested drafts: a chain, a
    # chain with a grafted lookup branch), so its verify also measures those shapes; 0 = nothing known (a chain draft nests anyway)

    def __post_init__(self):
        if self.budget < 1 or self.depth < 1 or not 0 <= self.prefix <= self.budget:
            raise InvalidParameterError(f"a draft shape needs budget >= 1, depth >= 1 and 0 <= prefix <= budget, got {self.budget}, {self.depth}, {self.prefix}")

    @property
    def name(self) -> str:
        return self.label or f"budget{self.budget}"


def chain_shapes(max_nodes: int, depth_of=None, label: str = "chain") -> tuple[DraftShape, ...]:
    """Budgets 1..max_nodes, each `depth_of(budget)` passes deep (default: a chain, one pass per node)."""
    return tuple(DraftShape(n, depth_of(n) if depth_of else n, f"{label}{n}") for n in range(1, max_nodes + 1))


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one draft (chain or tree) against the target.

    `tokens` are the emitted tokens: the accepted drafted tokens, then one recovered token (sampled from
    the residual after a rejection) or bonus token (sampled from the target after the last accepted
    node, which is a leaf). Acceptance length of the step = len(tokens) = num_accepted + 1.
    """

    accepted_nodes: list[int]  # node indices along the accepted root-to-node path
    tokens: list[int]  # emitted tokens; len = len(accepted_nodes) + 1
    num_drafted: int  # nodes in the draft (all of them, for a tree)
    bonus: bool  # True when the last token is a bonus (a whole root-to-leaf path was accepted)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.accepted_nodes) + 1:
            raise InvalidParameterError(
                f"a VerifyResult emits one token more than it accepts, got {len(self.tokens)} tokens "
                f"for {len(self.accepted_nodes)} accepted nodes"
            )

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


@dataclass
class DraftTree:
    """A drafter's proposal for one request: N nodes in topological order (a chain is the common case).

    `draft_probs[i]` is the distribution node i's token was actually drawn from; None means every node
    was picked deterministically (argmax, top-k children, n-gram lookup): a one-hot row per node.
    """

    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long, -1 = child of the root (the request's pending token)
    draft_probs: torch.Tensor | None = None  # [N, V] or None (deterministic)

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @staticmethod
    def empty() -> "DraftTree":
        return DraftTree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    @staticmethod
    def chain(tokens: list[int] | torch.Tensor, draft_probs: torch.Tensor | None = None) -> "DraftTree":
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        return DraftTree(tokens, torch.arange(tokens.numel(), dtype=torch.long) - 1, draft_probs)

    @property
    def is_chain(self) -> bool:  # on the Python list: the engine asks per row per step, and a torch op there cost ~20 us
        return self.parents.tolist() == list(range(-1, len(self) - 1))

    def probs(self, vocab: int) -> torch.Tensor:  # [N, V]
        if self.draft_probs is not None:
            return self.draft_probs
        return torch.zeros(len(self), vocab).scatter_(1, self.tokens.view(-1, 1), 1.0)

    def depths(self) -> list[int]:
        out: list[int] = []
        for parent in self.parents.tolist():
            out.append(0 if parent < 0 else out[parent] + 1)
        return out

    def nodes_per_depth(self) -> list[int]:
        counts: list[int] = []
        for depth in self.depths():
            if depth == len(counts):
                counts.append(0)
            counts[depth] += 1
        return counts


STEP_RECORD_SCHEMA = 2


@dataclass
class RequestStep:
    """What one target forward did for one request (the flywheel's raw material).

    A prefill entry read the prompt (positions 0..P-1) and emitted the first token; a decode entry read
    [pending token + draft nodes] at positions context_len + depth and emitted accepted + recovered/bonus.
    The detailed fields (EngineConfig.record_steps) are per read position: row 0 is the first one read
    (prompt position 0, or the pending token), row 1 + j draft node j.
    """

    request_id: str
    tags: dict
    context_len: int  # tokens in the KV cache before this forward (0 for prefill)
    pending_token: int  # the root the draft hangs from (-1 for prefill)
    draft_tokens: list[int]
    draft_parents: list[int]
    accepted_nodes: list[int]
    emitted_tokens: list[int]  # accepted + recovered/bonus (prefill: the first token)
    bonus: bool
    finish_reason: str | None = None  # set when the request finished in this step
    context_ids: list[int] | None = None  # detailed only: every token before pending_token (prefill: the prompt)
    node_target_probs: torch.Tensor | None = None  # detailed: [N] the target's sampling prob of each node's token given its parent
    node_draft_probs: torch.Tensor | None = None  # detailed: [N] the prob the drafter drew it with (1 = deterministic)
    target_topk_ids: torch.Tensor | None = None  # detailed: [T, k] top-k of the target's T=1 distribution per read position
    target_topk_probs: torch.Tensor | None = None  # detailed: [T, k]
    hidden: torch.Tensor | None = None  # detailed: [taps, T, hidden] fp16 target hidden states per read position
    final_hidden: torch.Tensor | None = None  # detailed: [T, hidden] after the target's final norm (prefill: the last position only)
    sampling: tuple[float, int, float] | None = None  # detailed: (temperature, top_k, top_p) the request is served (and drafted) with


@dataclass
class StepRecord:
    """One engine forward (a prefill or a decode step), handed to observers after it committed."""

    step: int
    time: float
    drafter_version: int
    requests: list[RequestStep]
    kind: str = "decode"  # "prefill" | "decode" | "abort" (requests aborted between steps: no forward, no tokens)
    taps: tuple[int, ...] = ()  # target layers of RequestStep.hidden, in order
    schema_version: int = STEP_RECORD_SCHEMA
