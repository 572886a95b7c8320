"""RL pieces on the real SmolLM2-135M-Instruct: exact log-probs under speculation, self_draft after a policy update."""
import pytest
import torch

from tandem.config import SamplingParams
from tandem.llm import load_tokenizer
from tandem.models.loader import load_transformer
from tandem.models.quantize import quantized_copy
from tandem.models.zoo import resolve_model
from tandem.rl.rollout import update_policy
from tandem.rl.setup import build_engines
from tandem.rl.envs import EnvConfig, ReasoningEnv

pytestmark = pytest.mark.slow
LOGPROB_TOL = 2e-3  # fp32, 30 layers: batched KV-cached verify vs one plain forward differ by ~1e-4 in logits


@pytest.fixture(scope="module")
def setup():
    path = resolve_model("smollm2-135m")
    target = load_transformer(path)
    target.pack()
    engines = build_engines(target, ["ar", "self_draft"], max_batch=4, max_len=256, num_draft_tokens=4, adaptive_k=False)
    env = ReasoningEnv(EnvConfig(), held_out_size=2)
    prompts = [env.render(p, load_tokenizer(path)) for p in env.held_out]
    return path, target, engines, prompts


def test_speculative_rollout_logprobs_match_a_plain_forward(setup):
    path, target, (ar, spec), prompts = setup
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=0)
    batch = spec.generate_rollouts(prompts, 2, params)
    assert sum(r.metrics["accepted_tokens"] for r in batch.rollouts) > 0
    reference = load_transformer(path)
    for r in batch.rollouts:
        with torch.inference_mode():
            logits = reference(torch.tensor([r.prompt_ids + r.completion_ids])).logits[0, len(r.prompt_ids) - 1 : -1]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.completion_ids).view(-1, 1)).squeeze(-1)
        assert torch.allclose(torch.tensor(r.policy_logprobs), want, atol=LOGPROB_TOL, rtol=0)
        assert torch.allclose(torch.tensor(r.logprobs), want, atol=LOGPROB_TOL, rtol=0)  # temperature 1: the same distribution


def test_self_draft_follows_a_policy_update(setup):
    path, target, (ar, spec), prompts = setup
    gen = torch.Generator().manual_seed(0)
    new = {n: p.detach() + 1e-3 * torch.randn(p.shape, generator=gen) for n, p in load_transformer(path).named_parameters()}
    update_policy([ar, spec], new, 1)
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        assert torch.equal(spec.drafter.model(ids).logits, quantized_copy(target)(ids).logits)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    assert [r.completion_ids for r in spec.generate_rollouts(prompts, 1, params).rollouts] == \
        [r.completion_ids for r in ar.generate_rollouts(prompts, 1, params).rollouts]


def test_a_short_grpo_run_on_the_reasoning_workload():
    from tandem.rl.grpo import GRPOConfig
    from tandem.rl.setup import build_trainer

    cfg = GRPOConfig(steps=1, prompts_per_step=2, group_size=2, max_tokens=48, eval_problems=4, eval_every=1, lr=1e-5)
    trainer = build_trainer("smollm2-135m", ["ngram"], cfg)
    history = trainer.run()
    record = history[0]
    assert record["step"] == 0 and trainer.learner.version == 1 and trainer.engines[0].policy_version == 1
    assert 0.0 <= record["reward_mean"] <= 1.0 and 1 <= record["completion_tokens_mean"] <= 48
    assert record["tokens"] == sum(record["rollout_tokens"].values())
    assert (record["entropy"] is None) == (record["skipped_samples"] == 4)  # no gradient anywhere: nothing forwarded
    assert [e["step"] for e in trainer.evals] == [0, 1]
    for e in trainer.evals:
        low, high = e["greedy_ci95"]
        assert e["problems"] == 4 and low <= e["greedy"] <= high
    assert {p.task for p in trainer.held_out} <= {"basic_arithmetic", "chain_sum", "gsm_symbolic"}
