"""`tandem demo`: which head it starts from, and a small real run (slow)."""
import pytest

import tandem.demo as demo
from tandem.flywheel.setups import DEFAULTS
from tandem.models.eagle import save_eagle

from tiny_helpers import load_packed


def test_demo_starts_from_the_shipped_head_or_says_it_falls_back(tiny_llama, tmp_path, monkeypatch, capsys):
    target = load_packed(tiny_llama)
    monkeypatch.setattr(demo, "STRONG_HEAD", tmp_path / "missing")
    monkeypatch.setattr(demo, "GENERAL_HEAD", tmp_path / "missing-general")
    start = demo.demo_head(target, draft_vocab=200)
    assert "untrained day-0" in start.label and "WARNING" in capsys.readouterr().out
    assert start.min_confidence == 0.0 and start.trained_on == ()  # an untrained head drafts full chains and knows no domain
    save_eagle(start.head, tmp_path / "shipped")
    monkeypatch.setattr(demo, "STRONG_HEAD", tmp_path / "shipped")
    loaded = demo.demo_head(target, draft_vocab=200)
    assert loaded.label.startswith("strong static EAGLE head") and capsys.readouterr().out == ""
    assert loaded.min_confidence > 0.0 and loaded.trained_on is None  # no card: what it trained on is unknown
    for name, tensor in start.head.state_dict().items():
        assert loaded.head.state_dict()[name].equal(tensor)


def test_the_heads_card_says_which_domains_it_never_saw(tiny_llama, tmp_path, monkeypatch):
    """A general head (card of recipe eagle-smollm2-general) trained on chat only; the strong head knows code (the
    per-domain lines say which domains the head never saw)."""
    from tandem.training.pipeline import export_head

    target = load_packed(tiny_llama)
    monkeypatch.setattr(demo, "STRONG_HEAD", tmp_path / "missing")
    monkeypatch.setattr(demo, "GENERAL_HEAD", tmp_path / "missing")  # no shipped head: the day-0 fallback
    save_eagle(demo.demo_head(target, draft_vocab=200).head, tmp_path / "best")
    export_head(tmp_path / "best", tmp_path / "general", "eagle-smollm2-general")
    export_head(tmp_path / "best", tmp_path / "strong", "eagle-smollm2")
    general = demo.demo_head(target, tmp_path / "general")
    assert general.trained_on == ("chat",)
    strong = demo.demo_head(target, tmp_path / "strong")
    assert strong.trained_on == ("code", "sql", "math", "chat", "translation")
    with pytest.raises(Exception, match="missing"):
        demo.demo_head(target, tmp_path / "missing")


@pytest.mark.slow
def test_small_demo_run_on_smollm2(tmp_path, capsys):
    report = demo.run_demo("smollm2-135m", requests=6, block=2, max_tokens=8, out_dir=str(tmp_path), domains=("code", "summary", "sql"))
    out = capsys.readouterr().out
    assert report["identical_outputs"] == {"static": 6, "flywheel": 6} and "SPEEDUP over plain decoding" in out
    assert report["speedup"] == pytest.approx(report["tokens_per_s"]["flywheel"] / report["tokens_per_s"]["plain"], rel=2e-3)
    assert set(report["summary"]) == {"plain", "static", "flywheel"} and (tmp_path / "demo_flywheel.png").exists()
    assert "flywheel over static" in out and "per domain" in out and "last block" in out
    assert report["flywheel_settings"] == DEFAULTS.learning()  # whatever the head: the flywheel's one set of defaults


def test_per_domain_lines_compare_all_blocks_and_the_last_block(capsys):
    """Stream code, sql, code in blocks of 2: code's last block is its second visit (rows 4-5)."""
    def rows(tps, accept):
        return [{"domain": d, "tokens_per_s": t, "acceptance_length": a} for d, t, a in zip(["code"] * 2 + ["sql"] * 2 + ["code"] * 2, tps, accept)]

    results = {"plain": rows([10] * 6, [1.0] * 6), "static": rows([20] * 6, [2.0] * 6),
               "flywheel": rows([20, 20, 18, 18, 30, 30], [2.0, 2.0, 1.8, 1.8, 3.0, 3.0])}
    demo._per_domain(results, 2, ("code", "sql"), ("chat",))
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "  code: the head never saw it"
    assert lines[3].split() == ["all", "blocks", "25.0", "20.0", "(1.25x)", "2.500", "2.000"]
    assert lines[4].split() == ["last", "block", "30.0", "20.0", "(1.50x)", "3.000", "2.000"]
    assert lines[7].split() == ["last", "block", "18.0", "20.0", "(0.90x)", "1.800", "2.000"]


def test_adaptive_k_flag_reaches_the_demo(monkeypatch):
    """`tandem demo --adaptive-k`: static and flywheel draft under the speculation controller (off by default)."""
    from tandem.cli import main

    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda *args, **kwargs: seen.append(kwargs["adaptive_k"]))
    assert main(["demo", "--requests", "2"]) == 0 and main(["demo", "--requests", "2", "--adaptive-k"]) == 0
    assert seen == [False, True]


def test_step_costs_weigh_each_request_by_its_decode_steps():
    from tandem.demo import step_costs

    rows = [{"steps": 10, "drafted_per_step": 2.0, "draft_s": 0.02, "verify_s": 0.2},
            {"steps": 30, "drafted_per_step": 4.0, "draft_s": 0.12, "verify_s": 0.6}]
    costs = step_costs(rows)
    assert costs["drafted_per_step"] == pytest.approx((10 * 2 + 30 * 4) / 40)  # 3.5, not the rows' mean 3.0
    assert costs["draft_ms"] == pytest.approx(1000 * 0.14 / 40)  # 3.5 ms a step
    assert costs["verify_ms"] == pytest.approx(1000 * 0.8 / 40)  # 20 ms a step
    assert step_costs([]) == {"drafted_per_step": 0.0, "draft_ms": 0.0, "verify_ms": 0.0}
