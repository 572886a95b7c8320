"""bench shift: the stream, the recovery measure, the summary and plot; a small real replay run (slow)."""
import json

import pytest

from tandem.bench.flywheel.shift import ShiftConfig
from tandem.flywheel.stream_stats import recovery, rolling, summarize
from tandem.errors import InvalidParameterError
from tandem.flywheel.setups import MODES


def rows(values, block, domains=("code", "sql")):
    return [{"i": i, "domain": domains[(i // block) % len(domains)], "acceptance_length": v, "tokens_per_s": 10.0 * v, "version": 0}
            for i, v in enumerate(values)]


def test_rolling_mean():
    assert rolling([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5]


def test_recovery_counts_requests_until_the_rolling_mean_is_back():
    # block 1 at 2.0; after the shift 1.0, 1.0, then 2.0s: rolling-2 reaches 0.9 * 2.0 = 1.8 at the 4th request
    values = [2.0] * 6 + [1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    (shift,) = recovery(rows(values, 6), block=6, window=2)
    assert shift == {"at": 6, "domain": "sql", "previous_level": 2.0, "requests": 4}
    (never,) = recovery(rows([2.0] * 6 + [1.0] * 6, 6), block=6, window=2)
    assert never["requests"] is None


def test_summary_ratios_against_static():
    cfg = ShiftConfig(requests=12, block=6, domains=("code", "sql"), window=2, modes=("plain", "static", "online"))
    plain = [dict(r, acceptance_length=1.0, tokens_per_s=8.0) for r in rows([1.0] * 12, 6)]
    summary = summarize({"plain": plain, "static": rows([1.0] * 12, 6), "online": rows([1.5] * 12, 6)}, cfg)
    assert summary["online"]["ratio_to_static"] == 1.5 and summary["static"]["ratio_to_static"] == 1.0
    assert summary["online"]["tokens_per_s_ratio_to_plain"] == 1.875 and summary["plain"]["tokens_per_s_ratio_to_plain"] == 1.0
    assert summary["online"]["per_domain"] == {"code": 1.5, "sql": 1.5}
    assert summary["online"]["recovered_shifts"] == "1/1"


def test_summary_of_the_deployed_drafter_against_static():
    """Replayed with the lookup branch, rows carry the deployed drafter's acceptance: its mean and ratio to static's."""
    cfg = ShiftConfig(requests=12, block=6, domains=("code", "sql"), window=2, modes=("static", "online"))
    deployed = lambda values, extra: [dict(r, deployed_acceptance_length=r["acceptance_length"] + extra) for r in rows(values, 6)]  # noqa: E731
    summary = summarize({"static": deployed([1.0] * 12, 1.0), "online": deployed([1.5] * 12, 0.5)}, cfg)
    assert summary["static"]["mean_deployed_acceptance_length"] == 2.0 and summary["static"]["deployed_ratio_to_static"] == 1.0
    assert summary["online"]["mean_deployed_acceptance_length"] == 2.0 and summary["online"]["deployed_ratio_to_static"] == 1.0
    assert summary["online"]["ratio_to_static"] == 1.5  # the chain gained 1.5x; as deployed, nothing
    assert "mean_deployed_acceptance_length" not in summarize({"static": rows([1.0] * 12, 6)}, cfg)["static"]


def test_plot_is_written(tmp_path):
    from tandem.flywheel.stream_plot import plot_shift

    cfg = ShiftConfig(requests=12, block=6, domains=("code", "sql"), window=2)
    path = plot_shift({"static": rows([1.0] * 12, 6), "online": rows([1.2] * 12, 6)}, cfg, tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_configs_are_refused():
    with pytest.raises(InvalidParameterError):
        ShiftConfig(modes=("static", "telepathy"))
    with pytest.raises(InvalidParameterError):
        ShiftConfig(drafter="ngram")
    assert {"plain", "static", "online", "online_scratch", "online_no_discard", "online_discard"} <= set(MODES)


@pytest.mark.slow
def test_small_replay_run_on_smollm2(tmp_path):
    from tandem.cli import main

    out = tmp_path / "shift.json"
    assert main(["bench", "shift", "--replay", "--requests", "12", "--block", "4", "--domains", "code,sql,chat", "--static-prompts", "4",
                 "--static-steps", "3", "--max-tokens", "16", "--modes", "static,online,online_scratch", "--train-steps-per-request", "1",
                 "--publish-every", "2", "--json", str(out), "--plot", str(tmp_path / "shift.png")]) == 0
    report = json.loads(out.read_text())
    assert set(report["summary"]) == {"static", "online", "online_scratch"}
    assert len(report["requests"]["online"]) == 12 and report["summary"]["online"]["swaps"]["swaps"] >= 1
    online = report["summary"]["online"]  # what the trainer cost against the decode time it ran beside
    # one step after each of 12 requests but the first (a buffer of one trace is below min_traces 2)
    assert online["trainer_steps"] == 11 and online["trainer_step_s"] == pytest.approx(online["trainer_s"] / 11, abs=6e-3)  # trainer_s is rounded to 0.1 s
    # both seconds are rounded to 0.1 s, the load is computed before rounding: it lies between the extremes they allow
    trainer_s, serve_s = online["trainer_s"], online["modelled_serve_s"]
    assert (trainer_s - 0.05) / (serve_s + 0.05) - 1e-3 <= online["trainer_core_load"] <= (trainer_s + 0.05) / (serve_s - 0.05) + 1e-3
    assert "trainer_core_load" not in report["summary"]["static"]
    assert (tmp_path / "shift.png").exists()


def test_per_block_means_and_the_blocks_after_a_domains_first():
    from tandem.flywheel.stream_stats import after_first_block, per_block

    values = [1.0] * 2 + [2.0] * 2 + [1.5] * 2 + [3.0] * 2  # code, sql, code, sql in blocks of 2
    blocks = per_block(rows(values, 2), 2)
    assert [(b["domain"], b["repeat"], b["acceptance_length"]) for b in blocks] == [("code", False, 1.0), ("sql", False, 2.0), ("code", True, 1.5), ("sql", True, 3.0)]
    assert after_first_block(rows(values, 2), 2) == {"code": 1.5, "sql": 3.0}


def test_recovery_within_a_block_against_its_own_final_level():
    from tandem.flywheel.stream_stats import recovery_within_block

    # second block: 1.0, 1.0, then 2.0 x 8; final level (last 2) 2.0; rolling-2 reaches 0.9 * 2.0 at request 4 of 10
    values = [2.0] * 10 + [1.0, 1.0] + [2.0] * 8
    (shift,) = recovery_within_block(rows(values, 10), block=10, window=2)
    assert shift == {"at": 10, "domain": "sql", "final_level": 2.0, "requests": 4, "fraction": 0.4}


def test_aurora_ladder_adds_one_change_per_rung_and_the_recovery_window_fits_the_block():
    from tandem.bench.flywheel.aurora import AuroraConfig, recovery_window, variant_config

    cfg = AuroraConfig(general_head="h", requests=100, block=10, steps=2.0, lr=3e-4, anchor=10.0)
    got = {name: variant_config(name, cfg) for name in ("online_base", "+steps", "+balance", "+detector", "+lr", "+recent", "online_scratch")}
    settings = {n: (m, c.train_steps_per_request, c.sample, c.shift_detect, c.finetune_lr, c.anchor, c.recent_share) for n, (m, c) in got.items()}
    assert settings == {
        "online_base": ("online", 0.5, "uniform", False, 1e-4, 100.0, 0.0), "+steps": ("online", 2.0, "uniform", False, 1e-4, 100.0, 0.0),
        "+balance": ("online", 2.0, "domains", False, 1e-4, 100.0, 0.0), "+detector": ("online", 2.0, "domains", True, 1e-4, 100.0, 0.0),
        "+lr": ("online", 2.0, "domains", True, 3e-4, 10.0, 0.0), "+recent": ("online", 2.0, "domains", True, 3e-4, 10.0, 0.5),
        "online_scratch": ("online_scratch", 2.0, "domains", True, 3e-4, 10.0, 0.5)}
    assert got["+recent"][1].setup.loss({}, "static").recent_share == 0.5  # it reaches the trainer
    schedule, detector = got["+detector"][1].setup.schedule(2.0)  # a detected shift warms the lr, adds no steps
    schedule.shift()
    assert detector is not None and (schedule.lr_scale(), schedule.after_request(), schedule.after_request()) == (2.0, 2, 2)
    assert got["online_scratch"][1].lr == 1e-3  # a day-0 head trains at the scratch lr (anchor off for scratch in FlywheelSetup.loss)
    assert recovery_window(cfg) == 1 and recovery_window(AuroraConfig(general_head="h", requests=3000, block=300)) == 20
    with pytest.raises(InvalidParameterError):
        AuroraConfig(general_head="h", requests=50, block=10)  # each of 5 domains must come back


@pytest.mark.slow
def test_small_live_run_gives_the_trainer_a_core_of_its_own(tmp_path):
    """Live mode: every mode serves on the same cores, the trainer process on its own; nothing is lost and the
    swap stall is reported in decode steps."""
    from tandem.cli import main
    from tandem.flywheel.setups import core_split

    out = tmp_path / "live.json"
    assert main(["bench", "shift", "--requests", "6", "--block", "2", "--domains", "code,sql,chat", "--static-prompts", "4", "--static-steps", "3",
                 "--max-tokens", "12", "--modes", "static,online", "--publish-every", "1", "--sample", "domains", "--recent-share", "0.5",
                 "--live-batch", "2", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    split = core_split()
    static, online = report["summary"]["static"], report["summary"]["online"]
    assert static["lost_requests"] == online["lost_requests"] == 0 and len(report["requests"]["online"]) == 6
    assert static["serving_cores"] == online["serving_cores"] == (list(split[0]) if split else None)
    assert online["trainer_cores"] == (list(split[1]) if split else None)
    assert online["swap_stall_steps"] == pytest.approx(online["swaps"]["max_swap_ms"] / (1000 * online["median_step_s"]), rel=1e-2, abs=1e-3)
    assert report["config"]["recent_share"] == 0.5 and report["config"]["sample"] == "domains"
