"""vLLM's own benchmark client against `tandem serve` (SmolLM2): its figures and tandem's /metrics describe the same run.
Needs the peer harness's vLLM venv (../shared/peers/setup_env.sh vllm) and the fetched model; skipped without them."""
import pytest

from tandem.bench.peers.peers import peer_cache


def _have_vllm_and_model() -> bool:
    from tandem.models.zoo import is_fetched

    return (peer_cache() / "env" / "venv-vllm" / "bin" / "python").exists() and is_fetched("smollm2-135m")


@pytest.mark.slow
@pytest.mark.skipif(not _have_vllm_and_model(), reason="needs the peer harness's vLLM venv and smollm2-135m")
def test_vllm_client_and_server_metrics_agree(tmp_path):
    from tandem.bench.peers.vllm_client import ClientCheckConfig, run_client_check

    config = ClientCheckConfig(backend="openai-chat", num_prompts=8, concurrency=4, input_len=64, max_tokens=32, threads=2,
                               max_model_len=512, log_dir=str(tmp_path))
    report = run_client_check(config, progress=lambda line: None)
    client, server, ratio = report["client"], report["server"], report["server_over_client"]
    assert report["client_failed"] == 0 and client["requests"] == server["requests"] == 8
    assert client["output tokens"] == server["output tokens"] == 8 * 32  # ignore_eos: exactly max_tokens each
    assert ratio["output tok/s"] == 1.0
    for figure in ("mean TTFT ms", "mean ITL ms", "mean TPOT ms", "mean end-to-end latency ms"):
        assert 0.8 <= ratio[figure] <= 1.25, (figure, client[figure], server[figure])
