"""The parts of `tandem bench serve --peer vllm` / `--vllm-client` that need no vLLM: child servers are started, found
ready, reported when they die and stopped for sure; vLLM's environment; the /metrics deltas against a client's figures."""
import os
import sys
import time

import pytest

from tandem.bench.children import ChildServer, free_port
from tandem.bench.peers.serve_peer import PeerBenchConfig, _ratios, level_prompts, markdown_tables, vllm_env, vllm_preload
from tandem.bench.peers.vllm_client import client_side, compare, server_side
from tandem.errors import TandemError


def test_a_child_server_is_ready_then_stopped_with_its_process_group(tmp_path):
    port = free_port()
    # the child starts a grandchild in its own process group (like vLLM's engine core), then serves HTTP
    script = ("import functools, subprocess, sys, http.server; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              f"handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory={str(tmp_path)!r}); "
              f"http.server.ThreadingHTTPServer(('127.0.0.1', {port}), handler).serve_forever()")
    (tmp_path / "health").write_text("ok")
    server = ChildServer("test server", [sys.executable, "-c", script], port, tmp_path / "log.txt", ready_path="/health",
                         timeout_s=30, grace_s=5)
    pgid = os.getpgid(server.pid)
    assert pgid == server.pid  # its own session: a terminal's Ctrl-C does not reach it, close() does
    server.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)  # nothing of the group is left, the grandchild included


def test_a_child_that_exits_before_it_is_ready_is_a_clear_error(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    with pytest.raises(TandemError, match=r"exited with code 3 before it was ready(.|\n)*no such model"):
        ChildServer("broken server", cmd, free_port(), tmp_path / "log.txt", timeout_s=30)


def test_a_child_that_never_answers_times_out_and_is_stopped(tmp_path):
    server_cmd = [sys.executable, "-c", "import time; time.sleep(600)"]
    start = time.monotonic()
    with pytest.raises(TandemError, match="was not ready within 1 s"):
        ChildServer("silent server", server_cmd, free_port(), tmp_path / "log.txt", timeout_s=1, grace_s=5)
    assert time.monotonic() - start < 10


def test_vllm_gets_the_peer_harness_environment(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    (tmp_path / "venv" / "lib").mkdir()
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_env(python, threads=2, kv_gib=1)
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("1", "0-1", "2")
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and "PYTHONPATH" not in env
    assert vllm_preload(python).endswith(str(tmp_path / "venv" / "lib" / "libiomp5.so"))
    assert env["LD_PRELOAD"] == vllm_preload(python)


def test_level_prompts_and_ratios():
    prompts = [f"p{i}" for i in range(60)]
    assert [len(level_prompts(prompts, c, 8)) for c in (1, 16, 60)] == [8, 32, 60]
    base = {"tokens_per_s": 100.0, "latency_p50_s": 2.0, "latency_p99_s": 4.0, "ttft_mean_s": 0.5, "ttft_p99_s": None}
    row = {"tokens_per_s": 130.0, "latency_p50_s": 1.0, "latency_p99_s": 4.0, "ttft_mean_s": 0.25, "ttft_p99_s": 0.3}
    assert _ratios(row, base) == {"tokens_per_s": 1.3, "latency_p50_s": 0.5, "latency_p99_s": 1.0, "ttft_mean_s": 0.5, "ttft_p99_s": None}


def test_the_tables_have_a_column_per_side():
    def row(tps):
        return {"requests": 8, "failed": 0, "tokens_per_s": tps, "latency_p50_s": 1.0, "latency_p99_s": 2.0, "ttft_mean_s": 0.1,
                "ttft_p99_s": 0.2, "output_tokens": 700, "prompt_tokens": 400}
    report = {"config": {"drafter": "ngram"}, "levels": [
        {"concurrency": 1, "rows": {"vllm": row(20.0), "tandem": row(30.0), "tandem_spec": row(45.0)},
         "ratios_vs_vllm": {"tandem": _ratios(row(30.0), row(20.0)), "tandem_spec": _ratios(row(45.0), row(20.0))}},
        {"concurrency": 16, "rows": {"vllm": row(100.0), "tandem": row(150.0)}, "ratios_vs_vllm": {"tandem": _ratios(row(150.0), row(100.0))}}]}
    text = markdown_tables(report)
    assert "| output tok/s | 20.0 | 30.0 | 1.5 | 45.0 | 2.25 |" in text
    assert "| output tok/s | 100.0 | 150.0 | 1.5 |" in text
    assert all(line.count("|") == 7 for line in text.split("\n\n")[0].splitlines())  # 6 columns at concurrency 1


def test_server_metrics_deltas_against_the_client():
    before = {"tandem:time_to_first_token_seconds_sum": 1.0, "tandem:time_to_first_token_seconds_count": 2.0,
              "tandem:inter_token_latency_seconds_sum": 5.0, "tandem:inter_token_latency_seconds_count": 100.0,
              "tandem:generation_tokens_total": 50.0, "tandem:request_success_total": 2.0}
    after = {"tandem:time_to_first_token_seconds_sum": 3.0, "tandem:time_to_first_token_seconds_count": 6.0,
             "tandem:inter_token_latency_seconds_sum": 9.0, "tandem:inter_token_latency_seconds_count": 180.0,
             "tandem:generation_tokens_total": 450.0, "tandem:request_success_total": 6.0}
    server = server_side(before, after, duration_s=8.0)
    assert server["mean TTFT ms"] == 500.0 and server["mean ITL ms"] == 50.0 and server["mean TPOT ms"] is None
    assert (server["output tokens"], server["output tok/s"], server["requests"]) == (400, 50.0, 4)
    client = client_side({"mean_ttft_ms": 400.0, "mean_itl_ms": 50.0, "mean_tpot_ms": 40.0, "mean_e2el_ms": 900.0,
                          "total_output_tokens": 400, "output_throughput": 50.0, "completed": 4})
    ratios = compare(client, server)
    assert ratios["mean TTFT ms"] == 1.25 and ratios["mean ITL ms"] == 1.0 and ratios["output tok/s"] == 1.0 and ratios["mean TPOT ms"] is None


def test_peer_config_is_validated():
    with pytest.raises(Exception, match="concurrency"):
        PeerBenchConfig(concurrency=(0,))
