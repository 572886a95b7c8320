"""Traces: what the engine saw, per finished request, in the form the drafter trainer consumes.

The engine hands each forward's StepRecord to observers (tandem.engine.records). `TraceAssembler` stitches
a request's prefill and decode records into one `SequenceTrace` when the request finishes:

- the committed sequence (prompt + output) with the target's tapped hidden states (`features`, the
  drafter's context) at every committed position, and its final hidden states (the target's
  distribution) at the generated positions only: the trainer never reads the target's distribution inside
  the prompt (the engine never drafts there), so prefill keeps no final states (fp16 throughout);
- rejection events: drafted tokens the verifier evaluated and rejected (children of the accepted path
  that are not on it), with the rejection probability r = 1 - min(1, p(x)/q(x)) (p: the target's
  sampling prob of the token given its parent, q: the prob the drafter drew it with). A rejected node at
  draft depth d of the step whose pending token sat at position n was predicted by the draft-cache entry
  of committed position n - 1 at chain step d: (`reject_root`, `reject_depth`);
- branches (optional): the target's final hidden state at drafted nodes off the accepted path, down to
  `branch_depth` below it (1: the evaluated, rejected nodes only, whose input features are committed
  ones; deeper nodes also need their parents' tapped states, 4.6 KB each for SmolLM2, which made branches
  the largest part of a trace), so a trainer can imitate the target on the branches the drafter explored;
- per step: root position, drafted/accepted counts, drafter version; top-k of the target's distribution
  at each verified position; every drafted node (token, parent, accepted, q(x), p(x)).

`TraceCollector` is the engine observer: it only enqueues the record (the hot path never waits) and a
daemon thread assembles traces and hands them to a sink (the buffer).

Across a boundary a trace is its non-tensor fields (`trace_header`, JSON values) plus its tensors, rebuilt
by `trace_from_parts`: the Parquet spill stores them as columns, `trace_to_bytes` as one safetensors blob
(the header in its metadata) for a trainer in another process. Never pickle.
"""
from __future__ import annotations

import json
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from tandem.errors import InvalidParameterError, TandemError
from tandem.ops.losses import rejection_probability
from tandem.types import RequestStep, StepRecord

TRACE_SCHEMA = 2  # 2: final_hidden at generated positions only, sampling params
STORE_DTYPE = torch.float16  # hidden states are stored at half width (training casts them back to fp32)


def _no_long() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long)


def _no_float() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.float32)


@dataclass
class SequenceTrace:
    request_id: str
    domain: str
    prompt_len: int
    taps: tuple[int, ...]  # target layers concatenated in `features`
    tokens: torch.Tensor  # [L] long: prompt + output
    features: torch.Tensor  # [M, taps * d] fp16: tapped hidden states at positions 0..M-1 (M = L - 1)
    final_hidden: torch.Tensor  # [M - prompt_len, d] fp16: after the final norm at positions prompt_len..M-1 (the target's distribution = lm_head of it)
    reject_root: torch.Tensor  # [E] long: committed position whose draft-cache entry began the chain
    reject_depth: torch.Tensor  # [E] long: draft depth of the rejected node
    reject_token: torch.Tensor  # [E] long: the rejected (target-vocabulary) token
    reject_weight: torch.Tensor  # [E] float: r = 1 - min(1, p/q)
    step_root: torch.Tensor  # [S] long: position of each decode step's pending token
    step_drafted: torch.Tensor  # [S] long
    step_accepted: torch.Tensor  # [S] long
    step_version: torch.Tensor  # [S] long: drafter version that proposed the step's draft
    topk_ids: torch.Tensor  # [R, k] int32: target top-k at the verified positions of every step (R = sum(N + 1))
    topk_probs: torch.Tensor  # [R, k] fp16
    branch_token: torch.Tensor  # [Eb] long: drafted nodes off the accepted path
    branch_pos: torch.Tensor  # [Eb] long: RoPE position of the node's draft-cache entry (= its parent's position)
    branch_parent: torch.Tensor  # [Eb] long: index of a branch parent, -1 = the parent is committed (at branch_pos)
    branch_features: torch.Tensor  # [Eb, taps * d] fp16: the target's tapped hidden states at the node ([0, taps * d] when branch_depth = 1: never read)
    branch_final: torch.Tensor  # [Eb, d] fp16
    # every drafted node of every step (the raw proposal; rejections and branches above are views of it)
    node_step: torch.Tensor = field(default_factory=_no_long)  # [Nn] long: index of the decode step
    node_token: torch.Tensor = field(default_factory=_no_long)  # [Nn] long
    node_parent: torch.Tensor = field(default_factory=_no_long)  # [Nn] long: parent within the step, -1 = the root
    node_accepted: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))  # [Nn]
    node_draft_prob: torch.Tensor = field(default_factory=_no_float)  # [Nn] q(x) the drafter drew it with (1 = deterministic)
    node_target_prob: torch.Tensor = field(default_factory=_no_float)  # [Nn] p(x) the target's sampling prob given its parent
    sampling: tuple[float, int, float] = (0.0, 0, 1.0)  # (temperature, top_k, top_p) the request was served and drafted with
    schema_version: int = TRACE_SCHEMA

    @property
    def num_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.tensors().values()) + 256

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    @property
    def acceptance_length(self) -> float:
        steps = len(self.step_root)
        return float((self.step_accepted + 1).sum()) / steps if steps else 0.0


