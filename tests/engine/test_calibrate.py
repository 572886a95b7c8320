"""Calibration: measure + fit on a tiny model, store per model + machine, load at controller start."""
import dataclasses
import time

import pytest
import torch

from tandem.config import EngineConfig
from tandem.drafters import build_drafter
from tandem.drafters.ngram import NgramDrafter
from tandem.engine.calibrate import CalibrationGrid, calibrate, calibration_path, fingerprint, fit_draft_cost, resolve_calibration
from tandem.engine.control import SpeculationController
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError
from tandem.sim.calibration import load_calibration, save_calibration
from tandem.sim.speculative import DraftCost
from tiny_helpers import GREEDY, load_packed, make_prompts, plain_outputs

TINY_GRID = CalibrationGrid((1, 2), (1, 2, 4), (8,), 1, (1, 2), (1,))


@pytest.fixture(scope="module")
def record(tiny_dirs):
    torch.set_num_threads(2)  # the fingerprint records the thread count; the autouse fixture sets 2 later
    model = load_packed(tiny_dirs["llama"])
    factory = lambda: build_drafter("ngram", target=model, num_draft_tokens=2)  # noqa: E731
    return model, calibrate(model, "tiny", {"ngram": factory}, quick=True, grid=TINY_GRID)


def test_record_has_fit_and_drafter_cost(record):
    _, rec = record
    assert rec.model == "tiny" and rec.fingerprint == fingerprint()
    assert len(rec.measured["timings"]) == 2 * 3 * 1
    assert rec.machine.bandwidth > 0 and rec.measured["fit_rms_rel_error"] >= 0
    assert "ngram" in rec.drafters and rec.stale_reason(fingerprint()) is None


def test_save_load_roundtrip_and_staleness(record, tmp_path):
    _, rec = record
    path = save_calibration(rec, tmp_path / "c.json")
    assert load_calibration(path) == rec
    other = dict(rec.fingerprint, cpu="another cpu")
    assert "another machine" in rec.stale_reason(other)
    rebuilt = dict(rec.fingerprint, kernels="small_gemm-000000000000")  # the CPU kernels changed since the record
    assert "another machine" in rec.stale_reason(rebuilt) and calibration_path("tiny", rebuilt) != calibration_path("tiny")
    old = dataclasses.replace(rec, created=time.time() - 90 * 86400)
    assert "days old" in old.stale_reason(fingerprint())
    with pytest.raises(InvalidParameterError):
        load_calibration(tmp_path / "missing.json")


def test_resolve_missing_falls_back_with_a_message(record, tmp_path, monkeypatch, capsys):
    model, rec = record
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    drafter = build_drafter("ngram", target=model, num_draft_tokens=2)
    assert resolve_calibration(model, drafter, None, "tiny", recalibrate=False) is None
    assert "online-measured" in capsys.readouterr().err
    save_calibration(rec, calibration_path("tiny"))
    assert resolve_calibration(model, drafter, None, "tiny", recalibrate=False) == rec


def test_fit_draft_cost_known_answer():
    grid = [(d, d * b, b) for d in (1, 2, 4) for b in (1, 4)] + [(2, 3, 4), (4, 5, 1)]
    samples = [(d, n, b, 0.002 + 0.01 * d + 0.001 * n + 0.005 * b) for d, n, b in grid] * 4
    cost = fit_draft_cost(samples)
    assert cost.fixed_s == pytest.approx(0.002, abs=1e-9) and cost.per_depth_s == pytest.approx(0.01, abs=1e-9)
    assert cost.per_node_s == pytest.approx(0.001, abs=1e-9) and cost.per_sequence_s == pytest.approx(0.005, abs=1e-9)


def test_controller_from_calibration_keeps_greedy_identity(record, tiny_dirs):
    model, rec = record
    drafter = build_drafter("ngram", target=model, num_draft_tokens=4, max_batch=4, max_len=256)
    policy = SpeculationController.for_engine(model, drafter, calibration=rec)
    assert policy.forward.machine == rec.machine and policy.draft.current == rec.drafters["ngram"]
    prompts = [p * 3 for p in make_prompts(4)]
    engine = Engine(model, EngineConfig(max_batch_size=4, max_model_len=256), drafter=drafter, draft_policy=policy)
    outs = [r.output_ids for r in engine.run(prompts, [GREEDY] * 4)]
    assert outs == plain_outputs(model, prompts, [GREEDY] * 4)
    m = policy.metrics()
    assert m["steps"] == engine.stats.steps and sum(m["shape_rows"].values()) == engine.stats.request_steps  # one shape per row-step
    assert isinstance(DraftCost(**m["draft_cost"]), DraftCost)


