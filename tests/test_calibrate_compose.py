"""Calibration's composition (llm layer): `tandem calibrate` and the drafter factories the llm layer builds."""
import json

import pytest

from tandem.cli import main
from tandem.engine.calibrate import FULL_CHAINS, calibration_path
from tandem.sim.calibration import load_calibration
from tiny_helpers import load_packed


@pytest.fixture(scope="module")
def target(tiny_llama):
    return load_packed(tiny_llama)  # before TANDEM_HOME moves: packing loads the CPU kernels built under the real home


def test_tandem_calibrate_stores_and_writes_the_record(target, tiny_llama, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    out = tmp_path / "c.json"
    assert main(["calibrate", "--model", tiny_llama, "--drafter", "ngram,ngram_tree", "--quick", "--threads", "1", "--json", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    stored = calibration_path(tiny_llama)
    assert printed["stored"] == str(stored) and stored.parent == tmp_path / "home" / "calibration"
    record = load_calibration(stored)
    assert load_calibration(out) == record and record.model == tiny_llama and record.measured["quick"] is True
    assert sorted(record.drafters) == sorted(printed["drafters"]) == ["ngram", "ngram_tree"]
    assert len(record.measured["timings"]) == 3 * 3 * 1  # the quick grid: 3 batches x 3 token counts x 1 context


def test_the_calibration_factory_keeps_the_drafters_options(target):
    from tandem.llm import calibration_drafter_factory

    factory = calibration_drafter_factory("eagle_tree", target, 3, drafter_path="day0", max_nodes=5, tree_topk=2, min_confidence=0.5,
                                          max_batch=2)
    first, second = factory(), factory()
    assert first is not second and first.name == "eagle_tree"
    assert (first.k, first.tree.mode, first.tree.max_nodes, first.tree.topk) == (3, "dynamic", 5, 2)  # the served drafter's own
    assert first.min_confidence == FULL_CHAINS and first.cache.max_batch == 16  # as calibration measures: full chains, 16 rows
