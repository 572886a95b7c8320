"""An EAGLE-3-style draft head: one decoder layer over fused target features, with a reduced vocabulary.

Shapes and the one-step shift (positions are sequence positions; x_t is token t, f_t the target feature
at position t, i.e. what the target computed after reading x_0..x_t):

    fused f_t      = fc([h_low_t; h_mid_t; h_high_t])                          [3 d_target] -> [d]
    layer input t  = [input_norm(embed(x_{t+1})); hidden_norm(f_t)]            [2d]
    h_t            = f_t + attn(input) ; h_t += mlp(mlp_norm(h_t))            [d]
    logits_t       = lm_head(norm(h_t)) over the draft vocabulary              predicts x_{t+2}

Draft-cache entry j holds (f_j, x_{j+1}) at RoPE position j. After the target committed n tokens and the
pending token x_n was emitted, entry n-1 predicts the first draft token; a draft node at depth d sits at
position n + d and is fed its parent's output h instead of a target feature (the "training-time test":
`tandem.models.eagle_train.unroll_states` trains exactly that).

The token embedding is the target's (shared, frozen, never saved); the LM head covers only
`draft_to_target` [Vd], the most frequent target tokens in observed traffic, initialised from the
target's LM head rows. Files: `model.safetensors` + `eagle_config.json` (schema version and the target's
identity: loading a head for another target raises ModelLoadError).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tandem.errors import InvalidParameterError, ModelLoadError
from tandem.models import cpu_gemm, decode_glue
from tandem.models.config import ModelConfig
from tandem.models.head_state import derived_keys
from tandem.models.kv_cache import AttentionBatch, KVCache, build_attention_batch
from tandem.models.transformer import MLP, RMSNorm, Transformer, apply_rope, rope_inv_freq
from tandem.models.linear import Linear, pack_linears, unpack_linears

SCHEMA_VERSION = 1
CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "model.safetensors"


def target_identity(cfg: ModelConfig) -> str:
    """A string naming the target a head was trained for: shape plus a hash of its whole config."""
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode()).hexdigest()[:12]
    return f"{cfg.arch}-L{cfg.num_layers}-d{cfg.hidden_size}-V{cfg.vocab_size}-{digest}"


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """(low, mid, high) target layers as in EAGLE-3: (2, L//2, L-3), squeezed into shallow models."""
    if num_layers >= 6:
        return 2, num_layers // 2, num_layers - 3
    if num_layers < 3:
        raise InvalidParameterError(f"EAGLE taps 3 distinct layers; the target has {num_layers}")
    return 0, num_layers // 2, num_layers - 1


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int  # width of the draft layer (= the target's: the embedding is shared)
    target_hidden: int  # width of each tapped target hidden state
    num_heads: int  # attention heads of the draft layer
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int
    intermediate_size: int  # MLP width of the draft layer
    taps: tuple[int, int, int]  # (low, mid, high) target layers whose outputs are fused
    draft_vocab_size: int  # Vd: rows of the draft LM head
    target_vocab_size: int  # V: the target's vocabulary (draft_to_target indexes it)
    target_id: str  # target_identity() of the target this head drafts for
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    schema_version: int = SCHEMA_VERSION
    shared_lm_head: bool = False  # LM head rows are the target's own (frozen, rebuilt from the target at load, never saved)

    def __post_init__(self) -> None:
        object.__setattr__(self, "taps", tuple(int(t) for t in self.taps))
        if len(self.taps) != 3 or list(self.taps) != sorted(set(self.taps)):
            raise InvalidParameterError(f"taps must be 3 increasing layer indices, got {self.taps}")
        if self.hidden_size != self.target_hidden:
            raise InvalidParameterError("the draft layer shares the target's embedding, so hidden_size must equal target_hidden")
        if self.num_heads % self.num_kv_heads:
            raise InvalidParameterError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            raise InvalidParameterError(f"draft_vocab_size must be in [1, {self.target_vocab_size}], got {self.draft_vocab_size}")

    @classmethod
    def for_target(cls, cfg: ModelConfig, draft_vocab_size: int | None = None, taps: tuple[int, int, int] | None = None, shared_lm_head: bool = False,
                   intermediate_size: int | None = None) -> "EagleConfig":
        """A head shaped like one layer of the target (EAGLE-3's choice), its MLP `intermediate_size` wide if given."""
        return cls(
            hidden_size=cfg.hidden_size, target_hidden=cfg.hidden_size, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate_size=intermediate_size or cfg.intermediate_size,
            taps=taps or default_taps(cfg.num_layers), draft_vocab_size=min(draft_vocab_size or cfg.vocab_size, cfg.vocab_size),
            target_vocab_size=cfg.vocab_size, target_id=target_identity(cfg), rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta, shared_lm_head=shared_lm_head,
        )

    def layer_config(self) -> ModelConfig:
        """The draft layer as a one-layer Llama config (for its KV cache, MLP and RoPE)."""
        return ModelConfig(
            arch="llama", vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
        )


# ---- the reduced draft vocabulary ---------------------------------------------------------------------
def draft_vocab_from_tokens(token_lists: Iterable[Iterable[int]], size: int, target_vocab: int) -> torch.Tensor:  # [size] long
    """The `size` most frequent target tokens in observed traffic, most frequent first.

    Ties and the tail (when fewer distinct tokens were seen) go to the lowest ids: BPE gives low ids to
    its earliest, most frequent merges.
    """
    if not 1 <= size <= target_vocab:
        raise InvalidParameterError(f"draft vocabulary size must be in [1, {target_vocab}], got {size}")
    counts = Counter(t for ids in token_lists for t in ids)
    seen = sorted((t for t in counts if 0 <= t < target_vocab), key=lambda t: (-counts[t], t))[:size]
    chosen = set(seen)
    tail = (t for t in range(target_vocab) if t not in chosen)
    return torch.tensor(seen + [next(tail) for _ in range(size - len(seen))], dtype=torch.long)


def target_to_draft(draft_to_target: torch.Tensor, target_vocab: int) -> torch.Tensor:  # [V] long, -1 = not drafted
    out = torch.full((target_vocab,), -1, dtype=torch.long)
    out[draft_to_target] = torch.arange(draft_to_target.numel())
    return out


def expand_to_target(
    draft_probs: torch.Tensor,  # [N, Vd]
    draft_to_target: torch.Tensor,  # [Vd] long
    target_vocab: int,
) -> torch.Tensor:  # [N, V]: zeros outside the draft vocabulary
    out = draft_probs.new_zeros(draft_probs.shape[0], target_vocab)
    return out.index_copy_(1, draft_to_target.to(draft_probs.device), draft_probs)


# ---- attention over a draft tree kept in the cache --------------------------------------------------------
def tree_cache_mask(
    prefix_lens: torch.Tensor,  # [B] committed draft-cache entries per row (visible to every node)
    ancestors: torch.Tensor,  # [B, M, M] bool: node i sees node j (itself and its ancestors); M nodes after the prefix
    num_query: int,  # the last num_query nodes are this forward's queries
) -> torch.Tensor:  # [B, 1, T, S] bool, S = max(prefix) + M
    batch, m = ancestors.shape[0], ancestors.shape[1]
    total = int(prefix_lens.max()) + m
    key = torch.arange(total).view(1, 1, total)
    start = prefix_lens.view(batch, 1, 1)
    rel = key - start  # [B, 1, S] index of a key among the tree nodes
    in_tree = (rel >= 0) & (rel < m)
    queries = ancestors[:, m - num_query :].to(torch.bool).cpu()  # [B, T, M]
    seen = torch.gather(queries, 2, rel.clamp(0, m - 1).expand(batch, num_query, total))  # [B, T, S]
    return ((key < start) | (in_tree & seen)).unsqueeze(1)


# ---- modules ----------------------------------------------------------------------------------------------
class EagleAttention(nn.Module):
    """Llama attention whose q/k/v read the 2d-wide [embedding; feature] input."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = Linear(2 * cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size)
        self.o = Linear(cfg.q_size, cfg.hidden_size)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # x [B, T, 2d] -> q, k, v [B, T, heads, D]
        cfg = self.cfg
        b, t, _ = x.shape
        qk, v = self.qkv(x).split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
        qk = apply_rope(qk.view(b, t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=2)
        return q, k, v.view(b, t, cfg.num_kv_heads, cfg.head_dim)

    def attend(
        self,
        q: torch.Tensor,  # [B, T, H, D]
        keys: torch.Tensor,  # [B, Hkv, S, D]
        values: torch.Tensor,  # [B, Hkv, S, D]
        mask: torch.Tensor | None,  # [B or 1, 1, T, S] bool
        is_causal: bool,
    ) -> torch.Tensor:  # [B, T, d]
        return self.o(self.mix(q, keys, values, mask, is_causal))

    def mix(self, q, keys, values, mask, is_causal) -> torch.Tensor:  # `attend` before its output projection: [B, T, q_size]
        b, t = q.shape[:2]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=is_causal,
            enable_gqa=self.cfg.num_heads != self.cfg.num_kv_heads,
        )
        return out.transpose(1, 2).reshape(b, t, self.cfg.q_size)

    def forward(self, x, cos, sin, cache: KVCache | None, batch: AttentionBatch) -> torch.Tensor:  # [B, T, d]
        q, k, v = self.project(x, cos, sin)
        keys, values = _cache_keys_values(cache, k, v, batch)
        return self.attend(q, keys, values, batch.mask, batch.is_causal)


def _cache_keys_values(cache: KVCache | None, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch):  # -> [B, Hkv, S, D] x2
    """Write this forward's k, v [B, T, Hkv, D] into the one-layer cache and read back the visible keys."""
    if cache is None:
        return k.transpose(1, 2), v.transpose(1, 2)
    layer_k, layer_v = cache.k[0, batch.rows], cache.v[0, batch.rows]
    rows = torch.arange(k.shape[0]).unsqueeze(1).expand_as(batch.write_slots)
    layer_k[rows, :, batch.write_slots] = k
    layer_v[rows, :, batch.write_slots] = v
    return layer_k[:, :, : batch.total_len], layer_v[:, :, : batch.total_len]


class EagleHead(nn.Module):
    def __init__(self, cfg: EagleConfig, target_embed: torch.Tensor, draft_to_target: torch.Tensor, target_lm_head: torch.Tensor | None = None):  # [V, d], [Vd], [V, d]
        super().__init__()
        if tuple(target_embed.shape) != (cfg.target_vocab_size, cfg.hidden_size):
            raise ModelLoadError(f"target embedding {tuple(target_embed.shape)} does not fit the head's config")
        if tuple(draft_to_target.shape) != (cfg.draft_vocab_size,):
            raise ModelLoadError(f"draft_to_target has shape {tuple(draft_to_target.shape)}, expected ({cfg.draft_vocab_size},)")
        self.cfg = cfg
        layer = cfg.layer_config()
        self.register_buffer("embed_weight", target_embed.detach(), persistent=False)  # shared with the target, frozen
        self.register_buffer("draft_to_target", draft_to_target.long().clone())  # [Vd]
        self.fc = Linear(3 * cfg.target_hidden, cfg.hidden_size)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = EagleAttention(layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(layer)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size)
        if cfg.shared_lm_head:
            self._share_lm_head(target_lm_head)
        self.register_buffer("inv_freq", rope_inv_freq(layer), persistent=False)
        self.fused_glue = True  # cached chain steps and catch-ups run decode_glue's fused ops where they apply

    def _share_lm_head(self, target_lm_head: torch.Tensor | None) -> None:
        """The LM head holds the target's rows of the draft vocabulary, frozen (requires_grad False: no
        optimiser touches it); it stays in state_dict so copies carry it, and is left out of saved files
        (load rebuilds it from the target) and of published weight versions (tandem.models.head_state)."""
        if target_lm_head is None or tuple(target_lm_head.shape) != (self.cfg.target_vocab_size, self.cfg.hidden_size):
            raise ModelLoadError("a head with shared_lm_head needs the target's LM head weight [V, d]")
        with torch.no_grad():
            self.lm_head.weight.copy_(target_lm_head.detach().float()[self.draft_to_target])
        self.lm_head.weight.requires_grad_(False)

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def pack(self, int8: bool = True) -> None:
        """Set the Linears up for CPU inference; call again after the weights changed.

        Every Linear goes int8 where the CPU kernels run (cpu_gemm.small_gemm_q8: int8 rows, int8 activations): a
        drafter need not be exact (it reports what it drew from), and a draft step reads a quarter of the bytes. The LM head
        alone (16k x 576, ~70 % of the fp32 bytes) made a step ~2x cheaper for about the same acceptance
        (docs/BENCHMARKS.md 3.2); the layer's Linears too: the same greedy acceptance on the peer prompts, ~20 %
        less drafting time (BENCHMARKS 1.6). `int8=False` keeps fp32 (the small-M kernel or oneDNN)."""
        int8_here = int8 and cpu_gemm.available() and self.fc.weight.device.type == "cpu"
        pack_linears(self, batch_hint=4, gemm="int8" if int8_here else "auto")

    def unpack(self) -> None:
        unpack_linears(self)

    def fuse(self, taps: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:  # 3 x [..., d_t] -> [..., d]
        return self.fc(torch.cat([t.to(self.fc.weight.dtype) for t in taps], dim=-1))

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] target token ids x_{t+1}
        features: torch.Tensor,  # [B, T, d] fused target features f_t, or the head's own output h for draft nodes
        positions: torch.Tensor | None = None,  # [B, T]; default: cache length + arange(T)
        cache: KVCache | None = None,
        rows: slice | None = None,
        tree_mask: torch.Tensor | None = None,  # [B, T, T] among the new entries (cached entries all visible)
        cache_mask: torch.Tensor | None = None,  # [B, 1, T, S] over the whole cache (draft trees); overrides tree_mask
        logits_at: torch.Tensor | None = None,  # [B] long: the one position per row whose logits are wanted; None = all
        project: bool = True,  # False: no logits (None), the hidden states only (a caller projecting selected rows itself)
    ) -> tuple[torch.Tensor | None, torch.Tensor]:  # logits [B, T, Vd] (or [B, 1, Vd] with logits_at), hidden [B, T, d]
        b, t = input_ids.shape
        batch = build_attention_batch(cache, rows, t, tree_mask, b, input_ids.device)
        if cache_mask is not None:
            batch = dataclasses.replace(batch, mask=cache_mask.to(input_ids.device), is_causal=False)
        cos, sin = self.rope(batch.write_slots.to(input_ids.device) if positions is None else positions)
        fused = cache_mask is None and decode_glue.applies(features, cache, self.fused_glue and decode_glue.enabled() and decode_glue.supports(self.attn.cfg))
        if fused:
            hidden = self.forward_fused(input_ids, features, cos, sin, cache, batch)
        else:
            hidden = self.residual(features, self.attn(self.layer_input(input_ids, features), cos, sin, cache, batch))
        if cache is not None:
            cache.lengths[batch.rows] += t
        if not project:
            return None, hidden
        read = hidden if logits_at is None else hidden[torch.arange(b), logits_at.to(hidden.device)].unsqueeze(1)
        normed = decode_glue.rms_norm(read, self.norm.weight, self.norm.eps) if fused else self.norm(read)
        return self.lm_head(normed), hidden

    def forward_fused(self, input_ids, features, cos, sin, cache: KVCache, batch: AttentionBatch) -> torch.Tensor:  # -> hidden [B, T, d]
        """The layer of forward() through decode_glue's fused ops (a cached chain step or catch-up: causal over
        the draft cache, fp32 CPU inference): the same computation as layer_input + attn + residual."""
        cfg = self.attn.cfg
        embeds = F.embedding(input_ids, self.embed_weight).to(features.dtype)
        x = torch.cat([decode_glue.rms_norm(embeds, self.input_norm.weight, self.input_norm.eps),
                       decode_glue.rms_norm(features, self.hidden_norm.weight, self.hidden_norm.eps)], dim=-1)
        attended = decode_glue.attend_cached(self.attn.qkv(x), cos, sin, None, None, cfg.rms_norm_eps, cache.k, cache.v, 0,
                                             batch.rows.start or 0, batch.starts, batch.tree, cfg.num_heads, cfg.num_kv_heads)
        hidden, h = decode_glue.add_rms_norm(self.attn.o(attended), features, self.mlp_norm.weight, self.mlp_norm.eps)
        return hidden + self.mlp.down(decode_glue.silu_mul(self.mlp.gate_up(h)))

    def layer_input(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:  # -> [B, T, 2d]
        embeds = F.embedding(input_ids, self.embed_weight).to(features.dtype)
        return torch.cat([self.input_norm(embeds), self.hidden_norm(features)], dim=-1)

    def residual(self, features: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:  # -> [B, T, d]
        hidden = features + attn_out
        return hidden + self.mlp(self.mlp_norm(hidden))

    def rope(self, positions: torch.Tensor):  # [B, T] -> cos, sin_signed [B, T, 1, head_dim]
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), -1).unsqueeze(2), torch.cat((-sin, sin), -1).unsqueeze(2)


