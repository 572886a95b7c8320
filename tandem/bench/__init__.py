"""Benchmarks: real prompts, decode runs, domain-shift streams and their plots."""
