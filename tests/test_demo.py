"""`tandem demo`: which head it starts from, and a small real run (slow)."""
import pytest

import tandem.demo as demo
from tandem.models.eagle import save_eagle

from tiny_helpers import load_packed


def test_demo_starts_from_the_shipped_head_or_says_it_falls_back(tiny_llama, tmp_path, monkeypatch, capsys):
    target = load_packed(tiny_llama)
    monkeypatch.setattr(demo, "STRONG_HEAD", tmp_path / "missing")
    monkeypatch.setattr(demo, "GENERAL_HEAD", tmp_path / "missing-general")
    heads, label, cut = demo.demo_heads(target, draft_vocab=200)
    assert "untrained day-0" in label and "WARNING" in capsys.readouterr().out
    assert cut == 0.0  # an untrained head drafts full chains
    save_eagle(heads["static"], tmp_path / "shipped")
    monkeypatch.setattr(demo, "STRONG_HEAD", tmp_path / "shipped")
    loaded, label, cut = demo.demo_heads(target, draft_vocab=200)
    assert label.startswith("strong static EAGLE head") and capsys.readouterr().out == ""
    assert cut > 0.0
    for name, tensor in heads["static"].state_dict().items():
        assert loaded["static"].state_dict()[name].equal(tensor)


@pytest.mark.slow
def test_small_demo_run_on_smollm2(tmp_path, capsys):
    report = demo.run_demo("smollm2-135m", requests=6, block=2, max_tokens=8, out_dir=str(tmp_path), domains=("code", "summary", "sql"))
    out = capsys.readouterr().out
    assert report["identical_outputs"] == {"static": 6, "flywheel": 6} and "SPEEDUP over plain decoding" in out
    assert report["speedup"] == pytest.approx(report["tokens_per_s"]["flywheel"] / report["tokens_per_s"]["plain"], rel=2e-3)
    assert set(report["summary"]) == {"plain", "static", "flywheel"} and (tmp_path / "demo_flywheel.png").exists()
    assert "flywheel over static" in out and "on summary (no recipe trains on it)" in out
    expected = demo.FROM_GENERAL_HEAD if report["head"].startswith("general") else {"finetune_lr": 1e-4, "anchor": 100.0, "sample": "uniform", "recent_share": 0.0}
    assert report["flywheel_settings"] == expected  # a general head is fine-tuned as measured, the strong head gently