def new_eagle_head(target: Transformer, cfg: EagleConfig, draft_to_target: torch.Tensor, generator: torch.Generator | None = None) -> EagleHead:
    """An untrained head for `target`: LM head rows and final norm copied from the target, fc passing the
    high tap through, the rest small random (std 0.02)."""
    check_target(cfg.target_id, cfg.target_vocab_size, target.cfg)
    head = EagleHead(cfg, target.embed.weight, draft_to_target, target.lm_head.weight)
    with torch.no_grad():
        for lin in head.linears():
            lin.weight.normal_(0.0, 0.02, generator=generator)
        d = cfg.hidden_size
        head.fc.weight[:, 2 * d :] += torch.eye(d)
        head.lm_head.weight.copy_(target.lm_head.weight.detach().float()[head.draft_to_target])
        head.norm.weight.copy_(target.norm.weight.detach().float())
    return head


# ---- files --------------------------------------------------------------------------------------------------
def save_head_files(out_dir: str | Path, module: nn.Module, config_file: str, config: dict, derived: tuple[str, ...] = ()) -> Path:
    """Write `model.safetensors` (persistent state only: never the shared target embedding, nor the
    `derived` entries that load rebuilds from the target) + a config JSON."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items() if k not in derived}
    save_file(state, str(out_dir / WEIGHTS_FILE))
    (out_dir / config_file).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def read_head_files(path: str | Path, config_file: str, schema_version: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, tensors) of a saved head; ModelLoadError on anything missing, corrupt or of another schema."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        config = json.loads((path / config_file).read_text())
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"cannot read a drafter head from {path}: {e}") from e
    if config.get("schema_version") != schema_version:
        raise ModelLoadError(f"{path / config_file} has schema version {config.get('schema_version')}, expected {schema_version}")
    return config, tensors


def check_target(target_id: str, target_vocab: int, cfg: ModelConfig) -> None:
    if target_id != target_identity(cfg) or target_vocab != cfg.vocab_size:
        raise ModelLoadError(f"this head was trained for target {target_id!r}; the target is {target_identity(cfg)!r}")


def save_eagle(head: EagleHead, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Save a head; `dtype=torch.float16` halves the file (loading casts back to fp32)."""
    if dtype is None:
        return save_head_files(out_dir, head, CONFIG_FILE, dataclasses.asdict(head.cfg), derived_keys(head.cfg))
    return save_head_files(out_dir, copy_head(head).to(dtype), CONFIG_FILE, dataclasses.asdict(head.cfg), derived_keys(head.cfg))


