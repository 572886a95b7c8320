"""Training drafter heads: offline (from the target's own continuations of prompts)."""
