"""`tandem serve` as a user runs it: a subprocess, the openai client, Ctrl-C, and the shutdown checkpoint."""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a fresh interpreter imports torch, transformers and fastapi: ~10 s idle, a minute on a busy machine
@pytest.mark.parametrize("trainer_process", [False, True])
def test_tandem_serve_subprocess_online_checkpoints_on_ctrl_c(tiny_llama, tmp_path, trainer_process):
    port, key = free_port(), "sk-cli-test-0123456789"
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", tiny_llama, "--served-model-name", "tiny", "--port", str(port),
           "--drafter", "eagle", "--draft-vocab-size", "200", "--online", "--state-dir", str(tmp_path / "state"),
           "--api-key", key, "--max-model-len", "128", "--threads", "1", "--log-level", "warning", "--log-format", "json",
           *(["--trainer-process"] if trainer_process else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # a loaded machine: minutes (the trainer child imports torch too)
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
        try:
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong-key-000", max_retries=0).models.list()
            raise AssertionError("a wrong key was accepted")
        except openai.AuthenticationError:
            pass
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole process group (a trainer child too)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert any((tmp_path / "state" / "checkpoint").iterdir())  # the trainer checkpointed on shutdown
