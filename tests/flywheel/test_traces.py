"""Trace assembly: committed features match the target, rejections are the verifier's, collection never blocks."""
import dataclasses
import threading
import time

import pytest
import torch

from tandem.config import SamplingParams
from tandem.errors import TandemError
from tandem.flywheel.traces import TraceAssembler, TraceCollector, trace_from_bytes, trace_header, trace_to_bytes
from tandem.types import RequestStep, StepRecord

from flywheel_helpers import GREEDY, eagle_engine, make_prompts, served_traces


def collect(engine, prompts, params):
    traces = []
    collector = TraceCollector(traces.append)
    engine.observers.append(collector)
    requests = engine.run(prompts, params)
    collector.flush()
    collector.close()
    return requests, {t.request_id: t for t in traces}


def test_one_trace_per_request_with_the_targets_hidden_states(target):
    engine = eagle_engine(target)
    requests, traces = collect(engine, make_prompts(3), [GREEDY] * 3)
    assert len(traces) == 3
    for request in requests:
        trace = traces[request.request_id]
        assert trace.tokens.tolist() == request.prompt_ids + request.output_ids
        prompt = len(request.prompt_ids)
        assert len(trace.features) == len(trace.tokens) - 1 and len(trace.final_hidden) == len(trace.tokens) - 1 - prompt
        assert trace.features.dtype == trace.final_hidden.dtype == torch.float16 and trace.sampling == (0.0, 0, 1.0)
        # a fresh forward over the committed sequence gives the same hidden states (fp16 storage); the
        # final states (the target's distribution) are kept at the generated positions only
        out = target(trace.tokens[:-1].unsqueeze(0), taps=engine.taps)
        expected = torch.cat([h[0] for h in out.hidden], dim=-1)
        torch.testing.assert_close(trace.features.float(), expected, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(trace.final_hidden.float(), out.final_hidden[0, prompt:], atol=2e-2, rtol=1e-2)
        assert int(trace.step_root[0]) == prompt
        assert int((trace.step_accepted + 1).sum()) == len(request.output_ids) - 1  # prefill emitted the first token
        assert len(trace.step_root) == request.metrics.steps
        # branch_depth 1 (the default): the rejected nodes are the branches, with their target state only
        assert trace.branch_token.tolist() == trace.reject_token.tolist() and trace.branch_parent.tolist() == [-1] * len(trace.reject_token)
        assert trace.branch_final.shape == (len(trace.branch_token), target.cfg.hidden_size) and trace.branch_features.shape[0] == 0


def test_deeper_branches_keep_every_node_off_the_path(target):
    engine = eagle_engine(target)
    traces = []
    collector = TraceCollector(traces.append, branch_depth=4)
    engine.observers.append(collector)
    engine.run(make_prompts(2), [GREEDY] * 2)
    collector.flush()
    collector.close()
    for trace in traces:
        assert len(trace.branch_token) == int(trace.step_drafted.sum() - trace.step_accepted.sum())
        assert trace.branch_features.shape == (len(trace.branch_token), trace.features.shape[1])


def _decode_entry(**kw):
    base = dict(request_id="r", tags={}, context_len=5, pending_token=9, draft_tokens=[1, 2, 3], draft_parents=[-1, 0, 1],
                accepted_nodes=[0], emitted_tokens=[1, 7], bonus=False, context_ids=[0, 1, 2, 3, 4],
                node_target_probs=torch.tensor([1.0, 0.25, 0.0]), node_draft_probs=torch.tensor([1.0, 0.5, 1.0]),
                hidden=torch.arange(3 * 4 * 2, dtype=torch.float32).view(3, 4, 2), final_hidden=torch.zeros(4, 2))
    base.update(kw)
    return RequestStep(**base)


def test_rejections_are_the_evaluated_children_of_the_accepted_path():
    assembler = TraceAssembler(branch_depth=2)
    prefill = RequestStep(request_id="r", tags={"domain": "sql"}, context_len=0, pending_token=-1, draft_tokens=[], draft_parents=[],
                          accepted_nodes=[], emitted_tokens=[9], bonus=False, context_ids=[0, 1, 2, 3, 4],
                          hidden=torch.zeros(3, 5, 2), final_hidden=torch.zeros(5, 2))
    assert assembler.add(StepRecord(0, 0.0, 0, [prefill], kind="prefill", taps=(0, 1, 2))) == []
    done = assembler.add(StepRecord(1, 0.0, 3, [_decode_entry(finish_reason="length")], taps=(0, 1, 2)))
    (trace,) = done
    assert trace.domain == "sql" and trace.tokens.tolist() == [0, 1, 2, 3, 4, 9, 1, 7]
    # node 1 (child of the accepted node 0) was evaluated and rejected: r = 1 - min(1, 0.25 / 0.5) = 0.5 at depth 1, root 4
    assert trace.reject_root.tolist() == [4] and trace.reject_depth.tolist() == [1] and trace.reject_token.tolist() == [2]
    assert trace.reject_weight.tolist() == [0.5]
    # node 2 hangs off the rejected node: a branch (with node 1), never a rejection
    assert trace.branch_token.tolist() == [2, 3] and trace.branch_parent.tolist() == [-1, 0] and trace.branch_pos.tolist() == [6, 7]
    assert trace.step_version.tolist() == [3] and trace.step_accepted.tolist() == [1]
    assert trace.node_token.tolist() == [1, 2, 3] and trace.node_parent.tolist() == [-1, 0, 1] and trace.node_step.tolist() == [0, 0, 0]
    assert trace.node_accepted.tolist() == [True, False, False] and trace.node_draft_prob.tolist() == [1.0, 0.5, 1.0]
    # committed features: 5 prompt positions + root + the accepted node, cut to L - 1 = 7; final states at
    # the generated positions 5, 6 only (the prefill's is never kept)
    assert trace.features.shape == (7, 6) and trace.final_hidden.shape == (2, 2)


def test_prefill_records_keep_half_width_states_and_no_prompt_final_states(target):
    engine = eagle_engine(target)
    records = []
    engine.observers.append(records.append)
    prompt = make_prompts(1, seed=2)[0]
    engine.run([prompt], [GREEDY])
    prefill = records[0].requests[0]
    assert records[0].kind == "prefill" and prefill.hidden.dtype == torch.float16
    assert prefill.hidden.shape[1] == len(prompt) and prefill.final_hidden.shape == (1, target.cfg.hidden_size)
    assert prefill.sampling == (0.0, 0, 1.0) and records[1].requests[0].hidden.dtype == torch.float16


def test_collector_never_blocks_the_engine():
    """The consumer is stuck in the sink; the queue (2) fills and the other 48 of 50 records are dropped at once."""
    inside, release = threading.Event(), threading.Event()
    collector = TraceCollector(lambda trace: inside.set() or release.wait(), max_queue=2)
    prefill = RequestStep(request_id="first", tags={}, context_len=0, pending_token=-1, draft_tokens=[], draft_parents=[], accepted_nodes=[],
                          emitted_tokens=[9], bonus=False, finish_reason="length", context_ids=[0, 1], hidden=torch.zeros(3, 2, 2),
                          final_hidden=torch.zeros(1, 2))
    collector(StepRecord(0, 0.0, 0, [prefill], kind="prefill", taps=(0, 1, 2)))
    assert inside.wait(5)
    record = StepRecord(1, 0.0, 0, [_decode_entry(request_id="x")])
    start = time.perf_counter()
    for _ in range(50):
        collector(record)
    assert time.perf_counter() - start < 0.5
    assert collector.dropped_records == 48
    release.set()
    collector.close()


def assert_same_trace(a, b):
    assert trace_header(a) == trace_header(b) and a.sampling == b.sampling and a.taps == b.taps
    assert a.tensors().keys() == b.tensors().keys()
    for name, tensor in b.tensors().items():
        assert a.tensors()[name].dtype == tensor.dtype and torch.equal(a.tensors()[name], tensor), name


def test_traces_cross_a_process_boundary_as_bytes_exactly(target):
    """The wire form (safetensors + JSON header, no pickle) gives back every field, dtype and value; empty
    tensors (no branches' tapped states, no rejections) included."""
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3)
    traces = served_traces(target, n=2, seed=4, branch_depth=4) + served_traces(target, n=1, seed=5, params=sampled)
    traces.append(dataclasses.replace(traces[0], reject_root=torch.zeros(0, dtype=torch.long), domain="sql", request_id="émpty"))
    assert any(t.branch_features.numel() for t in traces) and traces[2].sampling == (0.8, 20, 1.0)
    for trace in traces:
        data = trace_to_bytes(trace)
        assert isinstance(data, bytes) and b"pickle" not in data[:64]
        assert_same_trace(trace_from_bytes(data), trace)
    other = dataclasses.replace(traces[0], schema_version=1)
    with pytest.raises(TandemError, match="schema"):
        trace_from_bytes(trace_to_bytes(other))


def test_an_aborted_request_releases_its_partial_trace_as_a_trace(target):
    """engine.abort tells observers: the assembler lets go of the partial trace (hidden states included) and
    finishes it as it stands, so stop-string and disconnect aborts reach training instead of piling up."""
    engine = eagle_engine(target)
    traces = []
    collector = TraceCollector(traces.append)
    engine.observers.append(collector)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(2)
    ids = [engine.add_request(p, long) for p in prompts]
    requests = list(engine.waiting)
    for _ in range(3):
        engine.step()
    engine.abort(ids[0])
    collector.flush()
    assert collector.assembler.aborted == 1 and list(collector.assembler.inflight) == [ids[1]]
    assert [t.request_id for t in traces] == [ids[0]]
    trace, request = traces[0], requests[0]
    assert trace.tokens.tolist() == request.prompt_ids + request.output_ids and 1 < len(request.output_ids) < 40
    assert len(trace.features) == len(trace.tokens) - 1 and len(trace.step_root) == request.metrics.steps
    engine.abort(ids[1])
    engine.abort(ids[1])  # a second abort of a finished request emits nothing
    collector.flush()
    collector.close()
    assert collector.assembler.aborted == 2 and not collector.assembler.inflight and len(traces) == 2
