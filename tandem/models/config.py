"""ModelConfig: the decoder's shape, read from an HF-format config.json (Llama, Qwen2, Qwen3)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import ModelLoadError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", ...}; None = plain RoPE
    max_position: int = 2048  # the model's context length
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        arch = hf.get("model_type", "")
        if arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(f"unsupported model_type {arch!r} in config.json; supported: {', '.join(SUPPORTED_ARCHS)}")
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            rope = _rope_from_hf(hf)
            return cls(
                arch=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=rope[0],
                rope_scaling=rope[1],
                max_position=int(hf.get("max_position_embeddings", 2048)),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
                qk_norm=arch == "qwen3",
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=_as_tuple(hf.get("eos_token_id")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json is missing or has a bad field: {e}") from e

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        try:
            return cls.from_hf_dict(json.loads(path.read_text()))
        except OSError as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from e
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _rope_from_hf(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either the transformers-4 keys or transformers-5 `rope_parameters`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {}) or params
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise ModelLoadError(f"unsupported rope scaling {rope_type!r}; supported: default, linear, llama3")
    return theta, {k: v for k, v in scaling.items() if k != "rope_theta"} | {"rope_type": rope_type}
