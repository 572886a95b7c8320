"""prefix_attention == SDPA over [cached prefix | new keys] (GQA, ragged prefixes, tree masks)."""
import pytest
import torch
import torch.nn.functional as F

from tandem.ops.attention import prefix_attention


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3)])
def test_matches_sdpa_over_concatenated_keys(heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    b, t, s, d = 3, 4, 10, 8
    q = torch.randn(b, t, heads, d, generator=gen)
    k_new, v_new = torch.randn(b, t, kv_heads, d, generator=gen), torch.randn(b, t, kv_heads, d, generator=gen)
    k_pre, v_pre = torch.randn(b, kv_heads, s, d, generator=gen), torch.randn(b, kv_heads, s, d, generator=gen)
    starts = torch.tensor([0, 3, 10])  # valid prefix per row
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)  # a branch at node 0
    prefix = (torch.arange(s) < starts.unsqueeze(1)).view(b, 1, 1, s).expand(b, 1, t, s)
    mask = torch.cat([prefix, tree.expand(b, 1, t, t)], dim=-1)  # [B, 1, T, S+T]
    got = prefix_attention(q, k_new, v_new, k_pre, v_pre, mask)
    keys = torch.cat([k_pre, k_new.transpose(1, 2)], dim=2)
    values = torch.cat([v_pre, v_new.transpose(1, 2)], dim=2)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=heads != kv_heads)
    assert got.shape == (b, t, heads * d)
    assert (got - want.transpose(1, 2).reshape(b, t, heads * d)).abs().max().item() <= 1e-5


def test_invalid_prefix_slots_are_ignored():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 2, 4, generator=gen) for _ in range(3))
    k_pre = torch.randn(1, 2, 6, 4, generator=gen)
    v_pre = torch.randn(1, 2, 6, 4, generator=gen)
    mask = torch.tensor([True, True, False, False, False, False, True]).view(1, 1, 1, 7)
    garbage_k, garbage_v = k_pre.clone(), v_pre.clone()
    garbage_k[:, :, 2:] = 1e4
    garbage_v[:, :, 2:] = -1e4  # stale but finite, like unwritten or rolled-back cache slots
    out = prefix_attention(q, k, v, garbage_k, garbage_v, mask)
    assert torch.isfinite(out).all()
    assert (out - prefix_attention(q, k, v, k_pre, v_pre, mask)).abs().max().item() <= 1e-6
