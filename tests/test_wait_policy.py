"""`import tandem` picks OpenMP's wait policy (tandem.wait_policy): the user's choice, else spinning on a quiet machine
and PASSIVE where anything else runs."""
import os
import subprocess
import sys

from tandem import QUIET_LOAD, wait_policy


def test_a_quiet_machine_keeps_openmps_spinning_default_and_a_busy_one_sleeps():
    assert QUIET_LOAD == 0.5
    assert wait_policy({}, 0.0) is None
    assert wait_policy({}, 0.49) is None
    assert wait_policy({}, 0.5) == "PASSIVE"
    assert wait_policy({}, 3.0) == "PASSIVE"
    assert wait_policy({}, float("inf")) == "PASSIVE"  # no load average: assumed busy


def test_the_users_choice_is_kept():
    for env in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "10000"}):
        assert wait_policy(env, 0.0) is None and wait_policy(env, 9.0) is None


def test_import_sets_the_policy_it_chose():
    """In a fresh interpreter whose environment names no policy, `import tandem` leaves OMP_WAIT_POLICY as
    wait_policy says for the load it read (compared where the load read around it is clearly on one side)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import os; before = os.getloadavg()[0]; import tandem; print(tandem._policy, os.environ.get('OMP_WAIT_POLICY'), before)"
    policy, environ, load = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert environ == policy  # what it chose is what OpenMP reads ("None": the variable stays unset)
    if float(load) < QUIET_LOAD - 0.1:
        assert policy == "None"
    elif float(load) > QUIET_LOAD + 0.1:
        assert policy == "PASSIVE"


def test_a_peer_runs_at_its_own_default_unless_the_user_chose(monkeypatch):
    """llama.cpp's tools inherited the PASSIVE that `import tandem` set for itself and ran ~0.67x their default."""
    import tandem
    from tandem.child_env import peer_environment

    monkeypatch.setattr(tandem, "_policy", "PASSIVE")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert "OMP_WAIT_POLICY" not in peer_environment()
    monkeypatch.setattr(tandem, "_policy", None)  # the user set it: tandem chose nothing
    assert peer_environment()["OMP_WAIT_POLICY"] == "PASSIVE"
