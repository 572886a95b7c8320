"""bench aurora: a variant scores each request before it trains on it and reports its trainer's core load (tiny
model); a run directory keeps each finished variant, refuses other settings, and --jobs children replay the same
thing the serial run does (slow: the real SmolLM2 target)."""
import json

import pytest

from tandem.bench.flywheel.aurora import AuroraConfig, replay_variant, run_aurora
from tandem.errors import InvalidParameterError

from tiny_helpers import load_packed, make_prompts


def test_a_variant_scores_each_request_before_it_trains_on_it_and_reports_the_trainers_core_load(tiny_llama, monkeypatch):
    """Rung +steps on 8 requests (2 trainer steps after each once the buffer holds 2 traces: after requests 2..8, 14 in
    all; a version published every 10 steps). Version 1 is published by the steps after request 6, so requests 1..6
    are scored by the starting head, exactly as the frozen variant scores them, and requests 7, 8 by version 1.
    The trainer's core load is its step time over the modelled decode time: with a clock that moves 0.25 s per
    trainer step and 1 s per verify (drafting free), 14 x 0.25 s over the requests' verify steps."""
    import types

    import tandem.flywheel.setups as setups
    from tandem.data.prompts import Prompt
    from tandem.flywheel.replay import target_traces
    from tandem.flywheel.stream import prompt_key
    from tandem.flywheel.trainer import OnlineTrainer
    from tandem.models.eagle import EagleConfig

    target = load_packed(tiny_llama)
    stream = [Prompt("code" if i < 4 else "sql", f"prompt {i}", id=str(i)) for i in range(8)]
    ids = dict(zip([prompt_key(p) for p in stream], make_prompts(8, seed=2)))
    traces = target_traces(target, ids, 16, EagleConfig.for_target(target.cfg).taps)
    heads = {"static": setups.scratch_head(target, 200, seed=0)}
    costs = {"verify_s": {t: 1.0 for t in range(1, 6)}, "draft_step_s": 0.0}
    cfg = AuroraConfig(general_head="unused", requests=8, block=2, domains=("code", "sql"), max_tokens=16, steps=2.0)
    now, step = [0.0], OnlineTrainer.train_step

    def timed_step(trainer):
        record = step(trainer)
        now[0] += 0.25 if record is not None else 0.0  # a step taken costs 0.25 s; a wait for traces nothing
        return record

    monkeypatch.setattr(setups, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(OnlineTrainer, "train_step", timed_step)
    frozen = replay_variant("static", cfg, target, stream, traces, heads, costs)["rows"]
    online = replay_variant("+steps", cfg, target, stream, traces, heads, costs)
    rows, extras = online["rows"], online["extras"]
    assert [r["version"] for r in rows] == [0] * 6 + [1] * 2 and [r["version"] for r in frozen] == [0] * 8
    assert [r["acceptance_length"] for r in rows[:6]] == [r["acceptance_length"] for r in frozen[:6]]
    assert (extras["trainer_steps"], extras["trainer_s"], extras["swaps"]["swaps"]) == (14, 3.5, 1)
    outputs = [len(traces[prompt_key(p)].tokens) - traces[prompt_key(p)].prompt_len for p in stream]
    verifies = sum(round((n - 1) / r["acceptance_length"]) for n, r in zip(outputs, rows))  # (output tokens - 1) / acceptance length
    assert extras["modelled_serve_s"] == round(float(verifies), 1) and extras["trainer_core_load"] == round(3.5 / verifies, 3)


@pytest.fixture()
def general_head(tmp_path, monkeypatch):
    """A day-0 head on disk standing in for the general head; the trace cache under a private TANDEM_HOME."""
    from tandem.flywheel.setups import scratch_head
    from tandem.models.eagle import save_eagle
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import models_dir, resolve_model

    target = load_transformer(resolve_model("smollm2-135m"))
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(models_dir())
    (home / "data").symlink_to(models_dir().parent / "data")  # the fetched prompts
    monkeypatch.setenv("TANDEM_HOME", str(home))
    path = tmp_path / "head"
    save_eagle(scratch_head(target, 2048, seed=3), path)
    return str(path)


@pytest.mark.slow
def test_jobs_replay_what_the_serial_run_replays_and_a_rerun_resumes(general_head, tmp_path):
    cfg = AuroraConfig(general_head=general_head, requests=10, block=1, max_tokens=8, steps=1.0, variants=("plain", "static", "+steps"))
    out = tmp_path / "run"
    parallel = run_aurora(cfg, log=lambda _: None, out=out, jobs=2)
    assert sorted(p.name for p in (out / "variants").iterdir()) == ["+steps.json", "plain.json", "static.json"]
    assert len(list((tmp_path / "home" / "replay").glob("*/traces-*.parquet"))) == 2  # the cache filled by two children, once
    serial = run_aurora(cfg, log=lambda _: None)  # in this process, on the children's cache
    assert len(list((tmp_path / "home" / "replay").glob("*/traces-*.parquet"))) == 2
    for name in ("plain", "static"):  # no training: the children replay exactly what the serial run does
        assert [r["acceptance_length"] for r in parallel["requests"][name]] == [r["acceptance_length"] for r in serial["requests"][name]]
    # a step after each request once the buffer holds min_traces (2): after requests 2..10
    assert parallel["summary"]["+steps"]["trainer_steps"] == serial["summary"]["+steps"]["trainer_steps"] == 9
    kept = (out / "variants" / "+steps.json").stat().st_mtime_ns
    again = run_aurora(cfg, log=lambda _: None, out=out, jobs=2)  # resumes: every variant is there, nothing is replayed
    assert (out / "variants" / "+steps.json").stat().st_mtime_ns == kept
    assert again["requests"] == parallel["requests"] and json.loads((out / "costs.json").read_text()) == parallel["costs"]
    with pytest.raises(InvalidParameterError, match="max_tokens"):
        run_aurora(AuroraConfig(general_head=general_head, requests=10, block=1, max_tokens=6, variants=("plain",)), out=out)
    with pytest.raises(InvalidParameterError, match="output directory"):
        run_aurora(cfg, jobs=2)


def test_a_run_directory_refuses_a_rerun_by_other_code(general_head, tmp_path, monkeypatch):
    import tandem.bench.flywheel.aurora as aurora

    cfg = AuroraConfig(general_head=general_head, requests=10, block=1, max_tokens=8, variants=("plain",))
    aurora.VariantRuns(tmp_path / "run", cfg)
    aurora.VariantRuns(tmp_path / "run", cfg)  # the same code and settings: resumes
    monkeypatch.setattr(aurora, "source_sha256", lambda: "0" * 64)  # as if a source file had changed since
    with pytest.raises(InvalidParameterError, match="source_sha256"):
        aurora.VariantRuns(tmp_path / "run", cfg)
