"""Write a Transformer's parameters back as an HF-format model directory (what `tandem export` and `tandem rl
--export` write), loadable by `transformers.AutoModelForCausalLM.from_pretrained`.

The weights are the exact inverse of tandem.models.loader.hf_to_tandem: our names back to HF's, the fused q/k/v and
gate/up matrices split at the row offsets the loader concatenated them at, a tied lm_head left out (as HF saves it:
`tie_word_embeddings` in config.json ties it on load). config.json is the source model's, unchanged but for its
dtype field (the dtype of the tensors written); the tokenizer and generation files are copied from the source
directory. Safetensors only. The directory is written beside its destination and renamed into place, and an
existing non-empty destination is refused, so nothing is overwritten and no half-written export is left.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tandem.errors import InvalidParameterError, ModelLoadError
from tandem.models.config import ModelConfig

WEIGHTS_FILE = "model.safetensors"
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                "tokenizer.model", "chat_template.jinja", "chat_template.json", "generation_config.json")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def tandem_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameter names (a Transformer's named_parameters: a tied lm_head may be absent) -> HF Llama/Qwen names."""
    get = _getter(state)
    out = {"model.embed_tokens.weight": get("embed.weight"), "model.norm.weight": get("norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    qkv_rows = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    for i in range(cfg.num_layers):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        attn = dst + "self_attn."
        for name, part in zip("qkv", get(src + "attn.qkv.weight").split(qkv_rows)):
            out[attn + f"{name}_proj.weight"] = part
        if cfg.qkv_bias:
            for name, part in zip("qkv", get(src + "attn.qkv.bias").split(qkv_rows)):
                out[attn + f"{name}_proj.bias"] = part
        out[attn + "o_proj.weight"] = get(src + "attn.o.weight")
        if cfg.qk_norm:
            out[attn + "q_norm.weight"] = get(src + "attn.q_norm.weight")
            out[attn + "k_norm.weight"] = get(src + "attn.k_norm.weight")
        gate, up = get(src + "mlp.gate_up.weight").split([cfg.intermediate_size, cfg.intermediate_size])
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        out[dst + "mlp.down_proj.weight"] = get(src + "mlp.down.weight")
        out[dst + "input_layernorm.weight"] = get(src + "attn_norm.weight")
        out[dst + "post_attention_layernorm.weight"] = get(src + "mlp_norm.weight")
    _check_all_used(state, cfg)
    return out


def _getter(state: dict[str, torch.Tensor]):
    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ModelLoadError(f"the policy lacks the parameter {name!r}: not a model of this config.json")
        return state[name]

    return get


def _check_all_used(state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    known = {"embed.weight", "norm.weight", "lm_head.weight"}
    for i in range(cfg.num_layers):
        names = ["attn.qkv.weight", "attn.o.weight", "mlp.gate_up.weight", "mlp.down.weight", "attn_norm.weight", "mlp_norm.weight"]
        names += ["attn.qkv.bias"] if cfg.qkv_bias else []
        names += ["attn.q_norm.weight", "attn.k_norm.weight"] if cfg.qk_norm else []
        known |= {f"blocks.{i}.{n}" for n in names}
    extra = sorted(set(state) - known)
    if extra:
        raise ModelLoadError(f"the policy has parameters this config.json does not describe: {extra[:5]}")


def export_hf(named_tensors: dict[str, torch.Tensor], source_dir: str | Path, out_dir: str | Path) -> Path:
    """Write `named_tensors` (a Transformer of the model in `source_dir`) as an HF model directory at `out_dir`."""
    from safetensors.torch import save_file

    source_dir, out_dir = Path(source_dir), Path(out_dir)
    check_destination(out_dir)
    cfg = ModelConfig.from_dir(source_dir)
    hf = tandem_to_hf(named_tensors, cfg)
    dtype = hf["model.embed_tokens.weight"].dtype
    if dtype not in DTYPE_NAMES or any(t.dtype != dtype for t in hf.values()):
        raise ModelLoadError(f"export needs every parameter in one of {sorted(DTYPE_NAMES.values())}")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: t.detach().to("cpu").contiguous().clone() for n, t in hf.items()}, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(export_config(source_dir, DTYPE_NAMES[dtype]), indent=2) + "\n")
    for name in COPIED_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, tmp / name)
    if out_dir.exists():
        out_dir.rmdir()  # empty (check_destination)
    tmp.rename(out_dir)
    return out_dir


def export_config(source_dir: Path, dtype: str) -> dict:
    """The source's config.json with its dtype field(s) naming the written tensors' dtype."""
    config = json.loads((source_dir / "config.json").read_text())
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
    return config | {k: dtype for k in keys}


def check_destination(out_dir: str | Path) -> None:
    """An export never overwrites: the destination must not exist, or be an empty directory."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InvalidParameterError(f"export destination {out_dir} exists and is not an empty directory")
