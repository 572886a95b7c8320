"""Serving: tokens/s, latency and time to first token over HTTP and in the engine, and soak runs for hangs and growth."""
