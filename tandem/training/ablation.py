"""Trained ablations of a recipe: `tandem train --recipe NAME --out DIR --ablate FIELD=V1,V2 ... --ablate-steps N`.

Every variant changes one recipe field (the recipe's own setting is the baseline), trains a fresh head on the
same feature shards (DIR/features, made by the recipe's features phase) for the same number of optimiser
steps, and is scored on the same held-out answers with chains of `Recipe.eval_depth` drafts, so the variants
differ only in the field. Variants run in child processes (`parallel` at a time, one thread each), each in
DIR/ablation-<steps>/<variant>, resumable like any recipe run; report.json and report.md there collect
the final held-out scores and each variant's training speed.
"""
from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, fields, replace
from multiprocessing import get_context
from pathlib import Path

from tandem.child_env import child_environment
from tandem.errors import InvalidParameterError
from tandem.training.recipes import Recipe

ABLATABLE = ("draft_vocab", "unroll", "step_weight", "chain_fraction", "lr", "warmup")  # fields a variant may change (not the batch shape: same steps must mean same data)
BASELINE = "baseline"


def parse_ablations(recipe: Recipe, specs: list[str]) -> dict[str, dict]:
    """{variant name: recipe overrides}: the baseline, then one variant per listed value that differs from the
    recipe's own (e.g. ["draft_vocab=8192,32768", "unroll=2,6"])."""
    types = {f.name: type(getattr(recipe, f.name)) for f in fields(recipe)}
    variants: dict[str, dict] = {BASELINE: {}}
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip()
        if not sep or name not in ABLATABLE or not values.strip():
            raise InvalidParameterError(f"--ablate {spec!r}: expected FIELD=V1,V2 with FIELD one of {ABLATABLE}")
        for text in values.split(","):
            try:
                value = types[name](text.strip())
            except ValueError:
                raise InvalidParameterError(f"--ablate {spec!r}: {text!r} is not a {types[name].__name__}") from None
            replace(recipe, **{name: value})  # the recipe validates the value now, not in a child process later
            if value != getattr(recipe, name):
                variants[f"{name}={text.strip()}"] = {name: value}
    return variants


def run_ablation(recipe: Recipe, out: str | Path, specs: list[str], steps: int, parallel: int = 2, log=print, name: str = "") -> dict:
    """Train every variant for `steps` steps on DIR/features/regenerated and tabulate their held-out scores."""
    if steps < 1 or parallel < 1:
        raise InvalidParameterError(f"ablation steps and parallel must be >= 1, got {steps} and {parallel}")
    out = Path(out).expanduser()
    if not (out / "features" / "regenerated" / "index.json").is_file() or not (out / "features" / "heldout" / "index.json").is_file():
        raise InvalidParameterError(f"{out}/features has no regenerated shards or held-out answers: run `tandem train --recipe NAME "
                                    f"--out {out} --phase features --kinds regenerated` first")
    variants = parse_ablations(recipe, specs)
    root = ablation_dir(out, steps)
    results = {}
    with child_environment(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE"):  # two spinning jobs on 2 cores slow both ~10x
        with ProcessPoolExecutor(max_workers=parallel, mp_context=get_context("spawn")) as pool:
            futures = {v: pool.submit(train_variant, recipe, overrides, str(_variant_dir(out, root, v)), steps) for v, overrides in variants.items()}
            for variant, future in futures.items():
                results[variant] = future.result()
                log(f"ablation {variant}: {json.dumps(results[variant])}")
    report = {"recipe": name, "settings": asdict(recipe), "steps": steps, "eval_depth": recipe.eval_depth, "features": str(out / "features"), "variants": results}
    (root / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (root / "report.md").write_text(markdown_table(report) + "\n")
    return report


def ablation_dir(out: Path, steps: int) -> Path:
    """DIR/ablation-<steps>: runs of another step budget never resume these checkpoints."""
    return Path(out).expanduser() / f"ablation-{steps}"


def _variant_dir(out: Path, root: Path, variant: str) -> Path:
    """ROOT/<variant>, its features a link to DIR/features (the regenerated shards: the target's own text)."""
    directory = root / variant.replace("=", "-")
    directory.mkdir(parents=True, exist_ok=True)
    link = directory / "features"
    if not link.exists():
        link.symlink_to((out / "features").resolve(), target_is_directory=True)
    return directory


def train_variant(recipe: Recipe, overrides: dict, out: str, steps: int) -> dict:
    """One variant in a child process (one thread): train to `steps`, return its final held-out scores."""
    import torch

    from tandem.training.trainer import train_recipe

    torch.set_num_threads(1)
    recipe = replace(recipe, feature_kinds=("regenerated",), **overrides)
    report = train_recipe(recipe, Path(out), hours=None, log=lambda _: None, max_steps=steps)
    final = report["final"]
    heldout = final["heldout"]
    domains = {k: v for k, v in heldout.items() if isinstance(v, dict)}
    return {
        "overrides": overrides, "steps": report["steps"], "tokens": report["tokens"], "seconds": final["seconds"],
        "train_tokens_per_s": round(report["tokens"] / final["seconds"], 1) if final["seconds"] else None,
        "mean_acceptance_length": heldout["mean_acceptance_length"],
        "acceptance_length": {k: v["acceptance_length"] for k, v in domains.items()},
        "position0_top1": round(sum(v["accuracy_per_position"][0] for v in domains.values()) / max(1, len(domains)), 4),
    }


def markdown_table(report: dict) -> str:
    variants = report["variants"]
    domains = sorted({d for v in variants.values() for d in v["acceptance_length"]})
    head = ["variant", "mean AL", *domains, "pos-0 top-1", "train tok/s", "minutes"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in variants.items():
        cells = [name, f"{v['mean_acceptance_length']:.3f}", *(f"{v['acceptance_length'].get(d, float('nan')):.2f}" for d in domains),
                 f"{v['position0_top1']:.3f}", str(v["train_tokens_per_s"]), f"{v['seconds'] / 60:.1f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
