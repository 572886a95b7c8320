"""Named training recipes: `tandem train --recipe eagle-smollm2 --hours H --out DIR`.

A recipe run has two resumable phases that can also run side by side (`--phase features` in one process,
`--phase train` in another, the trainer picking up new shards as they appear):
1. features: reference-answer documents (prefill speed) and target-regenerated answers (batched greedy
   decoding), alternating in chunks so any prefix of the run mixes both, into DIR/features/{reference,
   regenerated}; held-out prompts (test split) are regenerated once into DIR/features/heldout.
2. train: the EAGLE head on packed batches streamed from the shards (tandem.training.trainer).
"""
from __future__ import annotations

import time
from pathlib import Path

from tandem.errors import InvalidParameterError
from tandem.training.recipes import Recipe, describe, get_recipe, load_target


def run_features(recipe: Recipe, out: Path, hours: float | None, chunk_docs: int = 128, clock: str = "wall") -> dict:
    """Alternate reference chunks (`chunk_docs` documents, prefill speed) and regenerated chunks (half as
    many, decoding speed: the target's own answers, closest to what serving drafts) until both are done or
    time (by `clock`, see tandem.training.trainer.CLOCKS) runs out."""
    from tandem.training.trainer import budget_clock
    from tandem.models.eagle import EagleConfig, target_identity
    from tandem.data.packages import package_files
    from tandem.training import sources
    from tandem.training.features import write_reference_features, write_regenerated_features

    now = budget_clock(clock)
    deadline = now() + 3600 * hours if hours else float("inf")
    target, tokenizer = load_target(recipe)
    taps, tid = EagleConfig.for_target(target.cfg).taps, target_identity(target.cfg)
    write_heldout(recipe, out, target, tokenizer)
    if recipe.validation:
        write_validation(recipe, out, target, tokenizer)
    reference = sources.reference_documents(package_files(), recipe.domains, recipe.chatterbot)
    regenerate = sources.regeneration_prompts(domains=recipe.domains, seed=recipe.seed, extra=recipe.extra_prompts)
    ref_writer, regen_writer = feature_writers(out, recipe.feature_kinds, tid, taps)  # `--kinds regenerated`: only the target's answers
    report = {"reference": [], "regenerated": []}
    ref_todo = [d for d in reference if not ref_writer.has(_key(d))] if ref_writer else []
    regen_todo = [d for d in regenerate if not regen_writer.has(_key(d))] if regen_writer else []
    while (ref_todo or regen_todo) and now() < deadline:
        if ref_todo:
            part, ref_todo = ref_todo[:chunk_docs], ref_todo[chunk_docs:]
            report["reference"].append(write_reference_features(ref_writer, target, tokenizer, part, recipe.max_doc_tokens).as_dict())
        if regen_todo and now() < deadline:
            n = chunk_docs // 2 if ref_todo else chunk_docs
            part, regen_todo = regen_todo[:n], regen_todo[n:]
            stats = write_regenerated_features(regen_writer, target, tokenizer, part, recipe.max_new_tokens, recipe.regen_batch, chunk=len(part))
            report["regenerated"].append(stats.as_dict())
    return report


def feature_writers(out: Path, kinds: tuple[str, ...], target_id: str, taps: tuple[int, ...]) -> tuple:
    """(reference, regenerated) shard writers, None for a kind not in `kinds`: a writer locks its directory, so
    a process opens only the kinds it writes (`make head-qwen15` runs one process per kind)."""
    from tandem.training.features import ShardWriter

    ref = ShardWriter(out / "features" / "reference", target_id, taps) if "reference" in kinds else None
    regen = ShardWriter(out / "features" / "regenerated", target_id, taps, shard_tokens=8192) if "regenerated" in kinds else None
    return ref, regen


def write_heldout(recipe: Recipe, out: Path, target, tokenizer) -> Path:
    """Target-regenerated answers to test-split prompts, `heldout_per_domain` per domain of every built-in
    domain (written once): the reported score."""
    from tandem.data.prompts import DOMAINS, load_prompts

    prompts = load_prompts("builtin", domains=DOMAINS, per_domain=recipe.heldout_per_domain, split="test", seed=recipe.seed)
    return _write_answers(out / "features" / "heldout", prompts, target, tokenizer)


def validation_prompts(recipe: Recipe, source: str = "builtin") -> list:
    """The next `heldout_per_domain` test-split prompts of each of the recipe's domains after the held-out
    ones (same shuffle): the checkpoint is chosen on these, so the reported held-out score is not the one
    that picked it."""
    from tandem.data.prompts import load_prompts

    n = recipe.heldout_per_domain
    prompts = load_prompts(source, domains=recipe.domains, per_domain=2 * n, split="test", seed=recipe.seed)
    return [p for d in recipe.domains for p in [q for q in prompts if q.domain == d][n : 2 * n]]


def write_validation(recipe: Recipe, out: Path, target, tokenizer) -> Path:
    return _write_answers(out / "features" / "validation", validation_prompts(recipe), target, tokenizer)


def _write_answers(directory: Path, prompts: list, target, tokenizer) -> Path:
    from tandem.models.eagle import EagleConfig, target_identity
    from tandem.training.features import ShardWriter, write_regenerated_features
    from tandem.training.sources import Document

    # wait=True: processes started side by side take turns here, and the later one finds the answers written
    writer = ShardWriter(directory, target_identity(target.cfg), EagleConfig.for_target(target.cfg).taps, shard_tokens=1 << 30, wait=True)
    if writer.index["shards"]:
        return directory
    docs = [Document(p.domain, p.source, p.id, p.prompt, None) for p in prompts]
    write_regenerated_features(writer, target, tokenizer, docs, 96, chunk=len(docs))
    return directory


