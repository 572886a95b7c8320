"""`tandem bench decode --peers llama`: options and errors, the worker's protocol and acceptance counting (against a
stand-in for llama-cpp-python's interface, tests/bench/fake_llama_cpp), and the real worker where the peer venv is."""
import math
import os
import sys
from pathlib import Path

import pytest

from tandem.bench.speculation.decode import DecodeBenchConfig, Tally, _reference_at
from tandem.bench.peers.llama_peer import LlamaPeer, check_same_tokens, context_size, gguf_path, llama_python
from tandem.bench.peers.peers import PeerOutput
from tandem.errors import InvalidParameterError

FAKE = Path(__file__).with_name("fake_llama_cpp")


@pytest.fixture
def fake_llama(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    return Path(sys.executable)


def test_llama_options_are_checked_before_any_model_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_BENCH_CACHE", str(tmp_path))
    with pytest.raises(InvalidParameterError, match="no GGUF file at .*missing.gguf"):
        DecodeBenchConfig(peers=("llama",), llama_gguf=str(tmp_path / "missing.gguf"))
    with pytest.raises(InvalidParameterError, match="builds from a zoo model"):
        DecodeBenchConfig(model=str(tmp_path), peers=("llama",), llama_gguf="q8_0")
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(InvalidParameterError, match="--llama-draft-gguf .*builds from a zoo model"):
        DecodeBenchConfig(peers=("llama",), llama_gguf=str(gguf), llama_draft_gguf="q8_0")  # no --drafter-model
    with pytest.raises(InvalidParameterError, match="--llama-pld-tokens must be >= 1"):
        DecodeBenchConfig(llama_pld_tokens=0)
    with pytest.raises(InvalidParameterError, match="--weights must be one of"):
        DecodeBenchConfig(weights="fp16")
    with pytest.raises(InvalidParameterError, match="drop --no-pack"):
        DecodeBenchConfig(weights="int8", pack_weights=False)
    assert gguf_path("q8_0", "qwen2.5-coder-1.5b", "f") == tmp_path / "models" / "gguf_zoo" / "qwen2.5-coder-1.5b.Q8_0.gguf"
    assert gguf_path("shipped", "qwen2.5-coder-0.5b", "f") == tmp_path / "models" / "gguf_zoo" / "qwen2.5-coder-0.5b.gguf"
    assert gguf_path(str(gguf), None, "f") == gguf
    DecodeBenchConfig(peers=("llama",), llama_gguf=str(gguf), llama_draft_gguf="shipped", drafter_model="qwen2.5-coder-0.5b")


def test_llama_python_names_the_set_up_command(tmp_path):
    with pytest.raises(InvalidParameterError, match="no Python at .*setup_env.sh venv"):
        llama_python(str(tmp_path / "nope"))
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'llama_cpp'\" >&2\nexit 1\n")
    python.chmod(0o755)
    with pytest.raises(InvalidParameterError, match="cannot import llama_cpp .*No module named 'llama_cpp'.*setup_env.sh venv"):
        llama_python(str(python))


def test_context_and_reference():
    assert context_size([[0] * 10, [0] * 100], 64, 10) == 192  # 100 + 64 + 10 drafts + 1, up to 64
    assert context_size([[0] * 10], 8, 16) == 64 and context_size([[0] * 40], 8, 16) == 128
    drafters = ("ar", "ar@int8", "self_draft@int8")
    assert _reference_at("int8", DecodeBenchConfig(drafters=drafters)) == "ar@int8"
    assert _reference_at("int4", DecodeBenchConfig(drafters=drafters)) == "ar"  # no int4 runner: fp32 plain
    assert _reference_at("int8", DecodeBenchConfig(drafters=("ar", "ngram"), weights="int8")) == "ar"


def test_match_share_counts_prompts():
    tally = Tally()
    tally.add(PeerOutput([1, 2, 3]), 1.0, [1, 2, 3])
    tally.add(PeerOutput([1, 2, 4]), 1.0, [1, 2, 3])
    tally.add(PeerOutput([5]), 1.0, [5])
    summary = tally.summary(None)
    assert summary["greedy_match_share"] == 0.667 and summary["greedy_matches_ar"] is False


