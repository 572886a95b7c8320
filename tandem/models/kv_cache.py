"""Preallocated KV cache for a batch of sequences of different lengths, plus per-forward metadata.

Layout: k, v are [num_layers, max_batch, num_kv_heads, max_len, head_dim]. Row r holds one sequence;
`lengths[r]` tokens of it are valid. A forward over T new tokens writes them at slots
lengths[r] .. lengths[r]+T-1 and advances lengths; the engine then rolls back (`truncate`) or
compacts a draft tree to its accepted path (`keep_path`). Rows of a forward are a contiguous slice so
the cache is read through views, never copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.errors import PromptTooLongError
from tandem.models.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, max_batch: int, max_len: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (cfg.num_layers, max_batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H, S, D]
        self.lengths = torch.zeros(max_batch, dtype=torch.long)  # [B] valid tokens per row (CPU)
        self.max_batch = max_batch
        self.max_len = max_len

    def truncate(self, row: int, length: int) -> None:
        """Roll row back to its first `length` tokens (drop rejected drafts)."""
        if not 0 <= length <= int(self.lengths[row]):
            raise ValueError(f"cannot truncate row {row} of length {int(self.lengths[row])} to {length}")
        self.lengths[row] = length

    def keep_path(self, row: int, start: int, offsets: list[int]) -> None:
        """Keep only the tree nodes at slots start+offsets (an accepted root-to-node path), packed at start..

        offsets are increasing (nodes are topologically ordered), so every gather reads before it writes.
        """
        if offsets and offsets != list(range(len(offsets))):
            src = torch.tensor(offsets, device=self.k.device) + start
            n = len(offsets)
            self.k[:, row, :, start : start + n] = self.k[:, row, :, src]
            self.v[:, row, :, start : start + n] = self.v[:, row, :, src]
        self.lengths[row] = start + len(offsets)

    def move_row(self, src: int, dst: int) -> None:
        """Copy row src into row dst (keeps active rows contiguous when a request leaves)."""
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n

    def reset(self, row: int) -> None:
        self.lengths[row] = 0


@dataclass
class AttentionBatch:
    """What every layer of one forward needs to read and write the cache (built once per forward)."""

    rows: slice  # cache rows of this batch
    starts: torch.Tensor  # [B] cache length of each row before this forward
    write_slots: torch.Tensor  # [B, T] cache slot of each new token
    total_len: int  # S: keys each query may see (max over rows of start + T)
    mask: torch.Tensor | None  # [B, 1, T, S] bool, True = attend; None = all of [0, S) (B=1 causal decode)
    is_causal: bool  # no prefix and no tree: SDPA's own causal mask
    uniform_start: int | None  # the common start when all rows start at the same slot (writes are a narrow copy)
    row_groups: tuple[tuple[int, int, int], ...] = ()  # (first, end, keys) per group of ATTENTION_GROUP_ROWS rows
    tree: torch.Tensor | None = None  # [B, T, T] bool the mask was built from; None = causal among the new tokens
    segments: tuple[tuple[int, int, int], ...] = ()  # packed prefill: (offset, length, cache row) of each prompt in the one row
    lengths: torch.Tensor | None = None  # [B] ragged verify: new tokens per row, row after row in one column of N tokens

    def groups(self) -> tuple[tuple[int, int, int], ...]:
        """Row ranges of the batch, each with the keys its longest row needs: attention per group reads
        each group's own prefix of the cache rather than all rows up to the longest row of the batch."""
        return self.row_groups or ((0, len(self.starts), self.total_len),)


def build_attention_batch(
    cache: KVCache | None,
    rows: slice | None,
    num_new: int,
    tree_mask: torch.Tensor | None,  # [B, T, T] bool, True = new token i sees new token j
    batch: int,
    device: torch.device,
) -> AttentionBatch:
    if cache is None:
        starts = torch.zeros(batch, dtype=torch.long)
        rows = slice(0, batch)
    else:
        rows = rows if rows is not None else slice(0, batch)
        starts = cache.lengths[rows].clone()
        if int(starts.max()) + num_new > cache.max_len:
            raise PromptTooLongError(f"KV cache holds {cache.max_len} tokens per sequence; a forward needs {int(starts.max()) + num_new}")
    total = int(starts.max()) + num_new
    slots = starts.unsqueeze(1) + torch.arange(num_new).unsqueeze(0)  # [B, T]
    first = int(starts[0])
    uniform = first if bool((starts == first).all()) else None
    no_prefix = uniform == 0
    if tree_mask is None and (no_prefix or (num_new == 1 and batch == 1)):
        return AttentionBatch(rows, starts, slots, total, None, no_prefix and num_new > 1, uniform)
    mask = _attention_mask(starts, num_new, total, tree_mask).to(device)
    return AttentionBatch(rows, starts, slots, total, mask, False, uniform, _row_groups(starts, num_new), tree_mask)


