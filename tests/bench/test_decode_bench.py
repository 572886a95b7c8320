"""`tandem bench decode` and `tandem bench forward` run end to end on a tiny model and report what they promise."""
import json

import pytest

from tandem.bench.speculation.decode import DecodeBenchConfig
from tandem.cli import main
from tandem.errors import InvalidParameterError


def test_bench_decode_on_a_user_prompt_file(tiny_llama, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"domain": "code", "prompt": "abcabcabc abc"},
        {"domain": "sql", "prompt": "select select select"},
        {"domain": "sql", "prompt": "from x from x from"},
    ]))
    out = tmp_path / "out.json"
    assert main(["bench", "decode", "--model", tiny_llama, "--drafters", "ar,ngram,self_draft", "--prompts", str(prompts),
                 "--max-tokens", "8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for name in ("ar", "ngram", "self_draft"):
        entry = result["drafters"][name]
        assert set(entry["per_domain"]) == {"code", "sql"}
        for summary in [entry["overall"], *entry["per_domain"].values()]:
            assert {"tokens_per_s", "acceptance_length", "speedup_vs_ar", "greedy_matches_ar"} <= set(summary)
            assert summary["greedy_matches_ar"] is True
    assert result["drafters"]["ar"]["overall"]["speedup_vs_ar"] == 1.0
    assert result["drafters"]["self_draft"]["overall"]["acceptance_length"] > 1.0


@pytest.mark.slow  # measures memory bandwidth over 512 MB and times 7 forward sizes
def test_bench_forward_reports_roofline_and_costs(tiny_llama, tmp_path):
    out = tmp_path / "fwd.json"
    assert main(["bench", "forward", "--model", tiny_llama, "--max-tokens", "8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"ar_tokens_per_s", "hf_ar_tokens_per_s", "roofline_tokens_per_s", "cost_ratio"} <= set(result)
    assert set(result["cost_ratio"]) == {"1", "2", "3", "4", "5", "8", "16"} and result["cost_ratio"]["1"] == 1.0
    assert result["greedy_matches_hf"] is True


def test_drafter_path_per_drafter():
    from tandem.bench.speculation.decode import drafter_path_for

    assert drafter_path_for("eagle", "/h") == "/h"
    spec = "eagle=/e,mtp=/m"
    assert [drafter_path_for(n, spec) for n in ("eagle", "eagle_tree", "mtp", "ngram")] == ["/e", "/e", "/m", None]


def test_int8_runners_are_checked_against_plain_int8_decoding(tiny_llama, tmp_path):
    from tandem.models import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip(f"int8 weights need the small-M kernel: {cpu_gemm.unusable_reason()}")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"domain": "code", "prompt": "abcabcabc abc abcabc"}))
    out = tmp_path / "out.json"
    assert main(["bench", "decode", "--model", tiny_llama, "--drafters", "ngram@int8,ar,ar@int8", "--prompts", str(prompts),
                 "--max-tokens", "12", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["drafters"]
    assert list(result) == ["ar", "ar@int8", "ngram@int8"]  # references run first
    assert result["ngram@int8"]["overall"]["greedy_matches_ar"] is True  # against ar@int8
    assert result["ngram@int8"]["overall"]["tokens"] == result["ar@int8"]["overall"]["tokens"] == 12
    assert result["ngram@int8"]["overall"]["greedy_match_share"] == 1.0 and result["ar"]["overall"]["greedy_match_share"] is None


def test_weights_option_serves_the_base_target_at_those_weights(tiny_llama, tmp_path):
    from tandem.models import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip(f"int8 weights need the small-M kernel: {cpu_gemm.unusable_reason()}")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"domain": "code", "prompt": "abcabcabc abc abcabc"}))
    out = tmp_path / "out.json"
    assert main(["bench", "decode", "--model", tiny_llama, "--drafters", "ar,ngram", "--weights", "int8", "--prompts", str(prompts),
                 "--max-tokens", "12", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["weights"] == "int8" and result["drafters"]["ngram"]["overall"]["greedy_match_share"] == 1.0


def test_int8_runners_need_their_reference():
    from tandem.bench.speculation.decode import DecodeBenchConfig
    from tandem.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="ar@int8"):
        DecodeBenchConfig(drafters=("ar", "ngram@int8"))
    with pytest.raises(InvalidParameterError, match="ar@int4"):
        DecodeBenchConfig(drafters=("ar", "ar@int8", "ngram@int4"))
    with pytest.raises(InvalidParameterError, match="after '@'"):
        DecodeBenchConfig(drafters=("ar", "ngram@fp16"))


def test_peers_are_named_from_a_known_list_and_ortg_says_what_it_lacks(tmp_path):
    from tandem.bench.speculation.decode import DecodeBenchConfig
    from tandem.bench.peers.peers import ortg_paths
    from tandem.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="unknown"):
        DecodeBenchConfig(peers=("vllm",))
    with pytest.raises(InvalidParameterError, match="no Python"):
        ortg_paths(str(tmp_path / "missing-python"), None)
    python = tmp_path / "python"
    python.write_text("")
    with pytest.raises(InvalidParameterError, match="not an onnxruntime-genai model"):
        ortg_paths(str(python), str(tmp_path))


