"""Step records (tandem.engine.records): what a recorded greedy step reads of the target, and at what cost."""
import torch

import tandem.engine.engine as engine_module
from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.engine.records import node_target_probs
from tandem.models.loader import load_transformer
from tandem.ops.sampling import sampling_probs


def test_a_greedy_rows_node_probabilities_are_its_argmax_one_hot():
    """Hand-made logits over 4 tokens: node 0 (parent: the root) is the root's argmax, node 1 (parent: node 0) is not
    node 0's argmax, node 2 (parent: the root) is not either; the same as reading the T = 0 sampling distribution."""
    logits = torch.tensor([[0.1, 2.0, 0.3, 0.0], [1.5, 0.2, 0.1, 0.0], [0.0, 0.0, 0.0, 3.0]])
    parent_rows, tokens = torch.tensor([0, 1, 0]), torch.tensor([1, 2, 3])
    assert node_target_probs(None, logits, parent_rows, tokens).tolist() == [1.0, 0.0, 0.0]
    greedy = sampling_probs(logits, torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(3))
    assert node_target_probs(greedy, logits, parent_rows, tokens).tolist() == [1.0, 0.0, 0.0]
    step_argmax = logits.argmax(-1)  # the verify's own argmax, passed in: read, not taken again over the vocabulary
    assert node_target_probs(None, logits, parent_rows, tokens, step_argmax).tolist() == [1.0, 0.0, 0.0]
    assert node_target_probs(None, logits, parent_rows, tokens, torch.tensor([1, 2, 3])).tolist() == [1.0, 1.0, 0.0]


def test_recorded_greedy_steps_compute_no_sampling_distribution(tiny_llama, monkeypatch):
    """Recording a greedy request's steps (the flywheel's serving) no longer runs the sampling transform over the
    vocabulary for every verified row (it did for every recorded row: ~1 % of the demo's serving time); the records'
    node probabilities are the one-hot reads, and the output is plain decoding's."""
    target = load_transformer(tiny_llama)
    target.pack()
    prompts, params = [[5, 9, 11, 4, 7], [3, 3, 8, 1]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [r.output_ids for r in Engine(target, EngineConfig(max_batch_size=2, max_model_len=64)).run(prompts, [params] * 2)]
    calls = []
    monkeypatch.setattr(engine_module, "step_target_probs", lambda requests, drafts, logits, needed: calls.append(any(needed)) or [None] * len(requests))
    drafter = build_drafter("eagle", target=target, num_draft_tokens=3, max_batch=2, max_len=64, draft_vocab_size=200, min_confidence=0.0)
    engine = Engine(target, EngineConfig(max_batch_size=2, max_model_len=64, record_steps=True), drafter=drafter)
    records = []
    engine.observers.append(records.append)
    assert [r.output_ids for r in engine.run(prompts, [params] * 2)] == plain
    assert calls and not any(calls)
    entries = [e for record in records if record.kind == "decode" for e in record.requests if e.draft_tokens]
    assert entries and all(set(e.node_target_probs.tolist()) <= {0.0, 1.0} for e in entries)
    for e in entries:  # a node on the accepted path was the target's choice: probability 1
        assert all(e.node_target_probs[j] == 1.0 for j in e.accepted_nodes)
