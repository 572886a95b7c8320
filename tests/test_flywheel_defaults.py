"""One set of flywheel defaults: every entry point resolves the learning settings of tandem.flywheel.setups.DEFAULTS."""
import pytest

from tandem.flywheel.setups import DEFAULTS, LEARNING, FlywheelSetup


def test_the_defaults_are_the_settings_measured_best():
    """docs/BENCHMARKS.md 10: lr 3e-4 from a trained head, no anchor, domain-balanced replay with half of each batch
    from the 32 newest traces, the shift detector warming the lr, and the step rate one trainer core affords."""
    assert (DEFAULTS.finetune_lr, DEFAULTS.anchor, DEFAULTS.sample, DEFAULTS.recent_share, DEFAULTS.recent_window) == (3e-4, 0.0, "domains", 0.5, 32)
    assert (DEFAULTS.steps_per_request, DEFAULTS.shift_detect, DEFAULTS.boost_steps_per_request, DEFAULTS.lr) == (None, True, 0.0, 1e-3)
    loss = DEFAULTS.loss({}, "static")
    assert (loss.lr, loss.anchor, loss.sample, loss.recent_share, loss.discard_weight) == (3e-4, 0.0, "domains", 0.5, 0.0)
    assert FlywheelSetup().learning() == DEFAULTS.learning() and set(DEFAULTS.learning()) == set(LEARNING)


def entry_point_setups(tmp_path) -> dict:
    from tandem.bench.flywheel.aurora import AuroraConfig, variant_config
    from tandem.bench.flywheel.shift import ShiftConfig
    from tandem.drafters.eagle import TRAINED_MIN_CONFIDENCE
    from tandem.flywheel.setups import demo_setup
    from tandem.server.runtime import ServerConfig, flywheel_setup

    return {
        "serve --online": flywheel_setup(ServerConfig(drafter="eagle", online=True, drafter_path=str(tmp_path))),
        "serve --online, day 0": flywheel_setup(ServerConfig(drafter="eagle", online=True, num_draft_tokens=3, publish_every=7)),
        "bench shift": ShiftConfig().setup,
        "bench aurora, online": variant_config("+recent", AuroraConfig(general_head=str(tmp_path)))[1].setup,
        "demo": demo_setup(TRAINED_MIN_CONFIDENCE),
        "flywheel_costs (the demo's)": demo_setup(TRAINED_MIN_CONFIDENCE, trainer_process=True),
    }


def test_every_entry_point_resolves_the_same_defaults(tmp_path):
    setups = entry_point_setups(tmp_path)
    assert {name: setup.learning() for name, setup in setups.items()} == {name: DEFAULTS.learning() for name in setups}
    assert setups["serve --online, day 0"].publish_every == 7 and setups["serve --online, day 0"].num_draft_tokens == 3  # explicit overrides


def test_an_explicit_override_still_wins():
    from tandem.bench.flywheel.shift import ShiftConfig

    assert ShiftConfig(train_steps_per_request=1.4, anchor=10.0).setup.learning() == DEFAULTS.learning() | {"steps_per_request": 1.4, "anchor": 10.0}
    with pytest.raises(Exception, match="steps_per_request"):
        FlywheelSetup(steps_per_request=-1.0)