ATTENTION_GROUP_ROWS = 8  # measured: 60-row decode over ragged lengths 1.99 -> 1.13 ms per layer (BENCHMARKS 1.3)


def packed_attention_batch(cache: KVCache, lengths: list[int], rows: list[int]) -> AttentionBatch:
    """Several prompts as one row of tokens (a packed prefill): prompt i is tokens offsets[i] .. + lengths[i], written
    into cache row rows[i] from slot 0, and attends causally within itself only."""
    if max(lengths) > cache.max_len:
        raise PromptTooLongError(f"KV cache holds {cache.max_len} tokens per sequence; a prompt has {max(lengths)}")
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)  # [1, N]
    return AttentionBatch(slice(0, 1), torch.zeros(1, dtype=torch.long), positions, max(lengths), None, True, None,
                          segments=tuple(zip(offsets, lengths, rows)))


def ragged_attention_batch(
    cache: KVCache,
    lengths: list[int],  # [B] new tokens of rows 0..B-1, each >= 1
    tree: torch.Tensor | None,  # [N, max(lengths)] bool: new token i sees new token u of its own row; None = causal
) -> AttentionBatch:
    """A verify whose rows bring different numbers of new tokens, packed as one column of N = sum(lengths) tokens
    (x [N, 1, hidden]): row b's tokens are written at its slots starts[b] .. + lengths[b] and attend to its own
    prefix and tree only. Only the fused CPU attention (decode_glue.attend_cached) reads this layout."""
    rows = slice(0, len(lengths))
    starts = cache.lengths[rows].clone()
    ends = starts + torch.tensor(lengths)
    if int(ends.max()) > cache.max_len:
        raise PromptTooLongError(f"KV cache holds {cache.max_len} tokens per sequence; a forward needs {int(ends.max())}")
    slots = torch.cat([int(s) + torch.arange(n) for s, n in zip(starts.tolist(), lengths)]).unsqueeze(1)  # [N, 1]
    return AttentionBatch(rows, starts, slots, int(ends.max()), None, False, None, tree=tree,
                          lengths=torch.tensor(lengths, dtype=torch.long))


def _row_groups(starts: torch.Tensor, num_new: int) -> tuple[tuple[int, int, int], ...]:
    """Groups of consecutive rows for attention, when the batch is large and ragged enough to gain."""
    batch = len(starts)
    if batch <= ATTENTION_GROUP_ROWS:
        return ()
    ends = (starts + num_new).tolist()
    return tuple((i, min(batch, i + ATTENTION_GROUP_ROWS), max(ends[i : i + ATTENTION_GROUP_ROWS])) for i in range(0, batch, ATTENTION_GROUP_ROWS))


def _attention_mask(
    starts: torch.Tensor,  # [B]
    num_new: int,
    total: int,
    tree_mask: torch.Tensor | None,  # [B, T, T]
) -> torch.Tensor:  # [B, 1, T, S]
    batch = starts.shape[0]
    key = torch.arange(total).view(1, 1, total)  # [1, 1, S]
    start = starts.view(batch, 1, 1)
    prefix = key < start  # [B, 1, S]: the cached prefix of each row
    if tree_mask is None:
        tree_mask = torch.ones(num_new, num_new, dtype=torch.bool).tril().expand(batch, -1, -1)
    rel = key - start  # [B, 1, S] index of a key among the new tokens
    in_new = (rel >= 0) & (rel < num_new)
    gathered = torch.gather(
        tree_mask.to(torch.bool).cpu(), 2, rel.clamp(0, num_new - 1).expand(batch, num_new, total)
    )  # [B, T, S]
    return (prefix | (in_new & gathered)).unsqueeze(1)