def _peer_harness_ortg():
    from tandem.bench.peers.peers import ortg_paths

    try:
        return ortg_paths(None, None)
    except Exception:
        return None


@pytest.mark.slow  # loads the peer harness's fp32 SmolLM2 in onnxruntime-genai (a child process)
@pytest.mark.skipif(_peer_harness_ortg() is None, reason="no peer harness (../shared/peers) set up on this machine")
def test_ortg_peer_decodes_greedily_in_its_own_process():
    from tandem.bench.peers.peers import OrtgPeer

    python, model_dir = _peer_harness_ortg()
    peer = OrtgPeer(python, model_dir, threads=1, eos=[2])
    try:
        prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2]
        plain, ngram = peer.generate(prompt, 12, "plain"), peer.generate(prompt, 12, "ngram")
        assert 1 <= len(plain) <= 12 and plain == ngram  # its n-gram decoding is lossless too
        with pytest.raises(RuntimeError, match="onnxruntime-genai peer"):
            peer.generate(prompt, 12, "no-such-mode")
        assert peer.generate(prompt, 4, "plain") == plain[:4]  # max_tokens respected, greedy prefix
    finally:
        peer.close()


def test_tree_shape_reaches_the_tree_drafters(tiny_llama, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"domain": "code", "prompt": "abcabcabc abc"}))
    drafted = {}
    for tree in ("3,3,2", "9,3,3"):
        out = tmp_path / f"{tree}.json"
        assert main(["bench", "decode", "--model", tiny_llama, "--drafters", "ar,eagle,eagle_tree", "--prompts", str(prompts),
                     "--max-tokens", "32", "--tree", tree, "--json", str(out)]) == 0
        result = json.loads(out.read_text())["drafters"]
        assert result["eagle_tree"]["overall"]["greedy_matches_ar"] is True
        drafted[tree] = (result["eagle"]["overall"]["mean_draft_length"], result["eagle_tree"]["overall"]["mean_draft_length"])
    assert drafted["3,3,2"][0] == drafted["9,3,3"][0]  # chains are not trees: unchanged
    assert drafted["3,3,2"][1] <= 3 < drafted["9,3,3"][1] <= 9


def test_tree_option_is_checked():
    assert main(["bench", "decode", "--tree", "3,3"]) == 1  # a clear error, before any model loads
    with pytest.raises(InvalidParameterError, match="TOPK"):
        DecodeBenchConfig(tree=(3, 0, 2))


def test_rounds_give_each_rate_their_spread_and_the_load(tiny_llama, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [{"domain": "code", "prompt": "abcabcabc abc"}, {"domain": "sql", "prompt": "from x from"}]))
    out = tmp_path / "out.json"
    assert main(["bench", "decode", "--model", tiny_llama, "--drafters", "ar,ngram", "--prompts", str(prompts), "--max-tokens", "6",
                 "--rounds", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    ngram = result["drafters"]["ngram"]
    assert ngram["overall"]["requests"] == 6 and ngram["overall"]["tokens"] == 36  # 2 prompts x 3 rounds x 6 tokens
    assert len(ngram["rounds"]) == 3 and [r["speedup_vs_ar"] for r in result["drafters"]["ar"]["rounds"]] == [1.0, 1.0, 1.0]
    rates = [r["tokens_per_s"] for r in ngram["rounds"]]
    assert ngram["spread"]["tokens_per_s"] == [min(rates), max(rates)]
    assert len(result["load_average"]["rounds"]) == 3 and len(result["load_average"]["end"]) == 3
    assert main(["bench", "decode", "--rounds", "0"]) == 1  # a clear error, before any model loads


def test_engine_timed_outputs_count_their_own_tokens_and_seconds():
    from tandem.bench.speculation.decode import Tally, batch_seconds
    from tandem.bench.peers.peers import PeerOutput

    timed = [PeerOutput([1, 2], count=5, seconds=0.5, metrics={"decode_tokens": 4, "decode_s": 0.25}), PeerOutput([3], count=3, seconds=1.5)]
    assert batch_seconds(timed, wall=9.0) == 2.0  # the tools' own times: process start and model load left out
    assert batch_seconds([PeerOutput([1]), timed[0]], wall=9.0) == 9.0  # one output without its own time: the wall clock
    tally = Tally()
    tally.add(timed[0], 0.5, None)
    summary = tally.summary(None)
    assert (summary["tokens"], summary["tokens_per_s"], summary["decode_tokens_per_s"]) == (5, 10.0, 16.0)
