"""RL rollouts per drafter: acceptance length and rollout wall time."""
