"""bench forward's A/B runs: the small-M kernel against oneDNN on two copies of the same target, the fused layers in
one call, the fused glue per layer and the torch-op glue on one, interleaved."""
import pytest

from tandem.bench.kernels.forward import gemm_comparison, glue_comparison, op_profile
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


@pytest.mark.skipif(not cpu_gemm.available(), reason=f"CPU kernels unavailable: {cpu_gemm.unusable_reason()}")
def test_glue_comparison_times_the_three_glues_on_one_target_and_leaves_it_stacked(tiny_llama):
    llm = LLM(model=tiny_llama)
    report = glue_comparison(llm, ["hello world", "abc"], max_tokens=6, rounds=1)
    assert set(report["ar_tokens_per_s"]) == {"fused_stack", "fused", "torch_ops"} and report["greedy_identical"]
    assert set(report["cost_ms"]["torch_ops"]) == {1, 5, 9}
    rates = report["ar_tokens_per_s"]
    assert report["stack_over_per_layer"] == pytest.approx(rates["fused_stack"] / rates["fused"], rel=1e-2)
    assert llm.target.fused_glue and llm.target.fused_stack


@pytest.mark.skipif(not cpu_gemm.available(), reason=f"CPU kernels unavailable: {cpu_gemm.unusable_reason()}")
def test_op_profile_shows_the_fused_ops_only_with_the_fused_glue(tiny_llama):
    llm = LLM(model=tiny_llama)
    profile = op_profile(llm.target, context=8, steps=2, top=40)
    ops = {name: {row["op"] for row in rows} for name, rows in profile.items()}
    assert "tandem_cpu::attend_cached" in ops["fused"] and "tandem_cpu::attend_cached" not in ops["torch_ops"]
    assert "tandem_cpu::decode_layers" in ops["fused_stack"] and "tandem_cpu::attend_cached" not in ops["fused_stack"]
    calls = {name: rows[0]["calls_per_step"] for name, rows in profile.items()}
    assert calls["fused_stack"] < calls["fused"] < calls["torch_ops"]
    assert llm.target.fused_stack


def test_resident_memory_is_measured_at_the_served_weights(tiny_llama, monkeypatch):
    """`bench forward --weights int4` used to measure the resident memory of an fp32 pack (1.5B int4: 6,774 MB)."""
    from tandem.bench.kernels.forward import model_resident_mb
    from tandem.models.transformer import Transformer

    packed_as = []
    real_pack = Transformer.pack
    monkeypatch.setattr(Transformer, "pack", lambda self, *a, gemm="auto", **kw: (packed_as.append(gemm), real_pack(self, *a, gemm=gemm, **kw))[1])
    model_resident_mb(tiny_llama, True, "int8")
    model_resident_mb(tiny_llama, True)
    assert packed_as == ["int8", "auto"]
