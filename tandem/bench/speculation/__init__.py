"""Speculative decoding: tokens/s and acceptance per drafter, batch size, draft shape, vocabulary and precision."""
