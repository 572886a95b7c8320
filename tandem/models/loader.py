"""Load an HF-format model directory (config.json + safetensors) into our Transformer.

HF parameter names are mapped to ours; q/k/v and gate/up are fused into single matmuls (fewer, larger
GEMMs are cheaper here). Only safetensors are read: pickled checkpoints are refused.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors import SafetensorError

from tandem.errors import ModelLoadError
from tandem.models.config import ModelConfig
from tandem.models.memory import release_freed_memory
from tandem.models.transformer import Transformer


def safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{index} is unreadable: {e}") from e
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pt")]
        hint = f" (found {pickled}: pickled checkpoints are never loaded; convert them to safetensors)" if pickled else ""
        raise ModelLoadError(f"no *.safetensors in {model_dir}{hint}")
    return files


def read_hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensor_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except (OSError, SafetensorError, RuntimeError, ValueError) as e:
            raise ModelLoadError(f"corrupt or unreadable weight file {path}: {e}. Re-fetch or re-convert the model.") from e
    return tensors


def hf_to_tandem(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename (and fuse) HF Llama/Qwen parameters into the Transformer's state dict."""
    get = _getter(hf)
    out = {"embed.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    out["lm_head.weight"] = out["embed.weight"] if cfg.tie_embeddings else get("lm_head.weight")
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        attn = src + "self_attn."
        out[dst + "attn.qkv.weight"] = torch.cat([get(attn + f"{n}_proj.weight") for n in "qkv"])
        if cfg.qkv_bias:
            out[dst + "attn.qkv.bias"] = torch.cat([get(attn + f"{n}_proj.bias") for n in "qkv"])
        out[dst + "attn.o.weight"] = get(attn + "o_proj.weight")
        if cfg.qk_norm:
            out[dst + "attn.q_norm.weight"] = get(attn + "q_norm.weight")
            out[dst + "attn.k_norm.weight"] = get(attn + "k_norm.weight")
        out[dst + "mlp.gate_up.weight"] = torch.cat([get(src + "mlp.gate_proj.weight"), get(src + "mlp.up_proj.weight")])
        out[dst + "mlp.down.weight"] = get(src + "mlp.down_proj.weight")
        out[dst + "attn_norm.weight"] = get(src + "input_layernorm.weight")
        out[dst + "mlp_norm.weight"] = get(src + "post_attention_layernorm.weight")
    return out


def _getter(hf: dict[str, torch.Tensor]):
    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise ModelLoadError(f"weight {name!r} missing from the checkpoint")
        return hf[name]

    return get


def load_transformer(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Transformer:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    cfg = ModelConfig.from_dir(model_dir)
    state = hf_to_tandem(read_hf_tensors(model_dir), cfg)
    _check_shapes(state, cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    # copy out of the safetensors mmap: views into it would keep the whole file mapped (and counted in RSS)
    model.load_state_dict({k: v.to(dtype, copy=True) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"checkpoint lacks parameters {missing[:5]}")
    model = model.to(device).eval().requires_grad_(False)
    release_freed_memory()  # the copies out of the mmap and the q/k/v, gate/up sources
    return model


def _check_shapes(state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    expected = {
        "embed.weight": (cfg.vocab_size, cfg.hidden_size),
        "blocks.0.attn.qkv.weight": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),
        "blocks.0.mlp.gate_up.weight": (2 * cfg.intermediate_size, cfg.hidden_size),
    }
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ModelLoadError(f"{name} has shape {tuple(state[name].shape)}, config.json implies {shape}")