def copy_head(head: EagleHead) -> EagleHead:
    """An independent copy (own parameters and buffers; the target embedding stays shared)."""
    copy = EagleHead(head.cfg, head.embed_weight, head.draft_to_target.clone(), _full_lm_head(head))
    copy.load_state_dict(head.state_dict())
    return copy


def resize_draft_vocab(head: EagleHead, size: int, target_lm_head: torch.Tensor) -> EagleHead:  # target_lm_head [V, d]
    """The same trained head over another draft vocabulary: the first `size` tokens of its own (most frequent
    first), or all of them followed by the remaining target ids (lowest first) when `size` is larger.

    Only a head whose LM head is the target's frozen rows (`shared_lm_head`) can be resized: its trained
    weights do not depend on the vocabulary, which only chooses the rows the draft softmax runs over."""
    if not head.cfg.shared_lm_head:
        raise InvalidParameterError("only a head with a shared (target) LM head can change its draft vocabulary")
    if not 1 <= size <= head.cfg.target_vocab_size:
        raise InvalidParameterError(f"draft vocabulary size must be in [1, {head.cfg.target_vocab_size}], got {size}")
    own = head.draft_to_target.cpu()
    chosen = torch.zeros(head.cfg.target_vocab_size, dtype=torch.bool)
    chosen[own] = True
    vocab = torch.cat([own, torch.nonzero(~chosen).flatten()])[:size]
    resized = EagleHead(dataclasses.replace(head.cfg, draft_vocab_size=size), head.embed_weight, vocab, target_lm_head)
    trained = {k: v for k, v in head.state_dict().items() if k not in ("draft_to_target", "lm_head.weight")}
    resized.load_state_dict(resized.state_dict() | trained)  # strict: every trained weight has its place
    return resized.train(head.training)


