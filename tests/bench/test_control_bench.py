"""`tandem bench control` end to end on a tiny model, and its summary's arithmetic on known rates."""
import json

import pytest

from tandem.bench.speculation.control import summarize
from tandem.cli import main


def test_summary_picks_the_best_fixed_shape_by_median():
    rates = {"plain": [10.0, 20.0, 10.0], "lookup2": [15.0, 24.0, 12.0], "lookup4": [12.0, 30.0, 14.0], "controller": [15.0, 30.0, 12.0]}
    s = summarize("ngram", 4, rates)
    assert s["best_fixed"] == "lookup2"
    assert s["controller_vs_plain_rounds"] == [1.5, 1.5, 1.2] and s["controller_vs_plain"] == 1.5
    assert s["controller_vs_best_fixed_rounds"] == [1.0, 1.25, 1.0] and s["controller_vs_best_fixed"] == 1.0


def test_bench_control_on_a_tiny_model(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    prompts = tmp_path / "p.jsonl"
    domains = ("code", "sql", "math", "chat", "translation")
    prompts.write_text("\n".join(json.dumps({"domain": d, "prompt": f"{d} {i} a b a b a b"}) for d in domains for i in range(2)))
    out = tmp_path / "c.json"
    assert main(["bench", "control", "--model", tiny_llama, "--drafters", "ngram", "--batch-sizes", "1,4", "--budgets", "1,3",
                 "--max-tokens", "6", "--rounds", "2", "--waves", "2", "--prompts", str(prompts), "--json", str(out), "--threads", "1"]) == 0
    report = json.loads(out.read_text())
    assert [(s["drafter"], s["batch"]) for s in report["settings"]] == [("ngram", 1), ("ngram", 4)] and report["config"]["waves"] == 2
    for s in report["settings"]:
        assert set(s["tok_s"]) == {"plain", "lookup1", "lookup3", "controller"}
        assert len(s["controller_vs_plain_rounds"]) == 2 and s["best_fixed"] in ("lookup1", "lookup3")
    metrics = report["settings"][-1]["controller_metrics"]
    assert set(metrics["shape_rows"]) <= {"plain", "lookup1", "lookup2", "lookup3", "lookup4"}


def test_bench_control_with_quantized_weights_and_a_draft_model(tiny_llama, tmp_path, monkeypatch):
    """--weights and --drafter-model reach the target and the draft_model drafter (the real-size settings: a 1.5B at
    int4 drafted by a 0.5B)."""
    from tandem.models import cpu_gemm

    cpu_gemm.available()  # the int8 kernel from the machine's build, before TANDEM_HOME moves (a fresh home would build it again)
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"domain": d, "prompt": f"{d} a b a b"}) for d in ("code", "sql")))
    out = tmp_path / "c.json"
    assert main(["bench", "control", "--model", tiny_llama, "--weights", "int8", "--drafters", "draft_model", "--drafter-model", tiny_llama,
                 "--batch-sizes", "1", "--budgets", "1,2", "--max-tokens", "6", "--rounds", "1", "--waves", "1", "--prompts", str(prompts),
                 "--json", str(out), "--threads", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["weights"] == "int8" and report["config"]["drafter_model"] == tiny_llama
    [setting] = report["settings"]
    assert setting["drafter"] == "draft_model" and set(setting["tok_s"]) == {"plain", "chain1", "chain2", "controller"}
