"""nn.Modules and model loading: the target runtime, KV cache, zoo, drafter heads."""