def _full_lm_head(head: EagleHead) -> torch.Tensor | None:  # [V, d] with the draft rows in place (enough to rebuild a shared head)
    if not head.cfg.shared_lm_head:
        return None
    full = head.lm_head.weight.new_zeros(head.cfg.target_vocab_size, head.cfg.hidden_size)
    return full.index_copy_(0, head.draft_to_target, head.lm_head.weight)


def load_head(path: str | Path, target: Transformer, config_cls, config_file: str, schema_version: int, build) -> nn.Module:
    """Read a saved head, check it belongs to `target`, and build it with `build(cfg, draft_to_target)`.

    Entries the config marks as derived from the target (a shared LM head) are taken from the built module."""
    path = Path(path)
    config, tensors = read_head_files(path, config_file, schema_version)
    try:
        cfg = config_cls(**config)
    except (TypeError, InvalidParameterError) as e:
        raise ModelLoadError(f"bad {config_file} in {path}: {e}") from e
    check_target(cfg.target_id, cfg.target_vocab_size, target.cfg)
    if "draft_to_target" not in tensors:
        raise ModelLoadError(f"{path / WEIGHTS_FILE} lacks draft_to_target")
    module = build(cfg, tensors["draft_to_target"])
    own = module.state_dict()
    tensors = {k: v.to(own[k].dtype) if k in own and v.is_floating_point() else v for k, v in tensors.items()}
    tensors |= {k: own[k] for k in derived_keys(cfg)}
    try:
        module.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise ModelLoadError(f"{path / WEIGHTS_FILE} does not match {config_file}: {e}") from e
    return module.eval()


