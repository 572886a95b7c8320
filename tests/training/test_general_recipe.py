"""The general recipe (chat data only), chatterbot conversations, and checkpoint selection on a validation split."""
import io
import json
import zipfile

import pytest
import torch

from tandem.data.prompts import load_prompts
from tandem.errors import InvalidParameterError
from tandem.training import sources
from tandem.training.features import FeatureDoc, ShardWriter, target_features
from tandem.training.pipeline import validation_prompts
from tandem.training.recipes import Recipe, get_recipe
from tandem.training.trainer import selection_score, train_recipe


def test_general_recipe_trains_on_chat_only_with_chatterbot():
    general, shipped = get_recipe("eagle-smollm2-general"), get_recipe("eagle-smollm2")
    assert general.domains == ("chat",) and general.chatterbot is True and general.validation is True
    assert shipped.domains == ("code", "sql", "math", "chat", "translation") and shipped.chatterbot is False
    with pytest.raises(InvalidParameterError):
        Recipe(domains=("chat", "poetry"))
    with pytest.raises(InvalidParameterError):
        Recipe(domains=())


def test_chatterbot_pairs_turns_and_skips_the_coding_file(tmp_path):
    wheel = tmp_path / "chatterbot_corpus-1.3.3-py2.py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("chatterbot_corpus/data/english/ai.yml", "categories:\n- AI\nconversations:\n- - What is AI?\n  - A field.\n  - Which one?\n  - Science.\n- - Are you sentient?\n  - Sort of.\n")
        zf.writestr("chatterbot_corpus/data/english/coding.yml", "conversations:\n- - What is a loop?\n  - for i in range(3): pass\n")
    docs = list(sources._chatterbot({"chatterbot-corpus": wheel}))
    assert [(d.id, d.prompt, d.answer) for d in docs] == [
        ("chatterbot/ai/0.0", "What is AI?", "A field."), ("chatterbot/ai/0.2", "Which one?", "Science."), ("chatterbot/ai/1.0", "Are you sentient?", "Sort of.")]
    assert {d.domain for d in docs} == {"chat"} and all(d.kind == "reference" for d in docs)


def test_validation_prompts_are_test_split_and_disjoint_from_the_heldout_ones(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"domain": d, "prompt": f"{d} question number {i}?", "id": f"{d}/{i}"}) + "\n" for d in ("chat", "code") for i in range(200)))
    recipe = Recipe(domains=("chat",), heldout_per_domain=5)
    validation = validation_prompts(recipe, str(path))
    heldout = load_prompts(str(path), domains=("chat", "code"), per_domain=5, split="test", seed=0)
    assert len(validation) == 5 and {p.domain for p in validation} == {"chat"}
    assert not {p.id for p in validation} & {p.id for p in heldout}
    assert validation == load_prompts(str(path), domains=("chat",), per_domain=10, split="test", seed=0)[5:10]


def test_selection_score_prefers_the_validation_split():
    heldout = {"heldout": {"mean_acceptance_length": 2.0}}
    assert selection_score(heldout) == 2.0
    assert selection_score(heldout | {"validation": {"mean_acceptance_length": 1.5}}) == 1.5


@pytest.mark.slow  # a fresh head's vocabulary counts the pinned data packages' reference answers (fetched on first use)
def test_the_best_checkpoint_is_the_one_with_the_best_validation_score(tiny_llama, tmp_path):
    from tandem.models.eagle import default_taps, target_identity
    from tandem.models.loader import load_transformer

    target = load_transformer(tiny_llama)
    taps, tid = default_taps(target.cfg.num_layers), target_identity(target.cfg)
    out = tmp_path / "run"
    for i, kind in enumerate(("reference", "regenerated", "heldout", "validation")):
        writer = ShardWriter(out / "features" / kind, tid, taps)
        for j in range(2):
            ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(10 * i + j)).tolist()
            tap, final = target_features(target, ids, taps)
            writer.add(FeatureDoc(f"{kind}/x/{j}", "chat", torch.tensor(ids), 6, tap, final))
        writer.flush()
        writer._lock.close()
    recipe = Recipe(model=tiny_llama, draft_vocab=64, rows=1, row_len=64, finetune_fraction=0.0, eval_every=1, warmup=1, domains=("chat",))
    report = train_recipe(recipe, out, hours=None, log=lambda _: None, max_steps=3)
    history = json.loads(next((out / "ckpt").glob("step-*/state.json")).read_text())["state"]["history"]
    scores = [e["validation"]["mean_acceptance_length"] for e in history]
    assert all("validation" in e and "heldout" in e for e in history)
    assert report["best_score"] == max(scores) and report["best_step"] == history[scores.index(max(scores))]["step"]
    assert json.loads((out / "best" / "report.json").read_text())["validation"]["mean_acceptance_length"] == max(scores)


def test_the_qwen_recipes_take_features_from_the_int4_target_with_a_half_width_head():
    for name in ("eagle-qwen2.5-coder-1.5b", "eagle-qwen2.5-coder-1.5b-general"):
        recipe = get_recipe(name)
        assert (recipe.model, recipe.weights, recipe.head_intermediate) == ("qwen2.5-coder-1.5b", "int4", 4480)
    assert get_recipe("eagle-qwen2.5-coder-1.5b-general").domains == ("chat",)
    with pytest.raises(InvalidParameterError, match="weights"):
        Recipe(weights="int3")
    with pytest.raises(InvalidParameterError, match="head_intermediate"):
        Recipe(head_intermediate=0)


def test_load_target_serves_the_recipes_weights(tiny_llama):
    """A recipe at int4 loads its target packed at int4 (every Linear on the int4 kernel), fp32 on the dense kernel."""
    from tandem.training.recipes import load_target

    for weights, kind in (("int4", "int4"), ("fp32", None)):
        target, _ = load_target(Recipe(model=tiny_llama, weights=weights))
        kinds = {None if lin.compact is None else lin.compact.kind for lin in target.modules() if hasattr(lin, "compact")}
        assert kinds == {kind}


def test_a_fresh_head_takes_the_recipes_mlp_width(tiny_llama):
    from tandem.models.eagle import EagleConfig
    from tandem.models.loader import load_transformer

    cfg = load_transformer(tiny_llama).cfg
    assert EagleConfig.for_target(cfg, 100, intermediate_size=24).intermediate_size == 24
    assert EagleConfig.for_target(cfg, 100).intermediate_size == cfg.intermediate_size
