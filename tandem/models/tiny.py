"""Seeded tiny random models of each supported architecture, written as HF-format directories.

Tests build them in about a second; they load both in our runtime and in HF transformers, which is
what the parity tests compare. The tokenizer is byte-level (256 byte tokens + chat specials).
"""
from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_hf_config(arch: str, vocab_size: int = 320, num_layers: int = 3, tie: bool | None = None, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
    )
    has_specials = vocab_size > 258  # the byte tokenizer's specials are ids 256..258
    common |= dict(bos_token_id=256, eos_token_id=258, pad_token_id=256) if has_specials else dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=True if tie is None else tie, rope_theta=10000.0)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=False if tie is None else tie, rope_theta=1e6)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True if tie is None else tie, rope_theta=1e6)
    else:
        raise ValueError(f"no tiny config for {arch!r}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, **kwargs) -> Path:
    """Write a random HF-format model (config.json, model.safetensors, tokenizer) and return its path."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, **kwargs)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # HF's init is too flat for greedy tests; make logits decisive
            p.normal_(0.0, 0.25 if p.dim() == 2 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    byte_tokenizer().save_pretrained(out_dir)
    return out_dir


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars, key=_byte_value))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def _byte_value(ch: str) -> int:
    """Order ByteLevel's printable stand-ins by the byte they encode, so token id == byte value."""
    return _bytes_to_unicode().index(ch)


def _bytes_to_unicode() -> list[str]:
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in visible:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars
