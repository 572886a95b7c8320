"""`python -m tandem.bench.kernels.cuda_forward`: the compiled forward on a GPU, for a machine without the model files.

A random-weight model of SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads, vocab 49152) is written
with the tiny-model tooling, loaded on CUDA, and timed eager vs compiled (inductor + CUDA graphs) per
forward of k new tokens at batch 1 and 32; the weights' values do not change the time of a dense forward.
"""
from __future__ import annotations

import argparse
import json
import tempfile

import torch

from tandem.bench.kernels.forward import forward_cost_pair_ms
from tandem.models.loader import load_transformer
from tandem.models.tiny import make_tiny_model

SMOLLM2_SHAPE = dict(vocab_size=49152, num_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, max_position_embeddings=2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--ks", default="1,2,4,5", help="new tokens per row to time")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_transformer(make_tiny_model(tmp, "llama", **SMOLLM2_SHAPE), dtype, "cuda")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype, "shape": "smollm2-135m", "batches": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        ks = tuple(int(k) for k in args.ks.split(","))
        pair = forward_cost_pair_ms(model, ks=ks, batch=batch, reps=30)
        result["batches"][batch] = {
            "ms": {name: {k: round(v, 3) for k, v in c.items()} for name, c in pair.items()},
            "compiled_speedup": {k: round(pair["eager"][k] / pair["compiled"][k], 2) for k in pair["eager"]},
            "cost_ratio_over_k1": {name: {k: round(v / c[1], 3) for k, v in c.items()} for name, c in pair.items()},
        }
        print(json.dumps({batch: result["batches"][batch]}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
