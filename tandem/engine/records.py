"""Build StepRecords from what one engine forward computed (observers: metrics, the trace collector)."""
from __future__ import annotations

import time

import torch

from tandem.engine.request import Request
from tandem.models.transformer import ForwardOutput
from tandem.types import DraftTree, RequestStep, StepRecord, VerifyResult

RECORD_DTYPE = torch.float16  # hidden states in records: half width (traces store them so, training casts back)


def build_step_record(
    step: int,
    drafter_version: int,
    requests: list[Request],
    drafts: list[DraftTree],
    results: list[tuple[VerifyResult, torch.Tensor | None]],  # (result, target sampling probs [N+1, V]; None for a greedy row) per request
    out: ForwardOutput,
    starts: list[int],
    detailed: bool,
    topk: int,
    taps: tuple[int, ...],
    argmax: torch.Tensor | None = None,  # [B, T] the step's greedy argmax when the engine computed it (else each greedy row's is taken here)
) -> StepRecord:
    entries = []
    for b, (request, draft, (result, target_probs)) in enumerate(zip(requests, drafts, results)):
        n = len(draft)
        entry = RequestStep(
            request_id=request.request_id, tags=dict(request.tags), context_len=starts[b],
            pending_token=int(request.all_ids[starts[b]]), draft_tokens=draft.tokens.tolist(),
            draft_parents=draft.parents.tolist(), accepted_nodes=list(result.accepted_nodes),
            emitted_tokens=list(result.tokens), bonus=result.bonus, finish_reason=_reason(request),
        )
        if detailed:
            entry.context_ids = request.all_ids[: starts[b]]
            parent_rows = draft.parents + 1  # row of each node's parent in target_probs (0 = the root)
            best = None if argmax is None else argmax[b, : n + 1]
            entry.node_target_probs = node_target_probs(target_probs, out.logits[b, : n + 1], parent_rows, draft.tokens, best)
            entry.node_draft_probs = torch.ones(n) if draft.draft_probs is None else draft.draft_probs[torch.arange(n), draft.tokens].float().cpu()
            _add_forward_details(entry, out, b, n + 1, out.logits[b, : n + 1], topk)
            entry.sampling = (float(request.params.temperature), int(request.params.top_k), float(request.params.top_p))
        entries.append(entry)
    return StepRecord(step=step, time=time.time(), drafter_version=drafter_version, requests=entries, kind="decode", taps=taps)


def build_prefill_record(
    step: int, drafter_version: int, request: Request, first_token: int, out: ForwardOutput, detailed: bool, topk: int, taps: tuple[int, ...],
) -> StepRecord:
    """The prompt's forward: tapped hidden states at every prompt position (the drafter's context); the
    final hidden state and target top-k at the last one only (prefill computes logits there alone, and
    the trainer reads the target's distribution at generated positions only)."""
    entry = RequestStep(
        request_id=request.request_id, tags=dict(request.tags), context_len=0, pending_token=-1, draft_tokens=[],
        draft_parents=[], accepted_nodes=[], emitted_tokens=[first_token], bonus=False, finish_reason=_reason(request),
    )
    if detailed:
        entry.context_ids = list(request.prompt_ids)
        entry.sampling = (float(request.params.temperature), int(request.params.top_k), float(request.params.top_p))
        entry.node_target_probs, entry.node_draft_probs = torch.zeros(0), torch.zeros(0)
        _add_forward_details(entry, out, 0, len(request.prompt_ids), out.logits[0, -1:], topk, final_from=len(request.prompt_ids) - 1)
    return StepRecord(step=step, time=time.time(), drafter_version=drafter_version, requests=[entry], kind="prefill", taps=taps)


def build_abort_record(step: int, drafter_version: int, requests: list[Request]) -> StepRecord:
    """Requests aborted between steps (no forward: no tokens, no details); finish_reason "abort"."""
    entries = [RequestStep(request_id=r.request_id, tags=dict(r.tags), context_len=len(r.all_ids), pending_token=-1, draft_tokens=[],
                           draft_parents=[], accepted_nodes=[], emitted_tokens=[], bonus=False, finish_reason="abort") for r in requests]
    return StepRecord(step=step, time=time.time(), drafter_version=drafter_version, requests=entries, kind="abort")


def node_target_probs(target_probs: torch.Tensor | None, logits: torch.Tensor, parent_rows: torch.Tensor, tokens: torch.Tensor,
                      argmax: torch.Tensor | None = None) -> torch.Tensor:  # [N]
    """Each node's target probability given its parent: read off the sampling distribution [N+1, V] where the row
    was verified against one; a greedy row (None) was verified against the argmax, whose distribution is its
    one-hot, so the probability is 1 where the token is the argmax of its parent's logits [N+1, V], else 0 (an
    argmax over the row instead of a softmax over the vocabulary; `argmax` [N+1]: the one the verify already took)."""
    if target_probs is not None:
        return target_probs[parent_rows, tokens].clone()
    best = logits.argmax(-1).cpu() if argmax is None else argmax
    return (best[parent_rows] == tokens.cpu()).float()


def _add_forward_details(entry: RequestStep, out: ForwardOutput, b: int, length: int, logits: torch.Tensor, topk: int, final_from: int = 0) -> None:
    """Copy what the trainer needs out of the forward's buffers (they are reused by the next forward):
    tapped hidden states of rows 0..length-1, final hidden states of rows final_from..length-1 (fp16)."""
    if topk:
        probs = torch.softmax(logits.float(), dim=-1)
        values, ids = probs.topk(min(topk, probs.shape[-1]), dim=-1)
        entry.target_topk_ids, entry.target_topk_probs = ids.int().cpu(), values.half().cpu()
    if out.hidden:
        entry.hidden = torch.stack([h[b, :length].detach().to("cpu", RECORD_DTYPE) for h in out.hidden])
    entry.final_hidden = out.final_hidden[b, final_from:length].detach().to("cpu", RECORD_DTYPE, copy=True)


def _reason(request: Request) -> str | None:
    return request.finish_reason.value if request.finish_reason is not None else None
