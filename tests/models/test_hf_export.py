"""A changed policy written back as an HF model directory (tandem.models.hf_export): transformers loads it and decodes
greedily token for token what tandem decodes with the same weights in memory."""
import json
from pathlib import Path

import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError, ModelLoadError
from tandem.models.hf_export import export_hf, tandem_to_hf
from tandem.models.loader import hf_to_tandem, load_transformer, read_hf_tensors
from tandem.models.config import ModelConfig

ARCHS = ("llama", "qwen2", "qwen3")  # tied, untied (with q/k/v biases), tied with q/k norms
PROMPTS = [[256, 1, 72, 101, 108, 108, 111], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
NEW_TOKENS = 16


def changed_model(path):
    """The tiny model with every parameter moved (seeded): weights no file on disk holds."""
    model = load_transformer(path)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def tandem_greedy(model) -> list[list[int]]:
    model.pack()
    engine = Engine(model, EngineConfig(max_batch_size=2, max_model_len=64))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [r.output_ids for r in engine.run(PROMPTS, [params] * len(PROMPTS))]


def hf_greedy(path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            for _ in range(NEW_TOKENS):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
            out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_decodes_the_exported_policy_as_tandem_does(tiny_dirs, arch, tmp_path):
    model = changed_model(tiny_dirs[arch])
    named = {n: p.detach().clone() for n, p in model.named_parameters()}  # what the learner hands over (tied: once)
    out = export_hf(named, tiny_dirs[arch], tmp_path / "export")
    hf_names = set(read_hf_tensors(out))
    assert ("lm_head.weight" in hf_names) == (arch == "qwen2")  # a tied head is left to tie_word_embeddings
    assert "model.layers.0.self_attn.q_proj.weight" in hf_names and "model.layers.0.mlp.up_proj.weight" in hf_names
    source, exported = json.loads(Path(tiny_dirs[arch], "config.json").read_text()), json.loads((out / "config.json").read_text())
    dtype_keys = ("dtype", "torch_dtype")
    assert {k: v for k, v in exported.items() if k not in dtype_keys} == {k: v for k, v in source.items() if k not in dtype_keys}
    assert [exported[k] for k in dtype_keys if k in exported] in (["float32"], ["float32", "float32"])
    assert (out / "tokenizer.json").read_bytes() == Path(tiny_dirs[arch], "tokenizer.json").read_bytes()
    reloaded = load_transformer(out)
    assert all(torch.equal(p, named[n]) for n, p in reloaded.named_parameters())  # an exact round trip
    want = tandem_greedy(model)
    assert hf_greedy(out) == want
    assert want != tandem_greedy(load_transformer(tiny_dirs[arch]))  # the change is visible in the output


@pytest.mark.parametrize("arch", ARCHS)
def test_the_export_inverts_the_loader_exactly(tiny_dirs, arch):
    hf = read_hf_tensors(Path(tiny_dirs[arch]))
    cfg = ModelConfig.from_dir(tiny_dirs[arch])
    ours = hf_to_tandem(hf, cfg)
    back = tandem_to_hf({n: t for n, t in ours.items() if not (cfg.tie_embeddings and n == "lm_head.weight")}, cfg)
    assert set(back) == set(hf) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert all(torch.equal(back[n], hf[n]) for n in back)


def test_bad_exports_are_refused_and_lose_nothing(tiny_dirs, tmp_path):
    model = load_transformer(tiny_dirs["llama"])
    named = {n: p.detach() for n, p in model.named_parameters()}
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(InvalidParameterError, match="not an empty directory"):
        export_hf(named, tiny_dirs["llama"], busy)
    assert (busy / "keep.txt").read_text() == "mine"
    with pytest.raises(ModelLoadError, match="blocks.0.attn.qkv.weight"):
        export_hf({n: t for n, t in named.items() if n != "blocks.0.attn.qkv.weight"}, tiny_dirs["llama"], tmp_path / "a")
    with pytest.raises(ModelLoadError, match="does not describe"):
        export_hf(named | {"blocks.9.attn.o.weight": named["blocks.0.attn.o.weight"]}, tiny_dirs["llama"], tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
