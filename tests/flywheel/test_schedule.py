"""The shift detector and the trainer's step schedule: exact values on hand-made acceptance streams."""
import pytest

from tandem.errors import InvalidParameterError
from tandem.flywheel.schedule import ShiftDetector, ShiftDetectorConfig, StepSchedule, StepScheduleConfig

CFG = ShiftDetectorConfig(fast=4, slow=8, min_baseline=4, drop=0.2, cooldown=6)


def fire_at(values, cfg=CFG):
    detector = ShiftDetector(cfg)
    return [i for i, v in enumerate(values) if detector.observe(v)], detector


def test_a_drop_fires_once_at_the_first_request_whose_window_mean_is_below_the_threshold():
    # baseline 2.0; after the shift 1.0 each: recent means 1.75, 1.5, 1.25 -> 1.5 < 0.8 * 2.0 = 1.6 at the 2nd new
    # request; then both windows restart from the 1.0s, which never drop further
    fired, detector = fire_at([2.0] * 10 + [1.0] * 10)
    assert fired == [11] and detector.shifts == [11]


def test_steady_or_rising_acceptance_never_fires():
    assert fire_at([2.0] * 30)[0] == []
    assert fire_at([1.0] * 10 + [3.0] * 20)[0] == []
    assert fire_at([2.0, 1.7] * 15)[0] == []  # noise within the drop


def test_no_alarm_before_the_baseline_has_min_baseline_requests():
    # fast 4 + min_baseline 4: the detector may fire from the 8th request on, never before
    assert fire_at([2.0] * 3 + [1.0] * 4)[0] == []
    assert fire_at([2.0] * 5 + [1.0] * 5)[0] == [7]


def test_after_a_shift_the_new_level_is_the_baseline_and_a_second_drop_fires_again():
    values = [3.0] * 10 + [2.0] * 14 + [1.0] * 10
    fired, _ = fire_at(values)
    # 3.0 -> 2.0: recent mean 2.5 at request 11 is above 2.4; 2.25 at 12 fires. Cooldown to 18, baseline rebuilt
    # from 2.0s; 2.0 -> 1.0 at request 24: means 1.75 (> 1.6), 1.5 at request 25 fires.
    assert fired == [12, 25]


def test_cooldown_keeps_it_quiet():
    cfg = ShiftDetectorConfig(fast=2, slow=4, min_baseline=2, drop=0.2, cooldown=50)
    fired, _ = fire_at([3.0] * 6 + [2.0] * 8 + [1.0] * 8, cfg)
    assert fired == [7]  # the second drop falls inside the cooldown


def test_schedule_boosts_steps_and_lr_then_decays_linearly():
    schedule = StepSchedule(StepScheduleConfig(steps_per_request=1.0, boost_steps_per_request=5.0, boost_requests=4, boost_lr=3.0))
    assert [schedule.after_request() for _ in range(3)] == [1, 1, 1]
    schedule.shift()
    assert schedule.lr_scale() == 3.0 and schedule.rate() == 5.0
    steps, scales = [], []
    for _ in range(6):
        scales.append(schedule.lr_scale())
        steps.append(schedule.after_request())
    assert steps == [5, 4, 3, 2, 1, 1] and scales == [3.0, 2.5, 2.0, 1.5, 1.0, 1.0]
    assert schedule.boosts == 1


def test_fractional_rates_carry_over():
    schedule = StepSchedule(StepScheduleConfig(steps_per_request=0.5, boost_steps_per_request=0.5, boost_requests=1, boost_lr=1.0))
    assert [schedule.after_request() for _ in range(6)] == [0, 1, 0, 1, 0, 1]
    tenth = StepSchedule(StepScheduleConfig(0.1, 0.1, 1, 1.0))
    assert sum(tenth.after_request() for _ in range(10)) == 1  # 0.1 x 10 is 0.999... in floating point: still one step


def test_bad_settings_are_refused():
    with pytest.raises(InvalidParameterError):
        ShiftDetectorConfig(drop=1.5)
    with pytest.raises(InvalidParameterError):
        ShiftDetectorConfig(slow=4, min_baseline=8)
    with pytest.raises(InvalidParameterError):
        StepScheduleConfig(steps_per_request=2.0, boost_steps_per_request=1.0)
    with pytest.raises(InvalidParameterError):
        StepScheduleConfig(boost_lr=0.5)


def test_flywheel_setup_builds_a_flat_or_a_boosted_schedule():
    from tandem.flywheel.setups import FlywheelSetup

    flat, detector = FlywheelSetup(shift_detect=False).schedule(0.5)
    assert detector is None and [flat.after_request() for _ in range(4)] == [0, 1, 0, 1] and flat.lr_scale() == 1.0
    boosted, detector = FlywheelSetup(shift_detect=True, boost_steps_per_request=3.0, boost_requests=2, boost_lr=2.0, shift_drop=0.3).schedule(1.0)
    assert detector.cfg.drop == 0.3
    boosted.shift()
    assert (boosted.lr_scale(), boosted.after_request(), boosted.lr_scale(), boosted.after_request(), boosted.after_request()) == (2.0, 3, 1.5, 2, 1)
    assert FlywheelSetup(sample="domains").loss({}, "static").sample == "domains"


def test_default_detector_ignores_per_request_noise_and_catches_a_real_drop():
    """Per-request acceptance around 1.45 (sd ~0.3, as the general head serves the Aurora stream): the default
    windows stay quiet for 600 requests where an 8-request window fires; a 20 % drop fires within 32 requests."""
    import random

    rng = random.Random(0)
    noisy = [max(1.0, rng.gauss(1.45, 0.3)) for _ in range(600)]
    assert fire_at(noisy, ShiftDetectorConfig())[0] == []
    assert fire_at(noisy, ShiftDetectorConfig(fast=8, slow=48, cooldown=16))[0] != []  # the old windows: false alarms
    dropped = noisy[:300] + [v * 0.8 for v in noisy[300:]]
    fired = fire_at(dropped, ShiftDetectorConfig())[0]
    assert len(fired) == 1 and 300 <= fired[0] < 332
