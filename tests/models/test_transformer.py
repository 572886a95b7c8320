"""Parity with HF transformers and the cache / tree semantics speculative decoding relies on."""
import pytest
import torch

from tandem.models.kv_cache import KVCache
from tandem.models.loader import load_transformer
from tandem.ops.tree import root_to_leaf_paths, tree_attention_mask


ARCHS = ("llama", "qwen2", "qwen3")
TOL = 1e-4


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def ours(path, packed=True):
    model = load_transformer(path)
    if packed:
        model.pack()
    return model


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("packed", [False, True])
def test_full_sequence_logits_match_hf(tiny_dirs, arch, packed):
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf_model(tiny_dirs[arch])(ids).logits
    got = ours(tiny_dirs[arch], packed)(ids).logits
    assert max_diff(got, want) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decode_with_cache_matches_hf(tiny_dirs, arch):
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(tiny_dirs[arch])(ids).logits
    model = ours(tiny_dirs[arch])
    cache = KVCache(model.cfg, max_batch=1, max_len=64)
    pieces = [model(ids[:, :8], cache=cache).logits]
    for t in range(8, 20, 3):  # chunks of 3 then single tokens: exercises prefix + causal masks
        pieces.append(model(ids[:, t : t + 3], cache=cache).logits)
    assert max_diff(torch.cat(pieces, 1), want) <= TOL
    assert int(cache.lengths[0]) == 20


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batch_decode_matches_single_sequences(tiny_dirs, arch):
    model = ours(tiny_dirs[arch])
    gen = torch.Generator().manual_seed(2)
    lengths = (5, 11, 8, 3, 17, 9, 2, 6, 12, 4, 20)  # > ATTENTION_GROUP_ROWS rows: attention runs per row group
    prompts = [torch.randint(0, 300, (1, n), generator=gen) for n in lengths]
    nxt = torch.randint(0, 300, (len(lengths), 2), generator=gen)
    cache = KVCache(model.cfg, max_batch=len(lengths), max_len=32)
    for row, p in enumerate(prompts):
        model(p, cache=cache, rows=slice(row, row + 1))
    batched = model(nxt, cache=cache, rows=slice(0, len(lengths))).logits
    for row, p in enumerate(prompts):
        single = model(torch.cat([p, nxt[row : row + 1]], 1)).logits[:, -2:]
        assert max_diff(batched[row : row + 1], single) <= TOL


def toy_tree():
    #        root
    #      0      1
    #    2   3    4
    #    5
    return torch.tensor([-1, -1, 0, 0, 1, 2])


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_forward_equals_each_root_to_leaf_path(tiny_dirs, arch):
    model = ours(tiny_dirs[arch])
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 300, (1, 9), generator=gen)
    parents = toy_tree()
    tokens = torch.randint(0, 300, (1, len(parents)), generator=gen)
    depth = torch.tensor([0, 0, 1, 1, 1, 2])
    cache = KVCache(model.cfg, max_batch=1, max_len=32)
    model(prompt, cache=cache)
    tree_logits = model(tokens, positions=(9 + depth).unsqueeze(0), cache=cache, tree_mask=tree_attention_mask(parents).unsqueeze(0)).logits
    for path in root_to_leaf_paths(parents):
        seq = torch.cat([prompt, tokens[:, path]], 1)
        path_logits = model(seq).logits[:, 9:]
        assert max_diff(tree_logits[:, path], path_logits) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_path_then_decode_equals_decoding_the_path(tiny_dirs, arch):
    model = ours(tiny_dirs[arch])
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 300, (1, 7), generator=gen)
    parents = toy_tree()
    tokens = torch.randint(0, 300, (1, len(parents)), generator=gen)
    depth = torch.tensor([0, 0, 1, 1, 1, 2])
    cache = KVCache(model.cfg, max_batch=1, max_len=32)
    model(prompt, cache=cache)
    model(tokens, positions=(7 + depth).unsqueeze(0), cache=cache, tree_mask=tree_attention_mask(parents).unsqueeze(0))
    path = [0, 2, 5]
    cache.keep_path(0, 7, path)
    nxt = torch.tensor([[42]])
    got = model(nxt, cache=cache).logits
    want = model(torch.cat([prompt, tokens[:, path], nxt], 1)).logits[:, -1:]
    assert max_diff(got, want) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_then_redecode_equals_never_decoded(tiny_dirs, arch):
    model = ours(tiny_dirs[arch])
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 300, (1, 6), generator=gen)
    rejected = torch.randint(0, 300, (1, 4), generator=gen)
    good = torch.randint(0, 300, (1, 3), generator=gen)
    cache = KVCache(model.cfg, max_batch=1, max_len=32)
    model(prompt, cache=cache)
    model(rejected, cache=cache)
    cache.truncate(0, 6)
    got = model(good, cache=cache).logits
    fresh = KVCache(model.cfg, max_batch=1, max_len=32)
    model(prompt, cache=fresh)
    want = model(good, cache=fresh).logits
    assert max_diff(got, want) == 0.0 or max_diff(got, want) <= 1e-6


def test_hidden_state_taps_match_hf(tiny_dirs):
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        hf_hidden = hf_model(tiny_dirs["llama"])(ids, output_hidden_states=True).hidden_states
    out = ours(tiny_dirs["llama"])(ids, taps=(0, 2))
    assert max_diff(out.hidden[0], hf_hidden[1]) <= TOL  # hf_hidden[0] is the embedding output
    assert max_diff(out.final_hidden, hf_hidden[-1]) <= TOL  # HF's last entry is after the final norm