def load_eagle(path: str | Path, target: Transformer) -> EagleHead:
    build = lambda cfg, draft_to_target: EagleHead(cfg, target.embed.weight, draft_to_target, target.lm_head.weight)  # noqa: E731
    return load_head(path, target, EagleConfig, CONFIG_FILE, SCHEMA_VERSION, build)


# ---- heads shipped with the package (tandem/heads/NAME: fp16 weights, config, recipe card) --------------------
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "heads"
CARD_FILE = "recipe.json"


def shipped_eagle_path(cfg: ModelConfig) -> Path | None:
    """The shipped head trained for this target, checksum-verified; None when no shipped head fits it. A head
    whose card says `"default_drafter": false` (a baseline such as the general head) is never picked."""
    for path in sorted(SHIPPED_DIR.glob("*/" + CONFIG_FILE)):
        head_dir = path.parent
        try:
            config = json.loads(path.read_text())
            card = json.loads((head_dir / CARD_FILE).read_text()) if (head_dir / CARD_FILE).is_file() else {}
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"unreadable shipped head config or card in {head_dir}: {e}") from e
        if config.get("target_id") == target_identity(cfg) and card.get("default_drafter", True):
            verify_card(head_dir)
            return head_dir
    return None


def verify_card(head_dir: Path) -> None:
    """The weights file must match the sha256 its recipe card records (a truncated or edited file is refused)."""
    try:
        card = json.loads((head_dir / CARD_FILE).read_text())
        digest = hashlib.sha256((head_dir / WEIGHTS_FILE).read_bytes()).hexdigest()
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"shipped head {head_dir} lacks a readable {CARD_FILE} or weights: {e}") from e
    if card.get("sha256") != digest:
        raise ModelLoadError(f"shipped head {head_dir}: weights sha256 {digest[:12]}... does not match its card ({str(card.get('sha256'))[:12]}...)")
