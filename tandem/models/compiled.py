"""A compiled decode / verify forward: torch.compile (inductor) of the whole model at bucketed static shapes.

Eager decoding of a small model spends ~10 ms per token in Python/dispatcher overhead of ~35 small ops
per layer (docs/BENCHMARKS.md section 1); compiling the whole forward fuses the glue (norms, RoPE,
residuals) into a few C++ loops. Inside the graph the KV cache is only read (an in-graph write into an
input made inductor copy the whole cache each step): attention runs over the cached prefix plus the
new keys (tandem.ops.attention), and the new K/V come out of the graph and are written with one
index_put per step. Shapes are static so nothing recompiles in steady state: the batch is padded to a
power of two (padded rows read free cache rows), the new tokens per sequence to a power of two
(padded tokens are never written), and the attended prefix to a power of two (the mask hides slots
that are not valid). The prepacked oneDNN
weights are called through one opaque custom op (`tandem::linear_packed`) so one copy of each weight
serves eager and compiled code, and weight updates (repack) need no recompilation.

CPU: inductor's C++/OpenMP backend (needs a C++ compiler; without one: eager with a warning). CUDA: the
same function compiled with mode="reduce-overhead" (CUDA graphs); outputs are cloned out of the graph pool.
"""
from __future__ import annotations

import itertools
import shutil
import types
import warnings

import torch

from tandem.models.kv_cache import KVCache
from tandem.models.transformer import ForwardOutput, Transformer
from tandem.ops.attention import prefix_attention

MIN_CACHE_BUCKET = 64
TOKEN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16)  # new tokens per sequence: exact up to 6 (a k <= 5 verify is not padded)


def bucket(n: int, cap: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor), capped at cap (cap itself is a bucket)."""
    size = floor
    while size < n:
        size *= 2
    return min(size, cap)


def compiler_available(device: torch.device) -> bool:
    """Inductor needs a C++ compiler on CPU and Triton on CUDA."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def pure_forward(
    model: Transformer,
    ids: torch.Tensor,  # [B, T]
    positions: torch.Tensor,  # [B, T]
    cache_k: torch.Tensor,  # [L, B, Hkv, S, D] cached prefix, read only
    cache_v: torch.Tensor,  # [L, B, Hkv, S, D]
    mask: torch.Tensor,  # [B, 1, T, S + T] bool
    taps: tuple[int, ...],
):  # -> logits [B, T, V], new_k / new_v [L, B, T, Hkv, D], taps, final hidden [B, T, hidden]
    """The model's forward with a read-only cache: what gets compiled (the eager forward is its reference)."""
    cos, sin = model.rope(positions)
    x = model.embed(ids)
    new_k, new_v, tapped = [], [], []
    for i, block in enumerate(model.blocks):
        q, k, v = block.attn.project_qkv(block.attn_norm(x), cos, sin)
        x = x + block.attn.o(prefix_attention(q, k, v, cache_k[i], cache_v[i], mask))
        x = x + block.mlp(block.mlp_norm(x))
        new_k.append(k)
        new_v.append(v)
        if i in taps:
            tapped.append(x)
    x = model.norm(x)
    return model.lm_head(x).float(), torch.stack(new_k), torch.stack(new_v), tuple(tapped), x


def _skip_model_guards(entries) -> list[bool]:
    """Keep dynamo's guards on the inputs (their shapes pick the bucket) but not the ~300 on the model's
    modules and weights (3 ms per call here): weights are graph inputs read at each call, so repacked
    weights need no recompilation, and each CompiledForward owns its code object (one model per cache)."""
    return [not e.name.startswith("L['model']") or e.name == "L['model']" for e in entries]