def test_worker_protocol_and_acceptance_counts(fake_llama, tmp_path):
    peer = LlamaPeer(fake_llama, tmp_path / "t.gguf", threads=1, eos=[255], n_ctx=64, num_pred_tokens=10,
                     draft_gguf=tmp_path / "d.gguf", draft_tokens=3)
    try:
        assert peer.ready["file_type"] == "Q8_0" and peer.ready["modes"] == ["draft", "plain", "pld"]
        assert peer.tokenize("ab") == [97, 98]
        plain = peer.generate([1, 2, 3], 5, "plain")
        assert plain.token_ids == [4, 5, 6, 7, 8] and plain.metrics is None
        pld = peer.generate([1, 2, 3], 7, "pld")  # rounds: 4 | 5 6 (accepted) 7 | 8 9 (accepted) 10
        assert pld.token_ids == [4, 5, 6, 7, 8, 9, 10]
        assert {k: pld.metrics[k] for k in ("steps", "drafted_tokens", "accepted_tokens", "mean_draft_length")} == \
            {"steps": 2, "drafted_tokens": 6, "accepted_tokens": 4, "mean_draft_length": 3.0}
        draft = peer.generate([1, 2, 3], 9, "draft")  # 4 | 5 6 7 (3 drafted, accepted) 8 | 9 10 11 12
        assert draft.token_ids == list(range(4, 13))
        assert (draft.metrics["steps"], draft.metrics["drafted_tokens"], draft.metrics["accepted_tokens"]) == (2, 6, 6)
        with pytest.raises(RuntimeError, match="llama.cpp peer: ValueError: mode 'beam' not loaded"):
            peer.generate([1], 2, "beam")
        assert peer.generate([1, 2, 3], 2, "plain").token_ids == [4, 5]  # the peer lives on after an error
    finally:
        peer.close()


def test_worker_stops_after_eos_and_counts_a_disagreeing_draft(fake_llama, tmp_path):
    peer = LlamaPeer(fake_llama, tmp_path / "t-q4.gguf", threads=1, eos=[6], n_ctx=64, draft_gguf=tmp_path / "skip.gguf", draft_tokens=3)
    try:
        assert peer.ready["file_type"] == "Q4_K_M"
        assert peer.generate([1, 2, 3], 9, "plain").token_ids == [4, 5, 6]  # the EOS is returned, as tandem returns it
        pld = peer.generate([1, 2, 3], 9, "pld")
        assert pld.token_ids == [4, 5, 6] and (pld.metrics["steps"], pld.metrics["accepted_tokens"]) == (1, 2)
        draft = peer.generate([1, 2, 3], 9, "draft")  # the draft model counts in 2s: nothing accepted; its drafts
        assert draft.token_ids == [4, 5, 6]           # after 4: [6] (it stops at an EOS), after 5: [7, 9, 11]
        assert (draft.metrics["steps"], draft.metrics["drafted_tokens"], draft.metrics["accepted_tokens"]) == (2, 4, 0)
    finally:
        peer.close()


def test_worker_scores_teacher_forced_log_probs(fake_llama, tmp_path):
    peer = LlamaPeer(fake_llama, tmp_path / "t.gguf", threads=1, eos=[255], n_ctx=8, num_pred_tokens=0, score=True)
    try:
        assert peer.ready["score"] is True and peer.ready["modes"] == ["plain"]
        logprobs, argmax = peer.score([10, 11, 12, 20, 20])
        norm = math.log(math.exp(2.0) + math.exp(1.0) + 254)  # after t: logit 2 at t + 1, 1 at t, 0 at the 254 others
        assert logprobs == pytest.approx([2.0 - norm, 2.0 - norm, 0.0 - norm, 1.0 - norm], abs=1e-12)
        assert argmax == [11, 12, 13, 21]
        assert peer.score([30, 31]) == (pytest.approx([2.0 - norm], abs=1e-12), [31])  # from an empty KV cache again
        assert peer.generate([1, 2], 3, "plain").token_ids == [3, 4, 5]  # greedy decoding beside it
        with pytest.raises(RuntimeError, match="score needs 2 to n_ctx = 8 token ids, got 9 .*larger --n-ctx"):
            peer.score(list(range(9)))
        with pytest.raises(RuntimeError, match=r"token ids must be in \[0, 256\)"):
            peer.score([1, 256])
    finally:
        peer.close()
    plain = LlamaPeer(fake_llama, tmp_path / "t.gguf", threads=1, eos=[255], n_ctx=8, num_pred_tokens=0)
    try:
        with pytest.raises(RuntimeError, match="started without --score"):
            plain.score([1, 2])
    finally:
        plain.close()