def test_llm_adaptive_k_uses_the_controller(tiny_llama, tmp_path, monkeypatch, capsys):
    from tandem.llm import LLM

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    llm = LLM(tiny_llama, drafter="ngram", adaptive_k=True, max_model_len=128, max_batch_size=2)
    assert isinstance(llm.engine.draft_policy, SpeculationController)
    assert "online-measured" in capsys.readouterr().err  # no calibration stored for this model here
    prompt = make_prompts(1)[0] * 3
    assert llm.generate([prompt], GREEDY)[0].token_ids == plain_outputs(llm.target, [prompt], [GREEDY])[0]
    assert llm.engine.draft_policy.metrics()["steps"] > 0


class _BranchingNgram(NgramDrafter):
    """A real ngram drafter that remembers whether it proposed a branching tree (to tell a tree from a chain afterwards)."""

    def __init__(self, **options):
        super().__init__(**options)
        self.branched = False

    def propose(self, requests, budgets):
        drafts = super().propose(requests, budgets)
        self.branched = self.branched or any(not d.is_chain for d in drafts)
        return drafts


def test_recalibrate_measures_the_drafter_through_the_callers_factory(record, tmp_path, monkeypatch, capsys):
    model, _ = record
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    served = NgramDrafter(num_draft_tokens=3, candidates=3)  # a tree: rebuilding "ngram" by name would give a chain
    built = []

    def factory():  # the caller's: same options as the served drafter
        built.append(_BranchingNgram(num_draft_tokens=3, candidates=3))
        return built[-1]

    rec = resolve_calibration(model, served, None, "tiny", recalibrate=True, drafter_factory=factory)
    assert "tiny missing: measuring now (quick)" in capsys.readouterr().err
    assert len(built) == 1 and built[0].branched  # it drafted trees
    assert set(rec.drafters) == {"ngram"} and rec.measured["quick"] is True
    assert load_calibration(calibration_path("tiny")) == rec
    assert resolve_calibration(model, served, None, "tiny", recalibrate=True, drafter_factory=factory) == rec
    assert len(built) == 1  # a fresh record with the drafter's cost is used as stored


def test_recalibrate_without_a_factory_measures_the_target_only(record, tmp_path, monkeypatch, capsys):
    model, _ = record
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    served = NgramDrafter(num_draft_tokens=3, candidates=3)
    rec = resolve_calibration(model, served, None, "tiny", recalibrate=True)
    err = capsys.readouterr().err
    assert "measuring now" in err and "no drafter factory given: calibrating the target only" in err
    assert rec.drafters == {} and load_calibration(calibration_path("tiny")) == rec
    assert resolve_calibration(model, served, None, "tiny", recalibrate=True) == rec  # nothing to add without a factory
    built = []
    factory = lambda: built.append(1) or NgramDrafter(3, candidates=3)  # noqa: E731
    again = resolve_calibration(model, served, None, "tiny", recalibrate=True, drafter_factory=factory)
    assert "has no cost for drafter ngram: measuring now" in capsys.readouterr().err
    assert built == [1] and set(again.drafters) == {"ngram"} and load_calibration(calibration_path("tiny")) == again


def test_controller_passes_the_factory_to_recalibration(record, tmp_path, monkeypatch):
    model, _ = record
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    built = []

    def factory():
        built.append(NgramDrafter(num_draft_tokens=3, candidates=3))
        return built[-1]

    policy = SpeculationController.for_engine(model, NgramDrafter(num_draft_tokens=3, candidates=3), model_name="tiny",
                                              recalibrate=True, drafter_factory=factory)
    stored = load_calibration(calibration_path("tiny"))
    assert len(built) == 1 and policy.draft.current == stored.drafters["ngram"] and policy.forward.machine == stored.machine


def test_timings_flat_in_the_tokens_calibrate_from_the_measured_rates(tiny_dirs, monkeypatch):
    """A tiny model's forwards cost the same at any width (overhead only): no roofline fits them, and calibrate used to
    raise (a fresh-clone make test failed on it); it now keeps the measured bandwidth and matmul rate, overhead = the
    fastest forward."""
    from tandem.engine import calibrate as calib
    from tandem.models.loader import load_transformer
    from tandem.sim.fit import Timing

    flat = [Timing(b, t, 64, 0.001) for b in (1, 4) for t in (1, 3, 6)]
    monkeypatch.setattr(calib, "measure_forward", lambda model, grid: flat)
    monkeypatch.setattr(calib, "measure_bandwidth", lambda size_mb: 2e10)
    monkeypatch.setattr(calib, "measure_matmul_flops", lambda n: 1e11)
    rec = calib.calibrate(load_transformer(tiny_dirs["llama"]), "tiny", quick=True)
    assert (rec.machine.bandwidth, rec.machine.peak_flops, rec.machine.overhead_s) == (2e10, 1e11, 0.001)
    assert rec.machine.source == "measured rates; no roofline fit"