# ---- crossing a boundary: header + tensors ------------------------------------------------------------------------
def trace_header(trace: SequenceTrace) -> dict:
    """The trace's non-tensor fields as JSON values."""
    return {"schema_version": trace.schema_version, "request_id": trace.request_id, "domain": trace.domain,
            "prompt_len": trace.prompt_len, "taps": list(trace.taps), "sampling": list(trace.sampling)}


def trace_from_parts(header: dict, tensors: dict[str, torch.Tensor]) -> SequenceTrace:
    """The inverse of (`trace_header`, `SequenceTrace.tensors`); a tensor field absent from `tensors` takes
    its default (fields added since the record was written). Another schema version raises."""
    if header.get("schema_version") != TRACE_SCHEMA:
        raise TandemError(f"trace schema {header.get('schema_version')} is not {TRACE_SCHEMA}")
    temperature, top_k, top_p = header["sampling"]
    values = {"request_id": header["request_id"], "domain": header["domain"], "prompt_len": int(header["prompt_len"]),
              "taps": tuple(header["taps"]), "sampling": (float(temperature), int(top_k), float(top_p))}
    values |= {f.name: tensors[f.name] for f in fields(SequenceTrace) if f.name in tensors}
    return SequenceTrace(**values)


def trace_to_bytes(trace: SequenceTrace) -> bytes:
    """One safetensors blob: the tensors, and the header as JSON in the file's metadata."""
    from safetensors.torch import save

    tensors = {name: t.contiguous() for name, t in trace.tensors().items()}
    return save(tensors, metadata={"trace": json.dumps(trace_header(trace))})


def trace_from_bytes(data: bytes) -> SequenceTrace:
    from safetensors.torch import load

    return trace_from_parts(json.loads(safetensors_metadata(data)["trace"]), load(data))


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """A safetensors blob's metadata (the format: an 8-byte little-endian header length, then the JSON
    header, whose "__metadata__" maps strings to strings)."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]).get("__metadata__", {})


def _cat(parts: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else empty


@dataclass
class _Partial:
    """A request's trace while it runs."""

    domain: str
    prompt: list[int]
    taps: tuple[int, ...]
    sampling: tuple[float, int, float]
    hidden_size: int
    tokens: list[int] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)
    final: list[torch.Tensor] = field(default_factory=list)
    rejects: list[tuple[int, int, int, float]] = field(default_factory=list)
    steps: list[tuple[int, int, int, int]] = field(default_factory=list)
    topk_ids: list[torch.Tensor] = field(default_factory=list)
    topk_probs: list[torch.Tensor] = field(default_factory=list)
    branches: list[tuple[int, int, int]] = field(default_factory=list)
    branch_features: list[torch.Tensor] = field(default_factory=list)
    branch_final: list[torch.Tensor] = field(default_factory=list)
    nodes: list[tuple[int, int, int, bool, float, float]] = field(default_factory=list)


