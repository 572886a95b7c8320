"""`tandem bench quality --peers llama`: GGUF columns beside tandem's precisions, against the llama-cpp-python stand-in
(tests/bench/fake_llama_cpp: after token t its logits are 2 at t + 1, 1 at t, 0 elsewhere), and on the real peer venv
with Qwen2.5-Coder-0.5B where it is on this machine."""
import json
import math
import sys
from pathlib import Path

import pytest

from tandem.bench.peers.llama_peer import gguf_dir, gguf_path, llama_python
from tandem.bench.speculation.quality import QualityBenchConfig, Sample
from tandem.bench.peers.quality_llama import llama_columns, llama_notes
from tandem.cli import main
from tandem.errors import InvalidParameterError

FAKE = Path(__file__).with_name("fake_llama_cpp")


@pytest.fixture
def fake_python(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    return Path(sys.executable)


class _Bytes:
    def encode(self, text, add_special_tokens=True):
        return list(text.encode())


def _fake_logprob(vocab: int, prev: int, token: int) -> float:
    """The stand-in's log-prob of `token` after `prev`, computed here from its logits table."""
    norm = math.log(math.exp(2.0) + math.exp(1.0) + vocab - 2)
    return (2.0 if token == prev + 1 else 1.0 if token == prev else 0.0) - norm


def test_llama_columns_score_and_decode_each_gguf(fake_python, tmp_path):
    ggufs = [tmp_path / "a.gguf", tmp_path / "b-q4.gguf", tmp_path / "c.gguf"]
    samples = [Sample("code", [10, 11, 12], [13, 14, 20]), Sample("chat", [50, 50], [7])]
    columns = llama_columns(fake_python, ggufs, samples, _Bytes(), [255], threads=1)
    assert list(columns) == ["llama:Q8_0", "llama:Q4_K_M", "llama:Q8_0:c.gguf"]  # a second Q8_0: its file name added
    rows, info = columns["llama:Q8_0"]
    lp = lambda a, b: _fake_logprob(256, a, b)  # noqa: E731
    assert rows[0] == pytest.approx({"prompt_logprob": (lp(10, 11) + lp(11, 12)) / 2,
                                     "continuation_logprob": (lp(12, 13) + lp(13, 14) + lp(14, 20)) / 3,
                                     "top1_agreement": 2 / 3,  # argmax 15 after 14, not 20
                                     "greedy_prefix_agreement": 2 / 3}, abs=1e-12)  # it decodes 13 14 15
    assert rows[1] == pytest.approx({"prompt_logprob": lp(50, 50), "continuation_logprob": lp(50, 7), "top1_agreement": 0.0,
                                     "greedy_prefix_agreement": 0.0}, abs=1e-12)
    assert info == {"version": "llama-cpp-python 0.0-fake", "gguf": str(ggufs[0]), "file_type": "Q8_0", "n_ctx": 64, "threads": 1,
                    "system_info": "fake: no CPU features"}  # 3 prompt + 3 new tokens + 1, up to 64


def test_notes_say_the_shipped_gguf_is_tandems_fp32(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_BENCH_CACHE", str(tmp_path))
    columns = {"llama:Q8_0": {"gguf": str(gguf_dir() / "qwen2.5-coder-0.5b.Q8_0.gguf")},
               "llama:Q4_K_M": {"gguf": str(gguf_dir() / "qwen2.5-coder-0.5b.gguf")},
               "llama:Q4_0": {"gguf": str(tmp_path / "mine.gguf")}}
    notes = llama_notes("qwen2.5-coder-0.5b", columns)
    assert len(notes) == 2
    assert notes[0].startswith("llama:Q8_0 is llama.cpp's Q8_0 of the GGUF the zoo ships for qwen2.5-coder-0.5b")
    assert notes[1].startswith("llama:Q4_K_M is the GGUF the zoo ships for qwen2.5-coder-0.5b") and "~0 by construction" in notes[1]
    assert llama_notes(str(tmp_path), columns) == []  # not a zoo model: its fp32 is not a GGUF of ours


def test_llama_options_are_checked_before_any_model_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_BENCH_CACHE", str(tmp_path))
    with pytest.raises(InvalidParameterError, match="--peers: unknown \\['hf'\\]"):
        QualityBenchConfig(peers=("hf",))
    with pytest.raises(InvalidParameterError, match="needs at least one --llama-gguf"):
        QualityBenchConfig(peers=("llama",), llama_gguf=())
    with pytest.raises(InvalidParameterError, match="no GGUF file at .*missing.gguf"):
        QualityBenchConfig(peers=("llama",), llama_gguf=("shipped", str(tmp_path / "missing.gguf")))
    with pytest.raises(InvalidParameterError, match="builds from a zoo model"):
        QualityBenchConfig(model=str(tmp_path), peers=("llama",), llama_gguf=("q8_0",))
    QualityBenchConfig(model="qwen2.5-coder-0.5b", peers=("llama",))  # shipped / q8_0: built on first use, not checked here
    assert main(["bench", "quality", "--model", str(tmp_path / "no-model"), "--peers", "llama", "--llama-gguf", str(tmp_path / "missing.gguf")]) == 1


def test_quality_bench_puts_gguf_columns_beside_tandems(tiny_llama, fake_python, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"domain": d, "prompt": t}) for d, t in [("code", "def f(x): return x"), ("chat", "hello there")]))
    ggufs = [tmp_path / "tiny.gguf", tmp_path / "tiny-q4.gguf"]
    for g in ggufs:
        g.write_bytes(b"GGUF")
    out = tmp_path / "q.json"
    assert main(["bench", "quality", "--model", tiny_llama, "--weights", "fp32", "--prompts", str(prompts), "--domains", "code,chat",
                 "--max-tokens", "6", "--peers", "llama", "--llama-gguf", ",".join(map(str, ggufs)), "--llama-python", sys.executable,
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["weights"]) == ["fp32", "llama:Q8_0", "llama:Q4_K_M"]
    assert result["peers"]["llama:Q4_K_M"]["gguf"] == str(ggufs[1]) and result["notes"] == []  # not a zoo model
    fp32, q8 = result["weights"]["fp32"], result["weights"]["llama:Q8_0"]
    for domain, text in [("code", "def f(x): return x"), ("chat", "hello there")]:  # the byte tokenizer's chat turn
        ids = [257, *b"user\n", *text.encode(), 258, *b"\n", 257, *b"assistant\n"]
        expected = sum(_fake_logprob(320, a, b) for a, b in zip(ids, ids[1:])) / (len(ids) - 1)
        assert q8[domain]["prompt_logprob"] == pytest.approx(expected, abs=1e-4)
        assert q8[domain]["prompt_logprob_delta"] == pytest.approx(expected - fp32[domain]["prompt_logprob"], abs=2e-4)
        cont_delta = q8[domain]["continuation_logprob"] - fp32[domain]["continuation_logprob"]
        assert q8[domain]["continuation_logprob_delta"] == pytest.approx(cont_delta, abs=2e-4)
    assert result["weights"]["llama:Q4_K_M"] == q8  # the stand-in is one model whatever its file type
    table = capsys.readouterr().err
    assert "| domain | llama:Q8_0 | llama:Q4_K_M |" in table and "| overall | " in table


def _real_peer():
    """The peer venv's Python and the 0.5B's Q8_0 GGUF, where both are on this machine."""
    try:
        python = llama_python(None)
    except InvalidParameterError:
        return None
    gguf = gguf_path("q8_0", "qwen2.5-coder-0.5b", "f")
    return (python, gguf) if gguf.is_file() else None


@pytest.mark.slow  # loads Qwen2.5-Coder-0.5B in tandem (fp32) and in llama.cpp (Q8_0, a child process)
@pytest.mark.skipif(_real_peer() is None, reason="no peer venv with llama_cpp, or no 0.5B Q8_0 GGUF in the peer cache")
def test_real_q8_0_is_close_to_tandem_fp32(tmp_path):
    from tandem.bench.speculation.quality import run_quality_bench

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"domain": "code", "prompt": "Write a Python function that adds two numbers."}) + "\n")
    config = QualityBenchConfig(model="qwen2.5-coder-0.5b", weights=("fp32",), max_tokens=12, domains=("code",), prompts=str(prompts),
                                peers=("llama",), llama_gguf=("q8_0",))
    result = run_quality_bench(config)
    q8 = result["weights"]["llama:Q8_0"]["overall"]
    assert result["peers"]["llama:Q8_0"]["file_type"] == "Q8_0" and result["continuation_tokens"] == 12
    assert abs(q8["continuation_logprob_delta"]) <= 0.1
    assert q8["top1_agreement"] >= 0.8
    assert q8["prompt_logprob"] == pytest.approx(result["weights"]["fp32"]["overall"]["prompt_logprob"], abs=0.1)
