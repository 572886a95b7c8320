"""`tandem bench quality`: per-precision log-probs and agreement against fp32, on a tiny model."""
import json

import pytest

from tandem.bench.speculation.quality import QualityBenchConfig, prefix_agreement
from tandem.cli import main
from tandem.errors import InvalidParameterError
from tandem.models import cpu_gemm


def test_prefix_agreement_counts_tokens_before_the_first_difference():
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert prefix_agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert prefix_agreement([1], [1, 2, 3, 4]) == 0.25  # stopped early: only the shared tokens count
    assert prefix_agreement([7, 2, 3, 4], [1, 2, 3, 4]) == 0.0


def test_config_needs_fp32_first_and_known_weights():
    with pytest.raises(InvalidParameterError, match="fp32"):
        QualityBenchConfig(weights=("int8", "fp32"))
    with pytest.raises(InvalidParameterError, match="unknown"):
        QualityBenchConfig(weights=("fp32", "int3"))


@pytest.mark.skipif(not cpu_gemm.available(), reason=f"int4 / bf16 need the CPU kernels: {cpu_gemm.unusable_reason()}")
def test_quality_bench_reports_each_precision_against_fp32(tiny_llama, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"domain": d, "prompt": t}) for d, t in [("code", "def f(x): return x"), ("chat", "hello there")]))
    out = tmp_path / "q.json"
    assert main(["bench", "quality", "--model", tiny_llama, "--weights", "fp32,bf16,int4", "--prompts", str(prompts),
                 "--domains", "code,chat", "--max-tokens", "8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["num_samples"] == 2 and list(result["weights"]) == ["fp32", "bf16", "int4"]
    fp32 = result["weights"]["fp32"]
    assert set(fp32) == {"overall", "code", "chat"}
    assert fp32["overall"]["greedy_prefix_agreement"] == 1.0  # fp32 against its own greedy output
    assert fp32["overall"]["top1_agreement"] == 1.0  # the tiny model's logits are decisive: no near-ties to round apart
    assert fp32["overall"]["continuation_logprob_delta"] == 0.0
    int4 = result["weights"]["int4"]["overall"]
    assert int4["continuation_logprob"] < 0 and int4["continuation_logprob_delta"] != 0.0  # another model: other numbers
    assert 0.0 <= int4["top1_agreement"] <= 1.0
