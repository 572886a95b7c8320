"""RL post-training with speculative rollouts: rollout engine, verifiable tasks, GRPO."""
