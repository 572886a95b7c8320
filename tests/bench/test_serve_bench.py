"""tandem bench serve on the tiny model: every level completes without failures and the report is complete."""
import json

from tandem.bench.serving.serve import ServeBenchConfig, markdown_table, run_serve_bench


def test_serve_bench_reports_each_level_and_mode(tiny_llama, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"domain": d, "prompt": f"{d} prompt {i}", "id": f"{d}{i}"}) + "\n"
                               for d in ("code", "chat") for i in range(12)))
    config = ServeBenchConfig(model=tiny_llama, drafter="ngram", prompts=str(prompts), per_domain=12, max_tokens=8,
                              concurrency=(1, 4), min_requests=4, max_batch_size=4, max_model_len=128, threads=1)
    report = run_serve_bench(config, progress=lambda line: None)
    assert set(report["modes"]) == {"off", "on"}
    for mode, result in report["modes"].items():
        assert [r["concurrency"] for r in result["levels"]] == [1, 4]
        for row in result["levels"]:
            assert row["failed"] == 0 and row["requests"] == 4 and 0 < row["output_tokens"] <= 4 * 8
            assert row["latency_p50_s"] <= row["latency_p99_s"] and row["ttft_p50_s"] <= row["latency_p99_s"]
        assert result["llm_generate"]["output_tokens"] > 0
    assert report["modes"]["off"]["levels"][0]["mean_acceptance_length"] == 1.0  # plain decoding: one token per step
    assert markdown_table(report).count("\n") == 1 + 2 * 3