def _own_code_copy(fn):
    """A copy of fn with its own code object: dynamo keeps compiled entries per code object."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


_copies = itertools.count()


class CompiledForward:
    """`model(ids, positions, cache, rows=0..B-1, tree_mask, taps)` through one compiled graph per shape bucket.

    Same semantics as the eager forward over cache rows 0..B-1 (writes K/V, advances `cache.lengths`),
    which is what the engine's decode / verify step calls. Falls back to eager (warns once) where no
    compiler exists, and per call for more new tokens than the largest bucket.
    """

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        taps: tuple[int, ...] = (),
        token_buckets: tuple[int, ...] = TOKEN_BUCKETS,
        cpp_wrapper: bool = False,
        backend: str = "inductor",  # "eager": dynamo capture only (tests of the bucketing without a C++ build)
        progress=None,  # callable(str): told before each new shape compiles (minutes on a small CPU)
    ):
        self.model, self.cache, self.taps = model, cache, tuple(taps)
        self.token_buckets = tuple(sorted(token_buckets))  # wider verifies than the last bucket run eager
        self.max_tokens = self.token_buckets[-1]
        self.device = cache.k.device
        self.progress = progress
        self.compiled_shapes: set[tuple[int, int, int]] = set()
        self.eager_calls = 0
        self._fn = None
        if backend == "inductor" and not compiler_available(self.device):
            warnings.warn("torch.compile needs a C++ compiler (CPU) or Triton (CUDA); none found: decoding runs eager", RuntimeWarning, stacklevel=2)
            return
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # one entry per bucket
        options = {"guard_filter_fn": _skip_model_guards}
        if backend == "inductor" and self.device.type == "cuda":
            options["triton.cudagraphs"] = True  # = mode="reduce-overhead" (torch.compile takes mode or options, not both)
        elif backend == "inductor":
            options["cpp_wrapper"] = cpp_wrapper
        self._fn = torch.compile(_own_code_copy(pure_forward), backend=backend, fullgraph=True, dynamic=False, options=options)

    @property
    def enabled(self) -> bool:
        return self._fn is not None

    def shapes(self, batch: int, tokens: int, cache_len: int) -> tuple[int, int, int]:
        """The bucketed (B, T, S) a forward of `tokens` new tokens for `batch` rows after `cache_len` runs at."""
        t = next(size for size in self.token_buckets if size >= tokens)
        return bucket(batch, self.cache.max_batch), t, bucket(cache_len, self.cache.max_len, MIN_CACHE_BUCKET)

    def __call__(
        self,
        ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        tree_mask: torch.Tensor | None = None,  # [B, T, T] bool; None = causal
    ) -> ForwardOutput:
        b, t = ids.shape
        starts = self.cache.lengths[:b].clone()
        longest = int(starts.max())
        if self._fn is None or t > self.max_tokens or longest + t > self.cache.max_len:
            self.eager_calls += 1
            return self.model(ids, positions=positions, cache=self.cache, rows=slice(0, b), tree_mask=tree_mask, taps=self.taps)
        bb, tb, s = self.shapes(b, t, longest)
        if (bb, tb, s) not in self.compiled_shapes:
            if self.progress is not None:
                self.progress(f"compiling the forward for batch {bb}, tokens {tb}, cache {s} (once per shape; cached on disk)")
            self.compiled_shapes.add((bb, tb, s))
        pad_ids, pad_pos, mask = self._padded_inputs(ids, positions, tree_mask, starts, bb, tb, s)
        k, v = self.cache.k[:, :bb, :, :s], self.cache.v[:, :bb, :, :s]
        logits, new_k, new_v, tapped, final = self._fn(self.model, pad_ids, pad_pos, k, v, mask, self.taps)
        self._write_cache(new_k[:, :b, :t], new_v[:, :b, :t], starts)
        cut = (lambda x: x[:b, :t].clone()) if self.device.type == "cuda" else (lambda x: x[:b, :t])  # CUDA graphs reuse outputs
        return ForwardOutput(cut(logits), tuple(cut(h) for h in tapped), cut(final))

    def _padded_inputs(self, ids, positions, tree_mask, starts, bb: int, tb: int, s: int):
        b, t = ids.shape
        all_starts = torch.zeros(bb, dtype=torch.long)
        all_starts[:b] = starts
        pad_ids = torch.zeros(bb, tb, dtype=torch.long)
        pad_ids[:b, :t] = ids.cpu()
        pad_pos = all_starts.unsqueeze(1) + torch.arange(tb)  # padded tokens: the next positions; padded rows: 0..tb-1
        pad_pos[:b, :t] = positions.cpu()
        new = torch.ones(tb, tb, dtype=torch.bool).tril().repeat(bb, 1, 1)  # [Bb, Tb, Tb]
        if tree_mask is not None:
            new[:b, :t, :t] = tree_mask.to(torch.bool).cpu()
        prefix = (torch.arange(s).unsqueeze(0) < all_starts.unsqueeze(1)).unsqueeze(1).expand(bb, tb, s)  # [Bb, Tb, S]
        mask = torch.cat([prefix, new], dim=-1).unsqueeze(1)  # [Bb, 1, Tb, S + Tb]
        device = self.device
        return pad_ids.to(device), pad_pos.to(device), mask.to(device)

    def _write_cache(self, new_k: torch.Tensor, new_v: torch.Tensor, starts: torch.Tensor) -> None:  # new_* [L, B, T, Hkv, D]
        _, b, t = new_k.shape[:3]
        rows = torch.arange(b).unsqueeze(1).expand(b, t)
        slots = starts.unsqueeze(1) + torch.arange(t)  # [B, T]
        device = self.device
        self.cache.k[:, rows.to(device), :, slots.to(device)] = new_k.permute(1, 2, 0, 3, 4)  # [B, T, L, Hkv, D]
        self.cache.v[:, rows.to(device), :, slots.to(device)] = new_v.permute(1, 2, 0, 3, 4)
        self.cache.lengths[:b] += t

    def warmup(self, batches: tuple[int, ...], tokens: tuple[int, ...], cache_lens: tuple[int, ...]) -> int:
        """Compile every bucket the given (batch, tokens, cache length) combinations reach; returns how many.

        Runs forwards on the cache (rows 0..B-1 at slots past each bucket's prefix) and restores its lengths."""
        if self._fn is None:
            return 0
        todo = sorted({self.shapes(b, t, c) for b in batches for t in tokens for c in cache_lens})
        todo = [(bb, tb, s) for bb, tb, s in todo if (bb, tb, s) not in self.compiled_shapes and tb <= self.cache.max_len]
        saved = self.cache.lengths.clone()
        with torch.inference_mode():
            for bb, tb, s in todo:
                self.cache.lengths[:bb] = min(s, self.cache.max_len - tb)
                ids = torch.zeros(bb, tb, dtype=torch.long, device=self.device)
                positions = (self.cache.lengths[:bb].unsqueeze(1) + torch.arange(tb)).to(self.device)
                self(ids, positions)
        self.cache.lengths.copy_(saved)
        return len(todo)
