"""`tandem bench vocab` on a tiny target: every size is the same trained head, evaluated as the recipe does."""
import pytest
import torch

from tandem.bench.speculation.vocab import VocabBenchConfig, run_vocab_bench
from tandem.errors import InvalidParameterError
from tandem.models.eagle import EagleConfig, default_taps, draft_vocab_from_tokens, load_eagle, new_eagle_head, resize_draft_vocab, save_eagle, target_identity
from tandem.models.loader import load_transformer
from tandem.training.features import FeatureDoc, ShardWriter, target_features
from tandem.training.trainer import evaluate_heldout


def test_each_size_reports_the_recipe_evaluation_of_the_resized_head(tiny_llama, tmp_path):
    target = load_transformer(tiny_llama)
    taps = default_taps(target.cfg.num_layers)
    writer = ShardWriter(tmp_path / "heldout", target_identity(target.cfg), taps, shard_tokens=1 << 20)
    for i, domain in enumerate(("code", "sql", "code")):
        ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(i)).tolist()
        writer.add(FeatureDoc(f"regenerated/x/{i}", domain, torch.tensor(ids), 6, *target_features(target, ids, taps)))
    writer.flush()
    cfg = EagleConfig.for_target(target.cfg, 64, shared_lm_head=True)
    vocab = draft_vocab_from_tokens([list(range(40, 200))], 64, target.cfg.vocab_size)
    save_eagle(new_eagle_head(target, cfg, vocab, torch.Generator().manual_seed(0)), tmp_path / "head")

    report = run_vocab_bench(VocabBenchConfig(str(tmp_path / "heldout"), tiny_llama, str(tmp_path / "head"), sizes=(16, 64, 0), k=3, context=16))
    assert [r["draft_vocab"] for r in report["sizes"]] == [16, 64, target.cfg.vocab_size]
    head = load_eagle(tmp_path / "head", target)
    c1, ck = report["target_cost_ms"]["1"], report["target_cost_ms"]["4"]
    for row in report["sizes"]:
        expected = evaluate_heldout(resize_draft_vocab(head, row["draft_vocab"], target.lm_head.weight), tmp_path / "heldout", 3, 1024)
        assert row["mean_acceptance_length"] == expected["mean_acceptance_length"]
        assert row["per_domain"] == {"code": expected["code"]["acceptance_length"], "sql": expected["sql"]["acceptance_length"]}
        assert row["draft_step_ms"] > 0
        assert row["modelled_speedup"] == pytest.approx(row["mean_acceptance_length"] * c1 / (ck + 3 * row["draft_step_ms"]), rel=1e-2, abs=5e-4)  # reported to 3 decimals
    with pytest.raises(InvalidParameterError, match="feature index"):
        run_vocab_bench(VocabBenchConfig(str(tmp_path), tiny_llama, str(tmp_path / "head")))
