"""The recipe trainer's starting point: `--init` (an exported head) when the run has no checkpoint, else resume."""
import json

import pytest
import torch

from tandem.errors import InvalidParameterError
from tandem.models.eagle import EagleConfig, default_taps, draft_vocab_from_tokens, load_eagle, new_eagle_head, save_eagle, target_identity
from tandem.models.loader import load_transformer
from tandem.training.features import FeatureDoc, ShardWriter, target_features
from tandem.training.recipes import Recipe
from tandem.training.trainer import resume, train_recipe


@pytest.fixture(scope="module")
def target(tiny_llama):
    return load_transformer(tiny_llama)


def write_features(target, out):
    """A few tiny documents in every directory the trainer waits for (reference, regenerated, heldout)."""
    taps, tid = default_taps(target.cfg.num_layers), target_identity(target.cfg)
    for i, kind in enumerate(("reference", "regenerated", "heldout")):
        writer = ShardWriter(out / "features" / kind, tid, taps)
        for j in range(2):
            ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(10 * i + j)).tolist()
            tap, final = target_features(target, ids, taps)
            writer.add(FeatureDoc(f"{kind}/x/{j}", ("code", "sql")[j], torch.tensor(ids), 6, tap, final))
        writer.flush()
        writer._lock.close()


def exported_head(target, path, seed, vocab_size=120):
    """A head with its own (non-default) draft vocabulary and random weights, saved as an export is (fp16)."""
    cfg = EagleConfig.for_target(target.cfg, vocab_size, shared_lm_head=True)
    vocab = draft_vocab_from_tokens([list(range(300 - vocab_size, 300))], vocab_size, target.cfg.vocab_size)
    head = new_eagle_head(target, cfg, vocab, torch.Generator().manual_seed(seed))
    save_eagle(head, path, dtype=torch.float16)
    return load_eagle(path, target)


def same_head(a, b):
    return torch.equal(a.draft_to_target, b.draft_to_target) and all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_init_starts_from_the_exported_head_and_a_checkpoint_wins_later(tiny_llama, target, tmp_path):
    out, logs = tmp_path / "run", []
    write_features(target, out)
    first = exported_head(target, tmp_path / "first", seed=1)
    recipe = Recipe(model=tiny_llama, draft_vocab=64, rows=1, row_len=64, finetune_fraction=0.0)
    report = train_recipe(recipe, out, hours=0.0, log=logs.append, init=tmp_path / "first")  # no step: the head as it started
    assert report["init"] == str((tmp_path / "first").resolve()) and report["steps"] == 0
    head, _, _, state = resume(out / "ckpt", target)
    assert state.init == report["init"]
    assert head.cfg.draft_vocab_size == 120 != recipe.draft_vocab  # the head's own vocabulary, not the recipe's
    assert same_head(head, first)
    assert not (out / "vocab_coverage.json").exists()  # no fresh vocabulary was chosen
    assert json.loads((out / "best" / "report.json").read_text())["init"] == report["init"]
    assert [entry["step"] for entry in state.history] == [0, 0]  # the starting head was scored before any step

    exported_head(target, tmp_path / "second", seed=2, vocab_size=80)
    again = train_recipe(recipe, out, hours=0.0, log=logs.append, init=tmp_path / "second")
    assert any("ignored" in line for line in logs)
    assert again["init"] == report["init"] and same_head(resume(out / "ckpt", target)[0], first)


def test_a_run_from_init_fine_tunes_at_the_recipes_init_lr(tiny_llama, target, tmp_path):
    out = tmp_path / "run"
    write_features(target, out)
    exported_head(target, tmp_path / "first", seed=1)
    recipe = Recipe(model=tiny_llama, draft_vocab=64, rows=1, row_len=64, finetune_fraction=0.0, lr=1.0, init_lr=1e-5, warmup=1, eval_every=2)
    train_recipe(recipe, out, hours=3e-4, init=tmp_path / "first")
    _, _, groups, state = resume(out / "ckpt", target)
    assert state.step >= 2 and 0 < groups[0]["lr"] <= 1e-5  # never the from-scratch lr of 1.0


def test_exported_card_says_where_training_started(target, tmp_path):
    from tandem.training.pipeline import export_head

    best = tmp_path / "run" / "best"
    save_eagle(exported_head(target, tmp_path / "init", seed=3), best, dtype=torch.float16)
    (best / "report.json").write_text(json.dumps({"step": 5, "heldout": {}, "init": "/heads/v1"}))
    export_head(best, tmp_path / "out", "eagle-smollm2")
    card = json.loads((tmp_path / "out" / "recipe.json").read_text())
    assert card["init"] == "/heads/v1" and "init" not in card["heldout"] and card["settings"]["extra_prompts"] is True


def test_run_recipe_refuses_an_init_that_is_not_a_head(tmp_path):
    from tandem.training.pipeline import run_recipe

    with pytest.raises(InvalidParameterError, match="not an exported EAGLE head"):
        run_recipe("eagle-smollm2", tmp_path / "run", 1.0, phase="train", init=tmp_path)


def test_cli_passes_init_to_the_recipe(monkeypatch, tmp_path):
    import tandem.training.pipeline as pipeline
    from tandem.cli import main

    seen = {}
    monkeypatch.setattr(pipeline, "run_recipe", lambda *args, **kwargs: seen.update(kwargs) or {})
    main(["train", "--recipe", "eagle-smollm2", "--out", str(tmp_path), "--init", "/heads/v1"])
    assert seen["init"] == "/heads/v1"


def test_the_cpu_clock_does_not_run_while_the_process_waits():
    import time

    from tandem.training.trainer import budget_clock

    cpu, wall = budget_clock("cpu"), budget_clock("wall")
    c0, w0 = cpu(), wall()
    time.sleep(0.3)
    assert wall() - w0 >= 0.3 and cpu() - c0 < 0.05
    with pytest.raises(InvalidParameterError, match="clock must be one of"):
        budget_clock("gpu")


def test_train_recipe_spends_its_budget_on_the_chosen_clock(monkeypatch, tiny_llama, target, tmp_path):
    """With a clock that does not move (a run whose process got no CPU), a tiny budget never runs out and the
    run goes to max_steps; on the wall clock the same budget is spent before the first step."""
    import tandem.training.trainer as trainer

    monkeypatch.setitem(trainer.CLOCKS, "cpu", lambda: 100.0)
    recipe = Recipe(model=tiny_llama, draft_vocab=64, rows=1, row_len=64, finetune_fraction=0.0, eval_every=100)
    for clock, steps in (("cpu", 3), ("wall", 0)):
        out = tmp_path / clock
        write_features(target, out)
        report = train_recipe(recipe, out, hours=1e-9, max_steps=3, clock=clock)
        assert report["steps"] == steps


def test_cli_passes_the_clock_to_the_recipe(monkeypatch, tmp_path):
    import tandem.training.pipeline as pipeline
    from tandem.cli import main

    with pytest.raises(InvalidParameterError, match="clock must be one of"):
        pipeline.run_recipe("eagle-smollm2", tmp_path / "run", 1.0, clock="gpu")
    seen = []
    monkeypatch.setattr(pipeline, "run_recipe", lambda *args, **kwargs: seen.append(kwargs["clock"]) or {})
    main(["train", "--recipe", "eagle-smollm2", "--out", str(tmp_path)])
    main(["train", "--recipe", "eagle-smollm2", "--out", str(tmp_path), "--clock", "cpu"])
    assert seen == ["wall", "cpu"]
