"""Trained ablations: variants differ from the recipe in one field, train the same steps on the same shards, and
land in one table; bad specs are refused before anything trains."""
import json
import os

import pytest

from tandem.errors import InvalidParameterError
from tandem.models.loader import load_transformer
from tandem.training.ablation import BASELINE, markdown_table, parse_ablations, run_ablation
from tandem.training.recipes import Recipe

from test_recipe_trainer import write_features


def test_variants_change_one_field_each_and_skip_the_recipes_own_value():
    recipe = Recipe(draft_vocab=16384, unroll=4)
    variants = parse_ablations(recipe, ["draft_vocab=8192,16384,32768", "unroll=2,6", "lr=3e-4"])
    assert variants == {BASELINE: {}, "draft_vocab=8192": {"draft_vocab": 8192}, "draft_vocab=32768": {"draft_vocab": 32768},
                        "unroll=2": {"unroll": 2}, "unroll=6": {"unroll": 6}, "lr=3e-4": {"lr": 3e-4}}


@pytest.mark.parametrize("spec", ["vocab=8192", "unroll", "unroll=", "unroll=two", "unroll=0", "seed=1", "step_weight=0", "step_weight=1.5"])
def test_bad_specs_are_refused(spec):
    with pytest.raises(InvalidParameterError):
        parse_ablations(Recipe(), [spec])


def test_an_ablation_needs_the_features_first(tmp_path):
    with pytest.raises(InvalidParameterError, match="features"):
        run_ablation(Recipe(), tmp_path, ["unroll=2"], steps=1)


def test_every_variant_trains_the_same_steps_and_lands_in_the_table(tiny_llama, tmp_path):
    write_features(load_transformer(tiny_llama), tmp_path)
    threads = os.environ.get("OMP_NUM_THREADS")
    recipe = Recipe(model=tiny_llama, draft_vocab=64, rows=1, row_len=64, warmup=1, eval_every=50)
    report = run_ablation(recipe, tmp_path, ["unroll=2"], steps=3, parallel=2, log=lambda _: None)
    assert list(report["variants"]) == [BASELINE, "unroll=2"]
    for variant in report["variants"].values():
        assert variant["steps"] == 3 and variant["tokens"] > 0
        assert set(variant["acceptance_length"]) == {"code", "sql"}
    assert report["eval_depth"] == 4 and report["variants"]["unroll=2"]["overrides"] == {"unroll": 2}
    assert json.loads((tmp_path / "ablation-3" / "report.json").read_text()) == json.loads(json.dumps(report))
    table = markdown_table(report).splitlines()
    assert len(table) == 4 and table[3].startswith("| unroll=2 |")
    again = run_ablation(recipe, tmp_path, ["unroll=2"], steps=3, parallel=1, log=lambda _: None)  # resumed: nothing more to train
    assert all(v["steps"] == 3 for v in again["variants"].values())
    longer = run_ablation(recipe, tmp_path, [], steps=4, parallel=1, log=lambda _: None)  # another budget: its own runs, from scratch
    assert list(longer["variants"]) == [BASELINE] and longer["variants"][BASELINE]["steps"] == 4
    assert (tmp_path / "ablation-4" / BASELINE.replace("=", "-") / "ckpt").is_dir() and os.environ.get("OMP_NUM_THREADS") == threads
