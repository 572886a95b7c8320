"""Build StepRecords from what one engine step computed (observers: metrics, the trace collector)."""
from __future__ import annotations

import time

import torch

from tandem.engine.request import Request
from tandem.models.transformer import ForwardOutput
from tandem.types import DraftTree, RequestStep, StepRecord, VerifyResult


def build_step_record(
    step: int,
    drafter_version: int,
    requests: list[Request],
    drafts: list[DraftTree],
    results: list[tuple[VerifyResult, torch.Tensor]],  # (result, target_probs [N+1, V]) per request
    out: ForwardOutput,
    starts: list[int],
    detailed: bool,
) -> StepRecord:
    entries = []
    for b, (request, draft, (result, target_probs)) in enumerate(zip(requests, drafts, results)):
        n = len(draft)
        entry = RequestStep(
            request_id=request.request_id, tags=dict(request.tags), context_len=starts[b],
            pending_token=int(request.all_ids[starts[b]]), draft_tokens=draft.tokens.tolist(),
            draft_parents=draft.parents.tolist(), accepted_nodes=list(result.accepted_nodes),
            emitted_tokens=list(result.tokens), bonus=result.bonus,
        )
        if detailed:
            entry.context_ids = request.all_ids[: starts[b]]
            entry.draft_probs = None if draft.draft_probs is None else draft.draft_probs.detach().clone()
            entry.target_probs = target_probs.detach().clone()
            if out.hidden:
                entry.hidden = torch.stack([h[b, : n + 1] for h in out.hidden]).detach().clone()
        entries.append(entry)
    return StepRecord(step=step, time=time.time(), drafter_version=drafter_version, requests=entries)