class TraceAssembler:
    """Turns StepRecords into SequenceTraces (one per finished request). Not thread-safe: one consumer."""

    def __init__(self, branch_depth: int = 1, max_inflight: int = 1024):
        if branch_depth < 0:
            raise InvalidParameterError(f"branch_depth must be >= 0, got {branch_depth}")
        self.branch_depth = branch_depth  # keep branch nodes down to this many levels below the accepted path (0 = none)
        self.max_inflight = max_inflight
        self.inflight: OrderedDict[str, _Partial] = OrderedDict()
        self.evicted = 0  # partial traces dropped (more in flight than max_inflight)
        self.aborted = 0  # partial traces of aborted requests (stop string, disconnect, failure): finished as they stand
        self.skipped = 0  # requests whose records lacked detail (record_steps off)

    def add(self, record: StepRecord) -> list[SequenceTrace]:
        if record.kind == "abort":  # no forward: what was committed so far is a whole trace (the engine kept those tokens)
            aborted = [e.request_id for e in record.requests if e.request_id in self.inflight]
            self.aborted += len(aborted)
            return [self._finish(request_id) for request_id in aborted]
        finished = []
        for entry in record.requests:
            if entry.final_hidden is None:
                self.skipped += 1
                continue
            if record.kind == "prefill":
                self._start(entry, record.taps)
            elif entry.request_id in self.inflight:
                self._decode(self.inflight[entry.request_id], entry, record.drafter_version)
            else:
                continue  # its prefill was not seen (collector attached mid-request)
            if entry.finish_reason is not None:
                finished.append(self._finish(entry.request_id))
        return finished

    def _start(self, entry: RequestStep, taps: tuple[int, ...]) -> None:
        sampling = tuple(entry.sampling) if entry.sampling is not None else (0.0, 0, 1.0)
        partial = _Partial(domain=str(entry.tags.get("domain", "")), prompt=list(entry.context_ids), taps=tuple(taps), sampling=sampling,
                           hidden_size=entry.final_hidden.shape[-1])
        partial.tokens = list(entry.context_ids) + list(entry.emitted_tokens)
        partial.features.append(_flatten_taps(entry.hidden))  # prefill's final state is never read: not kept
        self.inflight[entry.request_id] = partial
        while len(self.inflight) > self.max_inflight:
            self.inflight.popitem(last=False)
            self.evicted += 1

    def _decode(self, partial: _Partial, entry: RequestStep, version: int) -> None:
        n = entry.context_len
        path = [-1] + list(entry.accepted_nodes)  # -1 = the root (pending token)
        on_path = set(path)
        depth = _depths(entry.draft_parents)
        rows = [0] + [1 + j for j in entry.accepted_nodes]
        partial.features.append(_flatten_taps(entry.hidden[:, rows]))
        partial.final.append(entry.final_hidden[rows].to(STORE_DTYPE))
        partial.tokens.extend(entry.emitted_tokens)
        for j, parent in enumerate(entry.draft_parents):
            p, q = float(entry.node_target_probs[j]), float(entry.node_draft_probs[j])
            partial.nodes.append((len(partial.steps), entry.draft_tokens[j], parent, j in on_path, q, p))
            if parent in on_path and j not in on_path:
                partial.rejects.append((n - 1, depth[j], entry.draft_tokens[j], float(rejection_probability(torch.tensor(p), torch.tensor(q)))))
        partial.steps.append((n, len(entry.draft_tokens), len(entry.accepted_nodes), version))
        if entry.target_topk_ids is not None:
            partial.topk_ids.append(entry.target_topk_ids)
            partial.topk_probs.append(entry.target_topk_probs)
        if self.branch_depth:
            self._add_branches(partial, entry, on_path, depth)

    def _add_branches(self, partial: _Partial, entry: RequestStep, on_path: set[int], depth: list[int]) -> None:
        index: dict[int, int] = {}
        below: dict[int, int] = {}  # levels below the accepted path
        for j, parent in enumerate(entry.draft_parents):
            if j in on_path:
                continue
            below[j] = 1 if parent in on_path else below[parent] + 1
            if below[j] > self.branch_depth:
                continue
            index[j] = len(partial.branches)
            branch_parent = -1 if parent in on_path else index[parent]
            partial.branches.append((entry.draft_tokens[j], entry.context_len + depth[j], branch_parent))
            if self.branch_depth > 1:  # a child reads its parent's tapped states
                partial.branch_features.append(_flatten_taps(entry.hidden[:, 1 + j : 2 + j]))
            partial.branch_final.append(entry.final_hidden[1 + j : 2 + j].to(STORE_DTYPE))

    def _finish(self, request_id: str) -> SequenceTrace:
        p = self.inflight.pop(request_id)
        m = len(p.tokens) - 1  # the last emitted token was never read by the target
        features = torch.cat(p.features)[:m]
        final = _cat(p.final, torch.zeros(0, p.hidden_size, dtype=STORE_DTYPE))[: m - len(p.prompt)]  # positions prompt_len..m-1
        rejects = [r for r in p.rejects if r[0] < m - 1]
        long = lambda rows, i: torch.tensor([r[i] for r in rows], dtype=torch.long)  # noqa: E731
        width, d = features.shape[1], p.hidden_size
        k = p.topk_ids[0].shape[1] if p.topk_ids else 0
        return SequenceTrace(
            request_id=request_id, domain=p.domain, prompt_len=len(p.prompt), taps=p.taps,
            tokens=torch.tensor(p.tokens, dtype=torch.long), features=features, final_hidden=final,
            reject_root=long(rejects, 0), reject_depth=long(rejects, 1), reject_token=long(rejects, 2),
            reject_weight=torch.tensor([r[3] for r in rejects], dtype=torch.float32),
            step_root=long(p.steps, 0), step_drafted=long(p.steps, 1), step_accepted=long(p.steps, 2), step_version=long(p.steps, 3),
            topk_ids=_cat(p.topk_ids, torch.zeros(0, k, dtype=torch.int32)), topk_probs=_cat(p.topk_probs, torch.zeros(0, k, dtype=STORE_DTYPE)),
            branch_token=long(p.branches, 0), branch_pos=long(p.branches, 1), branch_parent=long(p.branches, 2),
            branch_features=_cat(p.branch_features, torch.zeros(0, width, dtype=STORE_DTYPE)),
            branch_final=_cat(p.branch_final, torch.zeros(0, d, dtype=STORE_DTYPE)),
            node_step=long(p.nodes, 0), node_token=long(p.nodes, 1), node_parent=long(p.nodes, 2),
            node_accepted=torch.tensor([x[3] for x in p.nodes], dtype=torch.bool),
            node_draft_prob=torch.tensor([x[4] for x in p.nodes], dtype=torch.float32),
            node_target_prob=torch.tensor([x[5] for x in p.nodes], dtype=torch.float32), sampling=p.sampling,
        )


