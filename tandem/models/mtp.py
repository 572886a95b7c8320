"""Medusa-style multi-token-prediction heads on the target's final hidden state.

Head i (0-based) reads the target's final hidden state h_t (after its final norm: what its LM head reads,
and which predicts x_{t+1}) and predicts x_{t+2+i}:

    logits_i = lm_head(h_t + silu(W_i h_t + b_i))        [d] -> [Vd]

The LM head is shared by the heads and covers the reduced draft vocabulary `draft_to_target` [Vd]
(initialised from the target's LM head rows). W_i starts at zero (Medusa's init: every head starts as
the target's own next-token prediction). Files: `model.safetensors` + `mtp_config.json`, with the same
schema-version and target-identity checks as EAGLE heads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tandem.errors import InvalidParameterError, ModelLoadError
from tandem.models.config import ModelConfig
from tandem.models.eagle import check_target, load_head, save_head_files, target_identity
from tandem.models.transformer import Transformer
from tandem.models.linear import Linear, pack_linears, unpack_linears

SCHEMA_VERSION = 1
CONFIG_FILE = "mtp_config.json"


@dataclass(frozen=True)
class MtpConfig:
    hidden_size: int  # the target's hidden size
    num_heads: int  # K: head i predicts the token i+2 positions after the hidden state's
    draft_vocab_size: int  # Vd: rows of the shared LM head
    target_vocab_size: int  # V
    target_id: str  # target_identity() of the target
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise InvalidParameterError(f"num_heads must be >= 1, got {self.num_heads}")
        if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            raise InvalidParameterError(f"draft_vocab_size must be in [1, {self.target_vocab_size}], got {self.draft_vocab_size}")

    @classmethod
    def for_target(cls, cfg: ModelConfig, num_heads: int, draft_vocab_size: int | None = None) -> "MtpConfig":
        return cls(cfg.hidden_size, num_heads, min(draft_vocab_size or cfg.vocab_size, cfg.vocab_size), cfg.vocab_size, target_identity(cfg))


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MtpHeads(nn.Module):
    def __init__(self, cfg: MtpConfig, draft_to_target: torch.Tensor):  # [Vd]
        super().__init__()
        if tuple(draft_to_target.shape) != (cfg.draft_vocab_size,):
            raise ModelLoadError(f"draft_to_target has shape {tuple(draft_to_target.shape)}, expected ({cfg.draft_vocab_size},)")
        self.cfg = cfg
        self.register_buffer("draft_to_target", draft_to_target.long().clone())  # [Vd]
        self.blocks = nn.ModuleList(ResBlock(cfg.hidden_size) for _ in range(cfg.num_heads))
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size)

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def pack(self) -> None:
        """Prepack the Linears for CPU inference; call again after the weights changed."""
        pack_linears(self, batch_hint=4)

    def unpack(self) -> None:
        unpack_linears(self)

    def forward(self, final_hidden: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., K, Vd]
        h = final_hidden.to(self.lm_head.weight.dtype)
        return self.lm_head(torch.stack([block(h) for block in self.blocks], dim=-2))


def new_mtp_heads(target: Transformer, cfg: MtpConfig, draft_to_target: torch.Tensor) -> MtpHeads:
    """Untrained heads: zero residual branches, the LM head copied from the target's rows."""
    check_target(cfg.target_id, cfg.target_vocab_size, target.cfg)
    if cfg.hidden_size != target.cfg.hidden_size:
        raise InvalidParameterError(f"hidden_size {cfg.hidden_size} differs from the target's {target.cfg.hidden_size}")
    heads = MtpHeads(cfg, draft_to_target)
    with torch.no_grad():
        for block in heads.blocks:
            block.linear.weight.zero_()
            block.linear.bias.zero_()
        heads.lm_head.weight.copy_(target.lm_head.weight.detach().float()[heads.draft_to_target])
    return heads


def save_mtp(heads: MtpHeads, out_dir: str | Path) -> Path:
    return save_head_files(out_dir, heads, CONFIG_FILE, dataclasses.asdict(heads.cfg))


def load_mtp(path: str | Path, target: Transformer) -> MtpHeads:
    return load_head(path, target, MtpConfig, CONFIG_FILE, SCHEMA_VERSION, MtpHeads)
