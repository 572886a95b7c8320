"""A compact decoder for the Llama, Qwen2 and Qwen3 families (no transformers in the forward path).

What speculative decoding needs from the target: a forward over several new tokens per sequence at
explicit positions, an optional tree attention mask (a whole draft tree verified in one pass), a KV
cache shared by a ragged batch, and the hidden states of chosen layers (EAGLE-3 taps).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.errors import InvalidParameterError
from tandem.models import cpu_gemm, decode_glue
from tandem.models.config import ModelConfig
from tandem.models.kv_cache import AttentionBatch, KVCache, build_attention_batch, packed_attention_batch, ragged_attention_batch
from tandem.models.linear import Linear, pack_linears, unpack_linears
from tandem.models.memory import release_freed_memory


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # a no-op for fp32; torch's F.rms_norm measured ~2x slower here
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:  # [head_dim / 2]
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        return inv_freq / float(scaling["factor"])
    if scaling.get("rope_type") == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths divided by factor, short kept, smooth between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(
    x: torch.Tensor,  # [B, T, heads, head_dim]
    cos: torch.Tensor,  # [B, T, 1, head_dim]
    sin_signed: torch.Tensor,  # [B, T, 1, head_dim]: sin with the first half negated
) -> torch.Tensor:
    """x*cos + rotate_half(x)*sin, where rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1.., +1..]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def _contiguous_rows(x: torch.Tensor) -> torch.Tensor:  # [..., n, D]: each row of D contiguous (a cache slice is), else a copy
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.qkv = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o = Linear(cfg.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, T, 1, head_dim]
        sin: torch.Tensor,  # [B, T, 1, head_dim]
        cache: KVCache | None,
        batch: AttentionBatch,
    ) -> torch.Tensor:  # [B, T, hidden]
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x, cos, sin)
        if batch.segments:
            return self.o(self._attend_segments(q, k, v, cache, batch.segments, self._sdpa_causal))
        keys, values = self._keys_values(k, v, cache, batch)  # [B, Hkv, S, D]
        q, gqa = q.transpose(1, 2), cfg.num_heads != cfg.num_kv_heads
        parts = []
        for first, end, keys_needed in batch.groups():  # one group unless the batch is large and ragged
            mask = batch.mask[first:end, :, :, :keys_needed] if batch.mask is not None else None
            parts.append(F.scaled_dot_product_attention(
                q[first:end], keys[first:end, :, :keys_needed], values[first:end, :, :keys_needed], attn_mask=mask,
                is_causal=batch.is_causal, enable_gqa=gqa,
            ))  # [b, H, T, D]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o(out.transpose(1, 2).reshape(b, t, cfg.q_size))

    def forward_prefill(self, x, cos, sin, cache: KVCache | None, batch: AttentionBatch) -> torch.Tensor:  # [1, T, hidden]
        """forward() for a prefill on the CPU kernels (Block.forward_prefill): each fresh prompt's causal attention, alone
        or in a packed prefill, runs cpu_gemm.prefill_attention instead of SDPA (2.3-2.9x faster at 40-400 tokens,
        docs/BENCHMARKS.md 1.12); anything else (a cached prefix, a ragged batch) goes through forward()."""
        b, t, _ = x.shape
        if not batch.segments and not (b == 1 and batch.mask is None and batch.is_causal and batch.total_len == t):
            return self.forward(x, cos, sin, cache, batch)
        q, k, v = self.project_qkv(x, cos, sin)
        if batch.segments:
            return self.o(self._attend_segments(q, k, v, cache, batch.segments, self._prefill_kernel))
        keys, values = self._keys_values(k, v, cache, batch)  # [1, Hkv, T, D]
        return self.o(self._prefill_kernel(q[0], keys[0], values[0]).view(1, t, self.cfg.q_size))

    def _prefill_kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # q [n, H, D], k, v [Hkv, n, D] -> [n, H D]
        return cpu_gemm.prefill_attention(q, _contiguous_rows(k), _contiguous_rows(v), self.cfg.head_dim ** -0.5)

    def _sdpa_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # the same contract, on SDPA
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True,
                                             enable_gqa=self.cfg.num_heads != self.cfg.num_kv_heads)  # [1, H, n, D]
        return out[0].transpose(0, 1).reshape(q.shape[0], self.cfg.q_size)

    def _attend_segments(self, q, k, v, cache: KVCache, segments, attend) -> torch.Tensor:  # q [1, N, H, D], k, v [1, N, Hkv, D] -> [1, N, H D]
        """A packed prefill's attention: each prompt's keys and values written into its own cache row, read back and
        attended causally (`attend`: SDPA, or the prefill kernel), as that prompt's own forward does (the same tensors,
        so the same bits)."""
        parts = []
        for offset, n, row in segments:
            one = slice(offset, offset + n)
            layer_k, layer_v = cache.k[self.layer, row], cache.v[self.layer, row]  # [Hkv, Smax, D]
            layer_k[:, :n] = k[0, one].transpose(0, 1)
            layer_v[:, :n] = v[0, one].transpose(0, 1)
            parts.append(attend(q[0, one], layer_k[:, :n], layer_v[:, :n]))
        return torch.cat(parts).unsqueeze(0)

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, batch: AttentionBatch) -> torch.Tensor:
        """forward() through decode_glue.attend_cached: q/k norm, RoPE, cache write and attention in one op."""
        cfg = self.cfg
        qn, kn = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        out = decode_glue.attend_cached(
            self.qkv(x), cos, sin, qn, kn, cfg.rms_norm_eps, cache.k, cache.v, self.layer, batch.rows.start or 0,
            batch.starts, batch.tree, cfg.num_heads, cfg.num_kv_heads, batch.lengths,
        )  # [B, T, H D] (ragged: [N, 1, H D])
        return self.o(out)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, T, H, D], k and v [B, T, Hkv, D]: projected, (q/k-normed,) rotated."""
        cfg = self.cfg
        b, t, _ = x.shape
        heads = cfg.num_heads + cfg.num_kv_heads
        qk, v = self.qkv(x).split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
        qk = qk.view(b, t, heads, cfg.head_dim)
        v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        q, k = apply_rope(qk, cos, sin).split([cfg.num_heads, cfg.num_kv_heads], dim=2)  # rope on q and k at once
        return q, k, v

    def _keys_values(self, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None, batch: AttentionBatch):
        if cache is None:
            return k.transpose(1, 2), v.transpose(1, 2)
        layer_k, layer_v = cache.k[self.layer, batch.rows], cache.v[self.layer, batch.rows]  # [B, H, Smax, D]
        start = batch.uniform_start
        if start is not None:
            t = k.shape[1]
            layer_k[:, :, start : start + t] = k.transpose(1, 2)
            layer_v[:, :, start : start + t] = v.transpose(1, 2)
        else:
            rows = torch.arange(k.shape[0]).unsqueeze(1).expand_as(batch.write_slots)
            layer_k[rows, :, batch.write_slots] = k
            layer_v[rows, :, batch.write_slots] = v
        return layer_k[:, :, : batch.total_len], layer_v[:, :, : batch.total_len]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, batch):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, batch)
        return x + self.mlp(self.mlp_norm(x))

    def forward_prefill(self, x, cos, sin, cache: KVCache | None, batch: AttentionBatch):
        """forward() with decode_glue's norm / residual ops, the prefill attention kernel for a fresh prompt (else SDPA)
        and the SiLU in the gate/up GEMM: a prefill of more than decode_glue.MAX_NEW_TOKENS (32) tokens per row, fp32
        CPU inference."""
        h = decode_glue.rms_norm(x, self.attn_norm.weight, self.attn_norm.eps)
        x, h = decode_glue.add_rms_norm(self.attn.forward_prefill(h, cos, sin, cache, batch), x, self.mlp_norm.weight, self.mlp_norm.eps)
        return x + self.mlp.down(self.mlp.gate_up.silu_gated(h))

    def forward_fused(self, x, cos, sin, cache: KVCache, batch: AttentionBatch):
        """forward() with the glue as decode_glue's fused ops (a cached decode / verify step, fp32 CPU inference)."""
        h = decode_glue.rms_norm(x, self.attn_norm.weight, self.attn_norm.eps)
        x, h = decode_glue.add_rms_norm(self.attn.forward_fused(h, cos, sin, cache, batch), x, self.mlp_norm.weight, self.mlp_norm.eps)
        return x + self.mlp.down(decode_glue.silu_mul(self.mlp.gate_up(h)))


