"""`tandem bench throughput` on a tiny model: every prompt served, batch occupancy as configured, and
batching changes no output token."""
import json

import pytest
import torch

from tandem.bench.serving.throughput import serve_all
from tandem.cli import main
from tandem.config import EngineConfig, SamplingParams
from tandem.engine.engine import Engine
from tandem.models import cpu_gemm
from tandem.models.loader import load_transformer

PROMPTS = ["abc abc abc", "select x from y", "hello there", "one two three four", "zzz"]


def test_bench_throughput_end_to_end(tiny_llama, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"domain": "chat", "prompt": p}) for p in PROMPTS))
    out = tmp_path / "out.json"
    assert main(["bench", "throughput", "--model", tiny_llama, "--prompts", str(prompts), "--concurrency", "2",
                 "--max-tokens", "6", "--max-model-len", "128", "--threads", "1", "--prefill-batch-tokens", "64", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    run = result["runners"]["eager"]
    assert result["prompts"] == 5 and result["concurrency"] == 2
    assert run["output_tokens"] == 30 and run["output_tokens_per_s"] > 0
    assert 1.0 < run["mean_batch"] <= 2.0  # 5 requests, 2 at a time
    assert run["ttft_median_s"] <= run["ttft_p90_s"] <= run["wall_s"]


def test_concurrency_changes_no_token(tiny_llama):
    model = load_transformer(tiny_llama)
    model.pack()
    ids = [[(7 * i + j) % 250 for j in range(3 + 2 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = {}
    for concurrency in (1, 4):
        stats, outs[concurrency] = serve_all(Engine(model, EngineConfig(max_batch_size=concurrency, max_model_len=64)), ids, params)
        assert stats["output_tokens"] == 60
    assert outs[1] == outs[4]


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512" or not cpu_gemm.available(), reason="needs the CPU kernels and AVX-512")
def test_isa_ab_serves_the_same_tokens_with_both_blocks(tiny_llama, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"domain": "chat", "prompt": p * 16}) for p in PROMPTS))  # > 32 tokens: the wide kernel
    out = tmp_path / "out.json"
    before = cpu_gemm.isa()
    assert main(["bench", "throughput", "--model", tiny_llama, "--prompts", str(prompts), "--concurrency", "5", "--max-tokens", "4",
                 "--max-model-len", "128", "--threads", "1", "--isa-ab", "--json", str(out)]) == 0
    ab = json.loads(out.read_text())["isa_ab"]
    assert [len(ab["runs"][isa]) for isa in ("avx2", "avx512")] == [2, 2] and ab["identical"] and ab["avx512_speedup"] > 0
    assert cpu_gemm.isa() == before  # the switch is restored
