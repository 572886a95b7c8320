"""The Ray path's pieces that need no cluster: wire format, metrics merge, prompt slicing, start-up errors."""
import socket
import time

import pytest
import torch

from tandem.cluster.netns import netns_argv
from tandem.cluster.ray_env import RayUnavailableError, connect, pin_to_cores
from tandem.cluster.rl import _slices
from tandem.cluster.serve import merge_metrics
from tandem.cluster.wire import version_from_bytes, version_to_bytes
from tandem.errors import InvalidParameterError, TandemError
from tandem.flywheel.weights import WeightRefused, WeightVersion, checksum


def _version(n=3):
    tensors = {"fc.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "d2t": torch.tensor([4, 7], dtype=torch.long)}
    return WeightVersion(n, tensors, checksum(tensors), {"trainer_step": 30, "restores": 1})


def test_a_version_crosses_the_object_store_as_bytes_and_comes_back_identical():
    v = _version()
    back = version_from_bytes(version_to_bytes(v))
    assert back.version == 3 and back.checksum == v.checksum and back.meta == {"trainer_step": 30, "restores": 1}
    assert all(torch.equal(back.tensors[k], v.tensors[k]) for k in v.tensors)


def test_a_corrupted_version_blob_is_refused():
    blob = bytearray(version_to_bytes(_version()))
    blob[-1] ^= 0xFF  # a flipped bit in the last tensor's data
    with pytest.raises(WeightRefused, match="checksum mismatch"):
        version_from_bytes(bytes(blob))
    with pytest.raises(WeightRefused, match="unreadable"):
        version_from_bytes(b"not safetensors")


def test_metrics_of_replicas_merge_with_a_replica_label_and_one_header_per_family():
    a = ('# HELP tandem:generation_tokens_total Tokens generated.\n# TYPE tandem:generation_tokens_total counter\n'
         'tandem:generation_tokens_total 5.0\n# HELP tandem:request_success_total Finished.\n# TYPE tandem:request_success_total counter\n'
         'tandem:request_success_total{finished_reason="length"} 2.0\n')
    b = a.replace("5.0", "7.0").replace("} 2.0", "} 3.0")
    merged = merge_metrics({"r1": a, "r2": b}).splitlines()
    assert merged == [
        "# HELP tandem:generation_tokens_total Tokens generated.", "# TYPE tandem:generation_tokens_total counter",
        'tandem:generation_tokens_total{replica="r1"} 5.0', 'tandem:generation_tokens_total{replica="r2"} 7.0',
        "# HELP tandem:request_success_total Finished.", "# TYPE tandem:request_success_total counter",
        'tandem:request_success_total{replica="r1",finished_reason="length"} 2.0', 'tandem:request_success_total{replica="r2",finished_reason="length"} 3.0',
    ]


def test_prompts_are_sliced_contiguously_and_evenly():
    assert _slices(5, 2) == [(0, 3), (3, 5)]
    assert _slices(2, 3) == [(0, 1), (1, 2), (2, 2)]


def test_an_unreachable_address_is_a_clear_error_within_seconds():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    began = time.monotonic()
    with pytest.raises(RayUnavailableError, match=f"cannot reach the Ray cluster at 127.0.0.1:{port}"):
        connect(f"127.0.0.1:{port}")
    assert time.monotonic() - began < 10
    with pytest.raises(InvalidParameterError, match="HOST:PORT"):
        connect("no-port-here")


def test_without_ray_installed_the_error_says_how_to_install_it(monkeypatch):
    import sys

    from tandem.cluster.ray_env import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` sees when the package is absent
    with pytest.raises(RayUnavailableError, match=r"pip install 'tandem\[ray\]'"):
        require_ray()


def test_netns_needs_a_command_and_pinning_checks_cores():
    with pytest.raises(TandemError, match="no command"):
        netns_argv([])
    assert netns_argv(["echo", "hi"])[-3:] == ["sh", "echo", "hi"]
    with pytest.raises(InvalidParameterError, match="not all on this machine"):
        pin_to_cores((10_000,))


def test_the_ray_cli_paths_fail_clearly_before_starting_anything(capsys):
    from tandem.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", "--ray", "--address", f"127.0.0.1:{port}", "--model", "unused"]) == 1
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["serve", "--ray", "--admin-key", "admin-0123456789"]) == 1
    assert "--admin-key with --ray is not supported yet" in capsys.readouterr().err
    assert main(["rl", "--ray", "--compare"]) == 1
    assert "--ray does not take --compare: comparing drafters times each one's rollouts on the same cores" in capsys.readouterr().err
    assert main(["rl", "--ray", "--sweep", "1,4"]) == 1
    assert "--ray does not take --sweep" in capsys.readouterr().err
    assert main(["rl", "--ray", "--rollout-workers", "0"]) == 1
    assert "--rollout-workers must be >= 1, got 0" in capsys.readouterr().err
    assert main(["serve", "--ray", "--replicas", "0"]) == 1
    assert "--replicas must be >= 1" in capsys.readouterr().err


def test_the_namespace_has_only_loopback_and_the_host_has_more():
    import sys

    from tandem.cluster.netns import in_private_netns, netns_available, run_in_netns

    reason = netns_available()
    if reason is not None:
        pytest.skip(f"no private network namespace here: {reason}")
    probe = "from tandem.cluster.netns import in_private_netns; import socket; print(in_private_netns(), socket.if_nameindex())"
    done = run_in_netns([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True [(1, 'lo')]", done.stderr
    assert in_private_netns() is False  # this test process: the host's network


def test_the_trace_ledger_counts_concurrent_accepts_exactly(tmp_path):
    """The trainer actor serves put_trace calls concurrently; each accept rewrites the ledger."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from tandem.cluster.trainer_actor import TraceLedger

    ledger = TraceLedger(str(tmp_path))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: ledger.accepted(0), range(400)))  # a raise here is what counted a stored trace as lost
    assert ledger.accepted_count == 400 and json.loads((tmp_path / "trace_ledger.json").read_text())["accepted"] == 400


def test_a_benchmark_result_is_printed_and_written_with_its_arguments_time_and_load(tmp_path, capsys):
    import argparse
    import json

    from tandem.cluster.results import write_result

    args = argparse.Namespace(prompts=60, json=str(tmp_path / "out.json"), func=print)
    out = write_result("python -m tandem.cluster.overhead", args, {"median": {"ray1": 12.5}})
    assert json.loads((tmp_path / "out.json").read_text()) == out == json.loads(capsys.readouterr().out)
    assert list(out) == ["command", "args", "median", "when", "load_average"]
    assert out["args"] == {"prompts": 60, "json": str(tmp_path / "out.json")} and out["median"] == {"ray1": 12.5}
    assert len(out["load_average"]) == 3 and out["when"].endswith("Z")


def test_latency_percentiles_are_nearest_rank():
    from tandem.cluster.overhead import percentile

    values = [float(v) for v in range(60, 0, -1)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100), percentile([7.0], 50)) == (30.0, 60.0, 60.0, 7.0)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 51) == 3.0


def test_the_scaling_summary_takes_medians_per_arm_and_ratios_to_embedded_and_one_replica():
    from tandem.cluster.overhead import summarize

    def r(tok_s, p50):
        return {"tok_s": tok_s, "p50_s": p50}

    rounds = {"embedded": [r(200.0, 8.0), r(220.0, 9.0), r(210.0, 7.0)], "ray1": [r(190.0, 8.4), r(189.0, 8.4), r(300.0, 1.0)],
              "ray2": [r(150.0, 10.0), r(160.0, 11.0), r(155.0, 12.0)]}
    out = summarize(rounds)
    assert out["median"] == {"embedded": {"tok_s": 210.0, "p50_s": 8.0}, "ray1": {"tok_s": 190.0, "p50_s": 8.4}, "ray2": {"tok_s": 155.0, "p50_s": 11.0}}
    assert out["over_embedded"] == {"ray1": {"tok_s": round(190 / 210, 4), "p50": 1.05}, "ray2": {"tok_s": round(155 / 210, 4), "p50": 1.375}}
    assert out["over_ray1_tok_s"] == {"ray2": round(155 / 190, 4)}


def test_replica_capacity_takes_the_runtimes_largest_defaults_where_sizes_are_unset():
    from tandem.cluster.flywheel_cluster import FlywheelCluster
    from tandem.cluster.replica import replica_capacity
    from tandem.server.runtime import ServerConfig

    assert replica_capacity(ServerConfig(model="m")) == 64 + 4 * 64  # `tandem serve --ray` without --max-batch-size/--max-queue
    assert replica_capacity(ServerConfig(model="m", max_batch_size=4)) == 4 + 16
    assert replica_capacity(ServerConfig(model="m", max_batch_size=4, max_queue=0)) == 4
    cluster = FlywheelCluster(ServerConfig(model="m"), replicas=2)  # was a TypeError (None + None) before any actor started
    assert cluster._pool._max_workers == 2 * 320
    cluster.close()


def _serve_args(*extra):
    from tandem.cli import build_parser

    return build_parser().parse_args(["serve", "--ray", "--replicas", "2", "--online", "--drafter", "eagle", "--model", "unused", *extra])


def test_serve_ray_online_from_the_command_line_gets_as_far_as_joining_the_cluster(tmp_path, capsys):
    """`tandem serve --ray --replicas 2 --online` read an option the parser never defined (AttributeError) before Ray started."""
    from tandem.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["serve", "--ray", "--replicas", "2", "--online", "--drafter", "eagle", "--model", "unused", "--state-dir", str(tmp_path), "--address", f"127.0.0.1:{port}"]
    assert main(argv) == 1
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port}" in capsys.readouterr().err


def test_the_trainer_actor_takes_its_threads_and_spill_retention_from_the_command_line(tmp_path):
    from tandem.cluster.cli import serve_plan
    from tandem.cluster.trainer_actor import trace_buffer

    config, spec = serve_plan(_serve_args("--state-dir", str(tmp_path), "--trainer-cpus", "2", "--spill-max-gb", "0.5", "--spill-max-age-hours", "1"))
    assert (spec.threads, spec.placement.num_cpus, spec.state_dir, config.state_dir) == (2, 2.0, str(tmp_path), None)
    assert (spec.spill_dir, spec.spill_max_bytes, spec.spill_max_age_s) == (str(tmp_path / "traces"), 1 << 29, 3600.0)
    (tmp_path / "traces").mkdir()
    old = tmp_path / "traces" / f"traces-{time.time_ns() - 2 * 3600 * 10**9:020d}.parquet"  # written two hours ago
    old.write_bytes(b"")
    buffer = trace_buffer(spec)
    assert not old.exists() and buffer.stats().spill_pruned == 1  # the actor's buffer prunes by the command line's retention
    buffer.close()
    _, unspilled = serve_plan(_serve_args("--state-dir", str(tmp_path), "--no-spill"))
    assert unspilled.spill_dir is None
    with pytest.raises(InvalidParameterError, match="--replica-cpus and --trainer-cpus must be > 0"):
        serve_plan(_serve_args("--replica-cpus", "0"))


def test_a_replica_sizes_its_threads_and_kv_cache_from_its_own_resources_not_the_nodes():
    from tandem.cluster.replica import memory_share, replica_config
    from tandem.server.runtime import ServerConfig

    node = 64 << 30  # a 4-CPU node with 64 GiB: four 1-CPU replicas each get 16 GiB, a KV budget of 4 GiB (the node's: 16 GiB)
    sized = replica_config(ServerConfig(model="m"), 1.0, memory_share(1.0, 4.0, node))
    assert (sized.threads, sized.kv_cache_bytes) == (1, 4 << 30)
    assert (replica_config(ServerConfig(model="m"), 2.5, memory_share(2.5, 4.0, node)).threads, memory_share(0.5, 2.0, 8 << 30)) == (2, 2 << 30)
    assert replica_config(ServerConfig(model="m"), 8.0, node).kv_cache_bytes == 8 << 30  # at most 8 GiB, as the embedded server
    assert memory_share(8.0, 4.0, node) == node  # never more than the node
    explicit = replica_config(ServerConfig(model="m", threads=3, kv_cache_bytes=1 << 20), 1.0, 1 << 30)
    assert (explicit.threads, explicit.kv_cache_bytes) == (3, 1 << 20)  # the command line's sizes win


def test_the_health_check_fails_for_a_broken_engine_loop_not_only_a_dead_one(tiny_llama):
    """Serve replaces a replica whose check_health raises; a broken loop (alive, answering every request 503) must."""
    from tandem.cluster.serve import check_loop_health
    from tandem.config import EngineConfig
    from tandem.engine.engine import Engine
    from tandem.server.engine_loop import EngineLoop

    from tiny_helpers import load_packed

    engine = Engine(load_packed(tiny_llama), EngineConfig(max_batch_size=2, max_model_len=64))
    loop = EngineLoop(engine, max_queue=4, max_consecutive_failures=3).start()
    check_loop_health(loop)  # healthy: no exception

    def fault():
        raise RuntimeError("injected: the engine's state is corrupt")

    engine.has_unfinished = fault  # every iteration now fails before it can do anything
    deadline = time.monotonic() + 10
    while not loop.broken and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.alive and loop.broken
    with pytest.raises(RuntimeError, match=r"the engine loop is broken \(\d+ failed iterations in a row\): it refuses every request"):
        check_loop_health(loop)
    loop.stop()
    with pytest.raises(RuntimeError, match="the engine loop is not running"):
        check_loop_health(loop)


def test_serve_ray_takes_sigterm_and_sigint_even_when_started_with_sigint_ignored():
    """A background process inherits SIGINT ignored, and SIGTERM's default ends it with its Serve application left behind."""
    import os
    import signal

    from tandem.cluster.serve import _on_signals

    outer = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `tandem serve --ray ... &` from a script starts
    term = signal.getsignal(signal.SIGTERM)
    hits = []
    replaced = _on_signals(lambda signum, frame: hits.append(signum))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 5
        while len(hits) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        _on_signals(replaced)
    assert hits == [signal.SIGTERM, signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is term  # restored on the way out
    signal.signal(signal.SIGINT, outer)


def test_asking_for_more_cpus_than_the_cluster_has_is_said_not_waited_on_in_silence():
    from tandem.cluster.ray_env import shortfall

    what = "tandem rl --ray (2 rollout workers x 1 CPUs + the learner's 1)"  # the README's command on a 2-CPU machine
    assert shortfall(3.0, 2.0, what) == (f"{what} asks Ray for 3 CPUs and the cluster has 2: the actors that do not fit wait until it grows "
                                         "(lower the --*-cpus options, or add nodes)")
    assert shortfall(2.0, 2.0, what) is None
