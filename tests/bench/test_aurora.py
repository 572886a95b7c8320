"""bench aurora: a run directory keeps each finished variant, refuses other settings, and --jobs children replay
the same thing the serial run does (slow: the real SmolLM2 target)."""
import json

import pytest

from tandem.bench.flywheel.aurora import AuroraConfig, run_aurora
from tandem.errors import InvalidParameterError


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
