"""Convert a llama.cpp GGUF file into an HF-format model directory (config, fp32 safetensors, tokenizer).

Reads tensors one at a time with the `gguf` package's reader and dequantizer, so peak memory is bounded
by one safetensors shard, not the whole model. The result loads in our runtime and in HF transformers
(`AutoModelForCausalLM.from_pretrained(out_dir)`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tandem.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
_MISSING = object()


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF `general.architecture` maps onto an HF model class."""

    model_type: str  # HF config `model_type`
    hf_class: str  # HF `architectures[0]`
    permute_qk: bool  # llama.cpp permuted Q/K rows for its interleaved RoPE (Llama family only)
    attention_bias: bool  # q/k/v projections carry a bias


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", permute_qk=True, attention_bias=False),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", permute_qk=False, attention_bias=True),
}

# GGUF per-layer tensor stem -> HF parameter stem (both without the ".weight"/".bias" suffix).
_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def open_gguf(path: Path):
    """A `gguf.GGUFReader` over `path`; a missing, truncated or corrupt file raises ModelLoadError."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path)
    except Exception as err:  # the reader raises ValueError, IndexError, struct errors... on bad bytes
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): {err}") from err


def read_field(reader, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata `key` (scalar, string or list); missing and no default -> ModelLoadError."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ModelLoadError(f"GGUF metadata lacks required key {key!r}")
        return default
    return field.contents()


def arch_spec(reader) -> tuple[str, ArchSpec]:
    """The GGUF architecture name and its ArchSpec; unsupported ones raise ModelLoadError."""
    arch = read_field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(ARCHS)}")
    return arch, ARCHS[arch]


def _clean_float(value: float) -> float:
    """GGUF stores float32; 9.999999747e-06 becomes 1e-05, the value the model was configured with."""
    return float(str(np.float32(value)))


def build_config(reader) -> dict[str, Any]:
    """An HF transformers `config.json` dict from the GGUF metadata and tensor shapes."""
    arch, spec = arch_spec(reader)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("GGUF has no token_embd.weight tensor")
    hidden = int(read_field(reader, f"{arch}.embedding_length"))
    heads = int(read_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(read_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_theta = _clean_float(read_field(reader, f"{arch}.rope.freq_base", 10000.0))
    return {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # GGUF shape is [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": int(read_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(read_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(read_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _clean_float(read_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(read_field(reader, f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": spec.attention_bias,
        "bos_token_id": _optional_int(read_field(reader, "tokenizer.ggml.bos_token_id", None)),
        "eos_token_id": _optional_int(read_field(reader, "tokenizer.ggml.eos_token_id", None)),
        "use_cache": True,
        "torch_dtype": "float32",
    }


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def tensor_name_map(config: dict[str, Any]) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, in HF order (embeddings, layers, final norm, head)."""
    names = {"token_embd.weight": "model.embed_tokens.weight"}
    for i in range(config["num_hidden_layers"]):
        for gguf_stem, hf_stem in _LAYER_NAMES.items():
            names[f"blk.{i}.{gguf_stem}.weight"] = f"model.layers.{i}.{hf_stem}.weight"
        if config["attention_bias"]:
            for proj in ("q", "k", "v"):
                names[f"blk.{i}.attn_{proj}.bias"] = f"model.layers.{i}.self_attn.{proj}_proj.bias"
    names["output_norm.weight"] = "model.norm.weight"
    if not config["tie_word_embeddings"]:
        names["output.weight"] = "lm_head.weight"
    return names