def _flatten_taps(hidden: torch.Tensor) -> torch.Tensor:  # [taps, T, d] -> [T, taps * d]
    if hidden is None:
        raise InvalidParameterError("trace collection needs the target's hidden states: give the engine hidden_taps or a drafter with taps")
    return hidden.permute(1, 0, 2).reshape(hidden.shape[1], -1).to(STORE_DTYPE)


def _depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


class TraceCollector:
    """Engine observer: enqueue each record (never blocks); a daemon thread assembles and hands traces on.

    If the queue is full (the consumer fell behind), the record is dropped and counted: the engine's step
    time must not depend on the trainer. Dropped records leave holes, so that request's trace is discarded.
    """

    def __init__(self, sink: Callable[[SequenceTrace], None], branch_depth: int = 1, max_queue: int = 4096):
        self.sink = sink
        self.assembler = TraceAssembler(branch_depth)
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.dropped_records = 0
        self.traces = 0
        self.error: BaseException | None = None
        self._broken: set[str] = set()
        self._thread = threading.Thread(target=self._loop, name="tandem-trace-collector", daemon=True)
        self._thread.start()

    def __call__(self, record: StepRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped_records += 1
            self._broken.update(e.request_id for e in record.requests)

    def _loop(self) -> None:
        while True:
            record = self.queue.get()
            try:
                if record is None:
                    return
                if record.kind == "abort":  # the request is over: forget it was broken even if it had no trace
                    for entry in record.requests:
                        if entry.request_id not in self.assembler.inflight:
                            self._broken.discard(entry.request_id)
                for trace in self.assembler.add(record):
                    if trace.request_id in self._broken:
                        self._broken.discard(trace.request_id)
                        continue
                    self.traces += 1
                    self.sink(trace)
            except Exception as e:  # keep serving: a bad record loses one trace, not the collector
                self.error = e
            finally:
                self.queue.task_done()

    def flush(self) -> None:
        """Wait until every enqueued record was assembled (tests, shutdown)."""
        self.queue.join()

    def close(self) -> None:
        self.queue.put(None)
        self._thread.join(timeout=5)
