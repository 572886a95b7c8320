"""The RL-rollout paper's figures (NVIDIA, arXiv 2604.26779), reproduced from the inputs it states,
with every further assumption written here.

Stated by the paper: Qwen3-8B, synchronous RL, generation 100.0 s -> 56.6 s with speculation (1.77x,
quoted as 1.8x); generation is 65-72 % of the step; step speedup ~1.41x (Amdahl). A simulated projection
for a 235B MoE on 2,048 GB200: ~3.5x rollout and ~2.5x end to end, with asynchronous RL.

Our assumptions for the 235B projection (the paper's simulator inputs are not public to us):
- model: Qwen3-235B-A22B shape (94 layers, hidden 4096, 64 query / 4 KV heads of 128, 128 experts of
  3 x 4096 x 1536, 8 routed per token, vocab 151,936); FP8 weights, BF16 KV cache;
- rollout replicas of 8 GB200 (TP/EP 8 over NVLink), 256 replicas on 2,048 GPUs;
- a step samples 8,192 sequences (512 prompts x 16), 1,024-token prompts, long-tailed responses
  (exponential, mean 8,192, cap 32,768 tokens): 32 sequences per replica, shrinking to 1;
- drafter: an EAGLE-3 / MTP-style head with conditional acceptance 0.95, 0.92, 0.90, 0.88, 0.86, 0.84,
  0.82, 0.80 per position (a trained drafter on reasoning text of its own policy), k <= 8 chosen per step;
  one draft depth costs a 0.4 B-parameter FP8 forward on the replica (one decoder layer + head);
- end to end: the asynchronous pipeline (generation of step i+1 overlaps training on step i) with the
  generation share at 0.714, inside the paper's measured 65-72 %; the 2.5x is read as async with
  speculation vs async without (then the bound is the training side: f / (1 - f) = 2.5).
"""
from __future__ import annotations

from tandem.sim.amdahl import amdahl
from tandem.sim.cluster import RolloutScenario, StepPrediction, simulate_step
from tandem.sim.hardware import preset
from tandem.sim.parallel import replica_machine
from tandem.sim.roofline import ModelWork, forward_seconds
from tandem.sim.speculative import DraftCost

QWEN3_8B_GENERATION_SPEEDUP = 100.0 / 56.6  # measured by the paper (quoted 1.8x)
QWEN3_8B_GENERATION_SHARE = (0.65, 0.72)
PAPER_8B_STEP_SPEEDUP = 1.41
PAPER_235B_ROLLOUT_SPEEDUP = 3.5
PAPER_235B_END_TO_END = 2.5


def qwen3_8b_step_speedups() -> dict[str, float]:
    """Amdahl at the paper's measured generation speedup over its measured generation-share range."""
    lo, hi = QWEN3_8B_GENERATION_SHARE
    s = QWEN3_8B_GENERATION_SPEEDUP
    return {"generation_speedup": s, f"step_at_f={lo}": amdahl(lo, s), f"step_at_f={hi}": amdahl(hi, s),
            "step_at_1.8x_f=0.65": amdahl(lo, 1.8)}


def qwen3_235b_a22b() -> ModelWork:
    layers, d, vocab = 94, 4096, 151_936
    q, kv = 64 * 128, 4 * 128
    attention = layers * (2 * d * q + 2 * d * kv)
    router = layers * d * 128
    head = vocab * d
    return ModelWork(
        name="qwen3-235b-a22b", dense_params=attention + router + head + d, bytes_per_param=1.0,
        kv_bytes_per_token=2 * layers * kv * 2, attn_flops_per_token_ctx=4.0 * layers * q,
        expert_params=layers * 3 * d * 1536, num_experts=128, experts_per_token=8,
    )


def projection_235b_gb200() -> RolloutScenario:
    work = qwen3_235b_a22b()
    machine = replica_machine(preset("gb200"), "fp8", tp=8, layers=94, hidden=4096)
    head = ModelWork("eagle-head", dense_params=0.4e9, bytes_per_param=1.0, kv_bytes_per_token=2 * 4 * 128 * 2,
                     attn_flops_per_token_ctx=4.0 * 64 * 128)
    depth_s = forward_seconds(head, machine, 32, 1, 8192) - machine.overhead_s + 2 * preset("gb200").launch_s_per_layer
    return RolloutScenario(
        work=work, machine=machine, devices=2048, devices_per_replica=8, sequences=8192, prompt_tokens=1024,
        mean_response_tokens=8192, max_response_tokens=32768,
        acceptance=(0.95, 0.92, 0.90, 0.88, 0.86, 0.84, 0.82, 0.80), max_k=8,
        draft=DraftCost(per_depth_s=depth_s), generation_share=0.714,
    )


def reproduce() -> dict:
    """Both figures, as the tables in docs/BENCHMARKS.md print them."""
    p: StepPrediction = simulate_step(projection_235b_gb200())
    return {
        "qwen3_8b": qwen3_8b_step_speedups(),
        "qwen3_235b_gb200": {
            "rollout_speedup": p.rollout_speedup, "sync_step_speedup": p.sync_step_speedup,
            "async_step_speedup": p.async_step_speedup, "async_spec_vs_sync_plain": p.async_vs_sync_plain,
            "rollout_plain_s": p.rollout_plain_s, "rollout_spec_s": p.rollout_spec_s,
        },
        "paper": {"qwen3_8b_step": PAPER_8B_STEP_SPEEDUP, "235b_rollout": PAPER_235B_ROLLOUT_SPEEDUP,
                  "235b_end_to_end": PAPER_235B_END_TO_END},
    }
