"""The engine: one owner of requests and KV caches; one step loop for plain and speculative decoding."""
