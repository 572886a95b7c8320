"""--online: the flywheel in the server. Training publishes, serving swaps and stays lossless; admin adopt /
pause / resume / checkpoint; the trainer dies mid-load and serving continues; a restart resumes."""
import concurrent.futures
import time

import httpx

from tandem.config import SamplingParams
from tandem.flywheel.weights import checksum, load_version

from server_helpers import MODEL, LiveServer, tiny_config

ADMIN = {"Authorization": "Bearer admin-0123456789"}
PROMPTS = [f"prompt number {i}: abc" for i in range(8)]


def online_config(tiny_llama, state_dir):
    return tiny_config(tiny_llama, drafter="eagle", draft_vocab_size=200, online=True, state_dir=str(state_dir),
                       publish_every=2, checkpoint_every=2, admin_key="admin-0123456789")


def serve_batch(server, expected, n=8):
    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}, timeout=60)
        return r.status_code == 200 and r.json()["choices"][0]["text"] == expected[prompt]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return all(pool.map(one, range(n)))


def until(predicate, server, expected, timeout=60):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        assert serve_batch(server, expected, 4)  # keep traffic flowing: swaps wait for their watch window


def test_online_flywheel_admin_trainer_death_and_resume(tiny_llama, reference, tmp_path):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = {p: o.text for p, o in zip(PROMPTS, reference.generate(PROMPTS, params))}
    with LiveServer(online_config(tiny_llama, tmp_path)) as server:
        runtime = server.runtime
        flywheel, swapper = runtime.flywheel, runtime.control.swapper
        until(lambda: swapper.stats.swaps >= 1, server, expected)
        assert runtime.flywheel.trainer.steps >= 2

        # a request ended by a stop string is aborted in the engine: its partial trace is finished and counted, not leaked
        text = expected[PROMPTS[0]]
        aborted_before = flywheel.collector.assembler.aborted
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0,
                                                             "ignore_eos": True, "stop": [text[len(text) // 2]]}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
        flywheel.collector.flush()
        assert flywheel.collector.assembler.aborted == aborted_before + 1 and not flywheel.collector.assembler.inflight
        assert f'tandem:trace_aborted_requests_total{{model_name="tiny"}} {aborted_before + 1}.0' in httpx.get(server.url + "/metrics").text

        admin = httpx.Client(base_url=server.url, headers=ADMIN, timeout=30)
        status = admin.get("/admin/drafter").json()
        assert status["version"] == swapper.stats.version >= 1 and 0 in status["available_versions"] and status["training"]["alive"]
        assert admin.post("/admin/checkpoint").status_code == 200 and (tmp_path / "checkpoint").is_dir()

        adopted = admin.post("/admin/drafter/adopt", json={"version": 0}).json()  # pauses training first
        assert adopted["requested"] == 0 and not flywheel.trainer.alive
        until(lambda: swapper.stats.version == adopted["published_as"], server, expected)
        served = checksum(runtime.engine.drafter.head.state_dict())
        assert served == load_version(tmp_path / "versions" / "drafter-v000000.safetensors").checksum
        assert admin.post("/admin/drafter/adopt", json={"version": 99999}).status_code == 400
        assert admin.post("/admin/training/resume").json() == {"resumed": True} and flywheel.trainer.alive

        def crash():  # the trainer dies mid-load (its thread records the error and exits)
            raise RuntimeError("trainer killed")

        flywheel.trainer.train_step = crash
        until(lambda: not flywheel.trainer.alive, server, expected)
        last = flywheel.store.latest().version
        assert serve_batch(server, expected, 16)  # serving continues on the last published version
        assert flywheel.store.latest().version == last and swapper.stats.version <= last and swapper.stats.refused == 0
        metrics = httpx.get(server.url + "/metrics").text
        assert 'tandem:trainer_alive{model_name="tiny"} 0.0' in metrics and 'tandem:trainer_failed{model_name="tiny"} 1.0' in metrics
        assert "tandem:trace_buffer_bytes" in metrics and "tandem:drafter_swaps_total" in metrics
        assert admin.post("/admin/training/resume").status_code == 400  # a dead trainer is not resumed silently
        steps_at_death = flywheel.trainer.steps

    with LiveServer(online_config(tiny_llama, tmp_path)) as again:  # restart: resume from checkpoint and traces
        trainer = again.runtime.flywheel.trainer
        assert 2 <= trainer.resumed_from_step <= steps_at_death  # trainer.steps may have moved on already
        assert again.runtime.flywheel.restored_traces > 0
        assert serve_batch(again, expected, 8)