def _key(doc) -> str:
    from tandem.training.features import doc_key

    return doc_key(doc)




# ---- one command: features and training side by side, then the exported head ------------------------------
PHASES = ("all", "features", "train")


def run_recipe(name: str, out: str | Path, hours: float, phase: str = "all", export: str | Path | None = None, log=print, kinds: tuple[str, ...] | None = None, init: str | Path | None = None, clock: str = "wall") -> dict:
    """`tandem train --recipe NAME --hours H --out DIR [--phase P] [--export DEST] [--init HEAD_DIR]`.

    phase "all" runs the features phase in a child process (one thread) next to the trainer (one
    thread), both resumable, for `hours` of wall time; then the best head is exported to DEST. `kinds`
    narrows the feature kinds both phases use (e.g. ("regenerated",)). `init`, an exported head, is where
    the trainer starts when DIR has no checkpoint yet (a checkpoint, when present, is resumed instead).
    `clock` "cpu" counts `hours` in each process's CPU time instead of wall time (both phases).
    """
    import json
    import subprocess
    import sys

    if phase not in PHASES:
        raise InvalidParameterError(f"phase must be one of {PHASES}, got {phase!r}")
    if hours <= 0:
        raise InvalidParameterError(f"hours must be > 0, got {hours}")
    from tandem.training.trainer import budget_clock

    budget_clock(clock)  # an unknown clock fails here, not in the child after the features are loaded
    if kinds is not None and (not kinds or set(kinds) - {"reference", "regenerated"}):
        raise InvalidParameterError(f"kinds must be a non-empty subset of reference,regenerated; got {kinds}")
    if init is not None:
        _check_init(Path(init).expanduser())
    recipe, out = get_recipe(name, feature_kinds=tuple(kinds) if kinds else None), Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"recipe": name}
    if phase == "features":
        report["features"] = run_features(recipe, out, hours, clock=clock)
    elif phase == "train":
        report["train"] = _train_then_finetune(recipe, out, hours, log, init, clock)
    else:
        cmd = [sys.executable, "-m", "tandem.cli", "train", "--recipe", name, "--out", str(out), "--hours", str(hours), "--phase", "features", "--threads", "1", "--kinds", ",".join(recipe.feature_kinds), "--clock", clock]
        child = subprocess.Popen(cmd, env=_one_thread_env())
        try:
            report["train"] = _train_then_finetune(recipe, out, hours, log, init, clock)
        finally:
            child.terminate()  # features are resumable: a later run continues where this one stopped
            child.wait(timeout=60)
    if export is not None:
        report["exported"] = str(export_head(out / "best", Path(export), name))
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def _check_init(head_dir: Path) -> None:
    """Refuse a wrong `--init` now rather than after the trainer has waited for the first feature shards."""
    from tandem.models.eagle import CONFIG_FILE, WEIGHTS_FILE

    if not (head_dir / CONFIG_FILE).is_file() or not (head_dir / WEIGHTS_FILE).is_file():
        raise InvalidParameterError(f"--init {head_dir}: not an exported EAGLE head (needs {CONFIG_FILE} and {WEIGHTS_FILE})")


def _train_then_finetune(recipe: Recipe, out: Path, hours: float, log, init: str | Path | None = None, clock: str = "wall") -> dict:
    """Train on every feature kind, then (resuming from the checkpoint, at the decayed learning rate) on the
    target-regenerated answers only: in the shipped run that last phase raised held-out acceptance from
    1.38 to 1.49 in 100 steps (docs/BENCHMARKS.md 3.1), the reference answers being off the target's style.
    Only the first part can start from `init`: the second always resumes the first's checkpoint."""
    from dataclasses import replace

    from tandem.training.trainer import train_recipe

    from tandem.training.trainer import has_shards

    main = train_recipe(recipe, out, hours * (1 - recipe.finetune_fraction), log=log, init=init, clock=clock)
    if recipe.finetune_fraction <= 0:
        return main
    if not has_shards(out / "features" / "regenerated"):  # a serial run whose features phase wrote none: nothing to fine-tune on
        log("no regenerated features yet: the fine-tuning part is skipped (run the features phase, then train again)")
        return main
    tuned = train_recipe(replace(recipe, feature_kinds=("regenerated",)), out, hours * recipe.finetune_fraction, log=log, clock=clock)
    return {"main": main, "finetune": tuned}


def _one_thread_env() -> dict:
    import os

    return os.environ | {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


HEAD_CARD = "recipe.json"
MAKE_TARGETS = {"eagle-smollm2": "make head", "eagle-smollm2-general": "make head-general", "eagle-qwen2.5-coder-1.5b": "make head-qwen15"}


def export_head(best: Path, dest: Path, recipe_name: str) -> Path:
    """Copy the best head (fp16 safetensors + config) to `dest` with a card: recipe, held-out report, sha256."""
    import hashlib
    import json
    import shutil

    if not (best / "model.safetensors").exists():
        raise InvalidParameterError(f"no trained head in {best}: run the train phase first")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("model.safetensors", "eagle_config.json"):
        shutil.copy2(best / name, tmp / name)
    heldout = json.loads((best / "report.json").read_text()) if (best / "report.json").exists() else None
    card = {
        "recipe": recipe_name, "settings": describe(get_recipe(recipe_name)), "default_drafter": get_recipe(recipe_name).default_drafter,
        "init": heldout.pop("init", None) if heldout else None,  # the exported head training started from, if any
        "sha256": hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest(),
        "heldout": heldout,
        "rebuild": f"{MAKE_TARGETS.get(recipe_name, 'make head')}  (tandem train --recipe {recipe_name} --hours H --out DIR --export {dest})",
    }
    (tmp / HEAD_CARD).write_text(json.dumps(card, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest
