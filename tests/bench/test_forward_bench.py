"""bench forward's GEMM A/B: the small-M kernel and oneDNN on two copies of the same target, interleaved."""
import pytest

from tandem.bench.forward import gemm_comparison
from tandem.llm import LLM
from tandem.models import cpu_gemm


@pytest.mark.skipif(not cpu_gemm.available(), reason=f"small-M kernel unavailable: {cpu_gemm.unusable_reason()}")
def test_gemm_comparison_reports_both_and_they_decode_alike(tiny_llama):
    llm = LLM(model=tiny_llama)
    report = gemm_comparison(llm, ["hello world", "abc"], max_tokens=6, rounds=1)
    assert set(report["ar_tokens_per_s"]) == {"kernel", "onednn"} and all(v > 0 for v in report["ar_tokens_per_s"].values())
    assert report["greedy_identical"]
    assert report["speedup"] == pytest.approx(report["ar_tokens_per_s"]["kernel"] / report["ar_tokens_per_s"]["onednn"], rel=1e-2)
    assert set(report["cost_ms"]["kernel"]) == {1, 5, 9}