def check_tensor_names(reader, names: dict[str, str]) -> None:
    """Every expected tensor is present and none is left over (a stray one, e.g. rope_freqs, would
    mean a model variant this converter does not understand)."""
    present = {t.name for t in reader.tensors}
    missing = sorted(set(names) - present)
    extra = sorted(present - set(names))
    if missing or extra:
        raise ModelLoadError(f"GGUF tensors do not match the expected layout: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (`convert_hf_to_gguf.py` `permute`).

    llama.cpp reorders each head's rows from HF's halves layout [x_0..x_{d/2-1}, y_0..y_{d/2-1}]
    (rotate_half RoPE) to interleaved pairs [x_0, y_0, x_1, y_1, ...]. `weight` is
    [n_head * head_dim, in_features] (or [n_head * head_dim] for a bias); returns the same shape.
    """
    head_dim = weight.shape[0] // n_head
    pairs = weight.reshape(n_head, head_dim // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(pairs.swapaxes(1, 2).reshape(weight.shape))


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUF tensor as a float32 numpy array in numpy (row-major, HF) shape order."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except Exception as err:  # NotImplementedError for unknown quant types; ValueError on short data
        raise ModelLoadError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {err}") from err
    return np.ascontiguousarray(values.reshape(shape), dtype=np.float32)


def hf_tensor(tensor, hf_name: str, config: dict[str, Any], spec: ArchSpec) -> np.ndarray:
    """The dequantized tensor in HF layout (Q/K rows un-permuted for Llama-family models)."""
    values = dequantize_tensor(tensor)
    if spec.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_qk(values, config["num_attention_heads"])
    if spec.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_qk(values, config["num_key_value_heads"])
    return values


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Split names (in order) into consecutive groups of at most `max_shard_bytes` (a tensor larger
    than the limit gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_file_names(num_shards: int) -> list[str]:
    """HF's naming: one `model.safetensors`, or `model-0000i-of-0000n.safetensors`."""
    if num_shards == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def write_weights(reader, config: dict[str, Any], out_dir: Path, progress: bool = True,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write the fp32 weights as safetensors shards (+ index when sharded); returns the file names."""
    from safetensors.numpy import save_file

    _, spec = arch_spec(reader)
    names = tensor_name_map(config)
    check_tensor_names(reader, names)
    tensors = {t.name: t for t in reader.tensors}
    sizes = {g: int(np.prod([int(d) for d in tensors[g].shape])) * 4 for g in names}
    shards = plan_shards(sizes, max_shard_bytes)
    files = shard_file_names(len(shards))
    bar = tqdm(total=len(names), desc="convert", unit="tensor", file=sys.stderr, disable=not progress)
    with bar:
        for shard, file_name in zip(shards, files):
            arrays = {}
            for gguf_name in shard:
                arrays[names[gguf_name]] = hf_tensor(tensors[gguf_name], names[gguf_name], config, spec)
                bar.update(1)
            save_file(arrays, str(out_dir / file_name), metadata={"format": "pt"})
    if len(files) > 1:
        _write_index(out_dir, names, shards, files, sum(sizes.values()))
    return files


def _write_index(out_dir: Path, names: dict[str, str], shards: list[list[str]], files: list[str],
                 total_bytes: int) -> None:
    weight_map = {names[g]: f for shard, f in zip(shards, files) for g in shard}
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    _write_json(out_dir / INDEX_FILE, index)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def write_tokenizer(gguf_path: Path, out_dir: Path, reader) -> None:
    """Build the fast tokenizer from the GGUF metadata with transformers and save it (tokenizer.json,
    tokenizer_config.json with the chat template inlined)."""
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as err:  # transformers raises ValueError/KeyError/OSError for odd vocabularies
        raise ModelLoadError(f"cannot build a tokenizer from {gguf_path.name}: {err}") from err
    _fix_pre_tokenizer(tokenizer, read_field(reader, "tokenizer.ggml.pre", None))
    expected_template = read_field(reader, "tokenizer.chat_template", None)
    if expected_template is not None and tokenizer.chat_template != expected_template:
        raise ModelLoadError(f"{gguf_path.name}: the chat template was lost building the tokenizer")
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)


def _fix_pre_tokenizer(tokenizer, pre: str | None) -> None:
    """transformers has no split rule for llama.cpp's `smollm` pre-tokenizer and falls back to plain
    GPT-2 splitting; SmolLM's own tokenizer (and llama.cpp) split digits one by one first."""
    if pre != "smollm":
        return
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def write_generation_config(config: dict[str, Any], out_dir: Path) -> None:
    """`generation_config.json` with the special-token ids (greedy by default)."""
    payload = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    _write_json(out_dir / "generation_config.json", payload)


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer: bool = True) -> Path:
    """Convert `gguf_path` into an HF model directory at `out_dir` (created if needed); returns it.

    Writes config.json, generation_config.json, fp32 safetensors (sharded above `max_shard_bytes`)
    and, unless `tokenizer=False`, tokenizer.json + tokenizer_config.json.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = open_gguf(gguf_path)
    config = build_config(reader)
    write_weights(reader, config, out_dir, progress=progress, max_shard_bytes=max_shard_bytes)
    if tokenizer:
        write_tokenizer(gguf_path, out_dir, reader)
    write_generation_config(config, out_dir)
    _write_json(out_dir / "config.json", config)
    return out_dir


def iter_weight_files(model_dir: Path) -> Iterator[Path]:
    """The safetensors files a converted directory needs (from the index when sharded)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        for name in sorted(set(weight_map.values())):
            yield model_dir / name
    else:
        yield model_dir / SINGLE_FILE