def packable(prompt_tokens: int) -> bool:
    """Whether a prompt may join a packed prefill (Transformer.forward_packed): only prefill-shaped prompts, whose own
    prefill runs the same path, so packing changes none of their bits."""
    return prompt_tokens > decode_glue.MAX_NEW_TOKENS


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, T, V] (or [B, 1, V] with last_only; None when the forward was asked for none)
    hidden: tuple[torch.Tensor, ...]  # one [B, T, hidden] per requested tap (output of that layer)
    final_hidden: torch.Tensor  # [B, T, hidden] after the final norm (what the LM head reads)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.lm_head._restore_weight(self.embed.weight)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.fused_glue = True  # cached decode / verify steps run decode_glue's fused ops where they apply
        self.fused_stack = True  # ... and all layers in one decode_glue.decode_layers call where that applies

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def pack(self, batch_hint: int = 8, keep_dense: bool = False, gemm: str = "auto") -> None:
        """Set every Linear up for CPU inference with one copy of each weight (see Linear): the small-M
        kernel on the dense weights, or oneDNN copies that replace them.

        Reads of `.weight` / `state_dict()` still work (fresh dense copies); to change weights in place,
        `unpack()` (restores the dense Parameters exactly), write, `pack()` again. gemm="int8" serves
        int8 copies instead (int8 activations too), "int4" / "bf16" group-wise int4 / bf16 ones (each another model than the fp32 one;
        the user's choice, never a default)."""
        pack_linears(self, batch_hint, keep_dense, gemm)
        if self.cfg.tie_embeddings and self.lm_head.dense_dropped:  # the embedding still holds it: keep them tied
            self.lm_head._restore_weight(self.embed.weight)
        release_freed_memory()  # the dropped dense copies

    def unpack(self) -> None:
        unpack_linears(self)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor | None = None,  # [B, T]; default: cache length + arange(T)
        cache: KVCache | None = None,
        rows: slice | None = None,  # cache rows of this batch; default 0..B-1
        tree_mask: torch.Tensor | None = None,  # [B, T, T] bool; default causal among new tokens
        taps: tuple[int, ...] = (),  # layers whose output hidden states to return
        last_only: bool = False,  # logits for the last position only (prefill)
        logits: bool = True,  # False: no LM head (logits None; a trainer applies it where it needs it)
    ) -> ForwardOutput:
        b, t = input_ids.shape
        batch = build_attention_batch(cache, rows, t, tree_mask, b, input_ids.device)
        if positions is None:
            positions = batch.write_slots.to(input_ids.device)
        out = self.forward_batch(input_ids, positions, cache, batch, taps, last_only, logits=logits)
        if cache is not None:
            cache.lengths[batch.rows] += t
        return out

    def forward_packed(self, prompts: list[list[int]], cache: KVCache, rows: list[int], taps: tuple[int, ...] = ()) -> list[ForwardOutput]:
        """Prefill several prompts in one forward, packed as one row of tokens (no padding): the GEMMs run over all
        their tokens at once (the wide kernel: ~1.17x more FLOP/s over 15 x 137 tokens than 137 at a time), each
        prompt attends within itself and fills its own cache row (rows[i], from slot 0). Every prompt must be
        prefill-shaped (> decode_glue.MAX_NEW_TOKENS tokens): then each output is what the prompt's own forward
        gives, bit for bit, where the CPU kernels run (they are row-invariant); otherwise within fp32 rounding.
        Returns per prompt its ForwardOutput (last-position logits, taps and final hidden states of its tokens)."""
        lengths = [len(p) for p in prompts]
        if len(rows) != len(prompts) or not lengths or not all(packable(n) for n in lengths):
            raise InvalidParameterError(f"forward_packed: one cache row per prompt, each prompt > {decode_glue.MAX_NEW_TOKENS} tokens")
        device = cache.k.device
        batch = packed_attention_batch(cache, lengths, rows)
        ids = torch.tensor([[t for p in prompts for t in p]], device=device)
        ends = torch.tensor([o + n - 1 for o, n, _ in batch.segments])
        out = self.forward_batch(ids, batch.write_slots.to(device), cache, batch, taps, last_positions=ends)
        for row, n in zip(rows, lengths):
            cache.lengths[row] = n
        return [ForwardOutput(out.logits[i : i + 1], tuple(h[:, o : o + n] for h in out.hidden), out.final_hidden[:, o : o + n])
                for i, (o, n, _) in enumerate(batch.segments)]

    def ragged_ready(self, cache: KVCache | None) -> bool:
        """Whether forward_ragged runs here: the fused CPU decode path (fp32 activations and cache, kernels built,
        inference). Where it does not, a verify pads its rows to the widest (Transformer.forward with a tree mask).
        The test is decode_glue.applies on what forward_ragged gives forward_batch: one embedded token per row (the
        embedding's dtype and device), in inference mode."""
        token = self.embed.weight[:1, None]  # [1, 1, hidden]
        with torch.inference_mode():
            return decode_glue.applies(token, cache, self.fused_glue and decode_glue.enabled() and decode_glue.supports(self.cfg))

    def forward_ragged(
        self,
        input_ids: torch.Tensor,  # [N] new tokens of rows 0..B-1, row after row
        positions: torch.Tensor,  # [N]
        cache: KVCache,
        lengths: list[int],  # [B] new tokens per row (>= 1 each, summing to N)
        tree: torch.Tensor | None = None,  # [N, max(lengths)] bool; None = causal within each row
        taps: tuple[int, ...] = (),
    ) -> ForwardOutput:  # logits [N, 1, V], hidden / final_hidden [N, 1, hidden]
        """A verify forward without padding: the GEMMs run over the N tokens as N rows (the small-M kernel, whose
        rows do not depend on each other) and each row's tokens attend to their own prefix and tree, so every token
        gets the bits it gets in a padded verify or in its row's own forward, and a row that drafts nothing costs
        one token. Needs ragged_ready(cache); advances each row's cache length by its own count."""
        if not self.ragged_ready(cache):
            raise InvalidParameterError("forward_ragged needs the fused CPU decode path (fp32, kernels built, inference)")
        if len(input_ids) != sum(lengths) or min(lengths) < 1:
            raise InvalidParameterError(f"forward_ragged: {len(input_ids)} tokens for rows of {lengths}")
        with torch.inference_mode():
            batch = ragged_attention_batch(cache, lengths, tree)
            out = self.forward_batch(input_ids.view(-1, 1), positions.view(-1, 1), cache, batch, taps)
        cache.lengths[batch.rows] += batch.lengths.to(cache.lengths.device)
        return out

    def forward_batch(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        cache: KVCache | None,
        batch: AttentionBatch,
        taps: tuple[int, ...] = (),
        last_only: bool = False,
        last_positions: torch.Tensor | None = None,  # [prompts]: a packed prefill's last token of each prompt (forward_packed)
        logits: bool = True,
    ) -> ForwardOutput:
        """The forward proper, metadata given; writes K/V into the cache but leaves `cache.lengths` alone
        (what the compiled path traces: no host syncs, no Python-side state changes)."""
        cos, sin = self.rope(positions)
        x = self.embed(input_ids)
        glue = self.fused_glue and decode_glue.enabled()
        fused = decode_glue.applies(x, cache, glue and decode_glue.supports(self.cfg))
        prefill = not fused and decode_glue.applies_prefill(x, glue)
        stack = decode_glue.stack_weights(self.blocks, x.shape[0] * x.shape[1]) if fused and self.fused_stack else None
        if stack is not None:  # every layer in one C++ call, the same ops as forward_fused
            cfg = self.cfg
            x, hidden = decode_glue.decode_layers(stack, x, cos, sin, cfg.rms_norm_eps, cache, batch, cfg.num_heads, cfg.num_kv_heads, taps)
        else:
            layer = Block.forward_fused if fused else Block.forward_prefill if prefill else Block.__call__
            tapped = {}
            for i, block in enumerate(self.blocks):
                x = layer(block, x, cos, sin, cache, batch)
                if i in taps:
                    tapped[i] = x
            hidden = [tapped[i] for i in taps]
        x = decode_glue.rms_norm(x, self.norm.weight, self.norm.eps) if fused or prefill else self.norm(x)
        if last_positions is not None:  # each prompt's last token, one per row as a decode step reads it: [prompts, 1, hidden]
            read = x[0, last_positions.to(x.device)].unsqueeze(1)
        else:
            read = x[:, -1:] if last_only else x
        return ForwardOutput(self.lm_head(read).float() if logits else None, tuple(hidden), x)

    def rope(self, positions: torch.Tensor):  # -> cos, sin_signed [B, T, 1, head_dim]
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [B, T, D/2], fp32 as in HF
        cos, sin = freqs.cos(), freqs.sin()
        dtype = self.embed.weight.dtype
        return torch.cat((cos, cos), -1).unsqueeze(2).to(dtype), torch.cat((-sin, sin), -1).unsqueeze(2).to(dtype)
