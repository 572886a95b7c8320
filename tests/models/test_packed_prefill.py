"""Transformer.forward_packed: several prompts prefilled as one row of tokens (no padding), each attending within
itself and filling its own cache row, give what each prompt's own forward gives."""
import pytest
import torch

from tandem.models import cpu_gemm, decode_glue
from tandem.models.kv_cache import KVCache
from tandem.models.loader import load_transformer

from tests.conftest import ARCHS

LENGTHS = [40, 33, 75, 34]  # each > decode_glue.MAX_NEW_TOKENS, so every prompt's own prefill is prefill-shaped too
ROWS = [1, 3, 4, 6]


def prompts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pack", [True, False])
def test_packed_prefill_is_each_prompts_own_prefill(tiny_dirs, arch, pack):
    model = load_transformer(tiny_dirs[arch])
    if pack:
        model.pack()
    own_cache, packed_cache = KVCache(model.cfg, 8, 96), KVCache(model.cfg, 8, 96)
    with torch.inference_mode():
        own = [model(torch.tensor([p]), cache=own_cache, rows=slice(r, r + 1), last_only=True, taps=(0, 1)) for p, r in zip(prompts(), ROWS)]
        packed = model.forward_packed(prompts(), packed_cache, ROWS, taps=(0, 1))
    exact = pack and cpu_gemm.available()  # the CPU kernels are row-invariant; F.linear over more rows may round otherwise
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5))
    assert len(packed) == len(LENGTHS)
    for mine, theirs, n in zip(packed, own, LENGTHS):
        assert mine.logits.shape == theirs.logits.shape == (1, 1, model.cfg.vocab_size)
        assert same(mine.logits, theirs.logits)
        assert [h.shape[1] for h in mine.hidden] == [n, n] and all(same(a, b) for a, b in zip(mine.hidden, theirs.hidden))
        assert same(mine.final_hidden, theirs.final_hidden)
    assert torch.equal(packed_cache.lengths, own_cache.lengths)
    assert same(packed_cache.k, own_cache.k) and same(packed_cache.v, own_cache.v)


def test_packed_prefill_refuses_short_prompts_and_missing_rows(tiny_dirs):
    model = load_transformer(tiny_dirs["llama"])
    cache = KVCache(model.cfg, 4, 96)
    with pytest.raises(ValueError, match="tokens"):
        model.forward_packed([[1] * 40, [2] * decode_glue.MAX_NEW_TOKENS], cache, [0, 1])
    with pytest.raises(ValueError, match="row"):
        model.forward_packed([[1] * 40, [2] * 40], cache, [0])