class _Tokenizer:
    def __init__(self, shift: int = 0):
        self.shift = shift

    def encode(self, text, add_special_tokens=True):
        return [b + self.shift for b in text.encode()]


def test_the_gguf_must_tokenize_like_tandem(fake_llama, tmp_path):
    peer = LlamaPeer(fake_llama, tmp_path / "t.gguf", threads=1, eos=[255], n_ctx=64)
    try:
        check_same_tokens(peer, _Tokenizer(), [255])
        with pytest.raises(InvalidParameterError, match="not the same vocabulary"):
            check_same_tokens(peer, _Tokenizer(shift=1), [255])
        with pytest.raises(InvalidParameterError, match="EOS id 255 is not one of tandem's"):
            check_same_tokens(peer, _Tokenizer(), [2])
    finally:
        peer.close()


def _real_peer():
    """The peer venv's Python and the 0.5B's shipped GGUF, where both are on this machine."""
    try:
        python = llama_python(None)
    except InvalidParameterError:
        return None
    gguf = gguf_path("shipped", "qwen2.5-coder-0.5b", "f")
    return (python, gguf) if gguf.is_file() else None


@pytest.mark.slow  # loads Qwen2.5-Coder-0.5B Q4_K_M in llama.cpp three times (a child process)
@pytest.mark.skipif(_real_peer() is None, reason="no peer venv with llama_cpp, or no shipped 0.5B GGUF in the peer cache")
def test_real_llama_worker_decodes_tandem_token_ids(tmp_path):
    from tandem.llm import load_tokenizer
    from tandem.models.zoo import resolve_model

    python, gguf = _real_peer()
    tokenizer = load_tokenizer(resolve_model("qwen2.5-coder-0.5b"))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that adds two numbers."}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    peer = LlamaPeer(python, gguf, threads=1, eos=[151645, 151643], n_ctx=context_size([ids], 24, 4), draft_gguf=gguf, draft_tokens=4)
    try:
        assert peer.ready["file_type"] == "Q4_K_M"
        check_same_tokens(peer, tokenizer, [151645, 151643])
        plain = peer.generate(list(ids), 24, "plain").token_ids
        assert len(plain) == 24 and "def" in tokenizer.decode(plain)
        draft = peer.generate(list(ids), 24, "draft")  # the target drafting for itself: nearly every token accepted
        assert draft.token_ids[:8] == plain[:8]
        assert draft.metrics["accepted_tokens"] >= 0.8 * draft.metrics["drafted_tokens"] > 0
    finally:
        peer.close()


def test_cli_says_what_the_llama_peer_lacks(tmp_path, capsys):
    from tandem.cli import main

    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    assert main(["bench", "decode", "--model", str(tmp_path / "no-model"), "--peers", "llama", "--llama-gguf", str(gguf),
                 "--llama-modes", "plain,pld", "--llama-python", str(tmp_path / "nope")]) == 1  # before the (missing) target is looked up
    assert "setup_env.sh venv" in capsys.readouterr().err
    assert main(["bench", "decode", "--peers", "llama", "--llama-gguf", str(tmp_path / "missing.gguf")]) == 1
    assert "no GGUF file at" in capsys.readouterr().err
