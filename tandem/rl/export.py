"""The trained policy as a Hugging Face model directory: `tandem rl --export DIR` at the end of a run, and
`tandem export CHECKPOINT --out DIR` from a `tandem rl --checkpoint` directory (tandem.models.hf_export writes it:
HF parameter names, the source's config.json, its tokenizer files).

The base model (its config.json and tokenizer) is the one the run trained: a checkpoint records it (state.json
"model"); `--model` names it for a checkpoint that does not.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.errors import InvalidParameterError, TandemError


def export_policy(named_tensors: dict, model: str, out: str | Path) -> Path:
    """`named_tensors`: the learner's parameters (tandem names) of `model` (a zoo name or an HF model directory)."""
    from tandem.models.hf_export import export_hf
    from tandem.models.zoo import resolve_model

    return export_hf(named_tensors, resolve_model(model), out)


def export_checkpoint(checkpoint: str | Path, out: str | Path, model: str | None = None) -> Path:
    from safetensors.torch import load_file

    from tandem.models.hf_export import check_destination
    from tandem.rl.checkpoint import STATE_FILE

    checkpoint = Path(checkpoint)
    check_destination(out)
    try:
        state = json.loads((checkpoint / STATE_FILE).read_text())
        policy = load_file(str(checkpoint / "policy.safetensors"))
    except (OSError, ValueError, RuntimeError) as e:
        raise TandemError(f"cannot read a tandem rl checkpoint from {checkpoint}: {e}") from e
    model = model or state.get("model")
    if not model:
        raise InvalidParameterError(f"{checkpoint / STATE_FILE} does not name its model: pass --model (the run's --model)")
    return export_policy(policy, model, out)


def add_export_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="a tandem rl checkpoint's policy as a Hugging Face model directory")
    p.add_argument("checkpoint", help="a `tandem rl --checkpoint` directory")
    p.add_argument("--out", required=True, help="the model directory to write (must not exist, or be empty)")
    p.add_argument("--model", default=None, help="the run's --model (default: the one the checkpoint records)")
    p.set_defaults(func=run_export)
    return p


def run_export(args) -> int:
    path = export_checkpoint(args.checkpoint, args.out, args.model)
    print(json.dumps({"exported": str(path)}))
    return 0
