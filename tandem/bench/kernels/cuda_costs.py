"""`python -m tandem.bench.kernels.cuda_costs`: where speculation pays on a GPU, measured against the simulator.

A random-weight model of Qwen2.5-Coder-1.5B's shape (the weights' values do not change the time of a dense
forward; the real weights cannot travel to a lent GPU machine) is loaded in bf16 on CUDA and one cached
forward of k new tokens per row is timed at each batch size, eager and compiled (CUDA graphs), at a
mid-rollout context. Next to each: the simulator's prediction for the same forward on its H200 preset
(tandem.sim.roofline), and the cost ratio cost(B, k) / cost(B, 1), which is what a verify step of k - 1
drafted tokens costs relative to plain decoding: near 1 means speculation pays its acceptance length,
near k means it pays nothing.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from tandem.bench.kernels.forward import forward_cost_pair_ms
from tandem.models.loader import load_transformer
from tandem.models.tiny import make_tiny_model

QWEN_1_5B_SHAPE = dict(vocab_size=151936, num_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                       num_key_value_heads=2, head_dim=128, max_position_embeddings=4096)


def predicted_ms(model, batch: int, tokens: int, context: int, hardware: str) -> float:
    """The simulator's forward time for the same shapes on one device of its `hardware` preset (bf16)."""
    from tandem.sim.hardware import preset
    from tandem.sim.parallel import replica_machine
    from tandem.sim.roofline import forward_seconds, work_from_config

    machine = replica_machine(preset(hardware), "bf16", 1, model.cfg.num_layers, model.cfg.hidden_size)
    work = work_from_config(model.cfg, "qwen2.5-coder-1.5b", bytes_per_param=2.0, kv_bytes=2.0)
    return forward_seconds(work, machine, batch, tokens, context) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--ks", default="1,3,5", help="new tokens per row (1 = plain decoding, k = a verify of k - 1 drafts)")
    parser.add_argument("--context", type=int, default=384)
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model = load_transformer(make_tiny_model(tmp, "qwen2", **QWEN_1_5B_SHAPE), torch.bfloat16, "cuda")
    print(f"[cuda_costs] model ready in {time.time() - t0:.0f} s", flush=True)
    ks = tuple(int(k) for k in args.ks.split(","))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": "qwen2.5-coder-1.5b", "dtype": "bfloat16",
              "context": args.context, "batches": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        t1 = time.time()
        pair = forward_cost_pair_ms(model, ks=ks, context=args.context, reps=args.reps, batch=batch)
        row = {"ms": {name: {k: round(v, 4) for k, v in c.items()} for name, c in pair.items()},
               "cost_ratio_compiled": {k: round(pair["compiled"][k] / pair["compiled"][1], 3) for k in ks}}
        try:
            row["predicted_ms"] = {k: round(predicted_ms(model, batch, k, args.context, args.hardware), 4) for k in ks}
        except Exception as e:  # the prediction is a comparison, never a reason to lose the measurement
            row["predicted_error"] = repr(e)
        row["seconds"] = round(time.time() - t1, 1)
        result["batches"][batch] = row
        print(json.dumps({batch: row}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
