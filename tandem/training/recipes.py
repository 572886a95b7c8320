"""Named training recipes (frozen settings) and the target they train for.

`tandem train --recipe NAME` runs one (tandem.training.pipeline); the settings live here so the trainer
and the pipeline both read them without importing each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from tandem.errors import InvalidParameterError


@dataclass(frozen=True)
class Recipe:
    model: str = "smollm2-135m"
    weights: str = "fp32"  # the target's weights while it computes features and serves the trainer its LM head rows (tandem.config.WEIGHTS)
    head_intermediate: int | None = None  # the draft layer's MLP width; None: the target's (EAGLE-3's choice)
    draft_vocab: int = 16384  # reduced draft vocabulary (chosen by coverage and cost: docs/BENCHMARKS.md)
    shared_lm_head: bool = True  # LM head rows are the target's (frozen, not saved): keeps the artifact small
    unroll: int = 4  # training-time-test steps
    chain_fraction: float = 0.25  # share of roots unrolled past step 0
    step_weight: float = 0.5  # unroll step s weighs step_weight**s in the loss (1.0: the mean over steps; 0.5 measured best, BENCHMARKS 3.1)
    rows: int = 4  # packed rows per batch
    row_len: int = 1024  # tokens per packed row
    lr: float = 1.5e-3
    init_lr: float = 2e-4  # peak lr of a run started from an exported head (--init): fine-tuned, not trained anew
    warmup: int = 30
    max_doc_tokens: int = 1024  # documents are cut here
    max_new_tokens: int = 192  # regenerated answer length
    regen_batch: int = 32  # sequences decoded at once when regenerating answers
    heldout_per_domain: int = 8
    eval_every: int = 60  # optimiser steps between held-out evaluations / checkpoints
    eval_depth: int = 4  # held-out chains are this many drafts long, whatever `unroll` trains (ablations compare at one depth)
    feature_kinds: tuple[str, ...] = ("reference", "regenerated")  # feature directories the trainer streams
    finetune_fraction: float = 0.15  # last share of the time: regenerated features only (the target's own answers)
    extra_prompts: bool = True  # also regenerate the extra SQL / chat prompts (tandem.training.more_prompts)
    domains: tuple[str, ...] = ("code", "sql", "math", "chat", "translation")  # what the head trains on (and is selected on)
    chatterbot: bool = False  # also chatterbot-corpus conversations as chat reference answers
    validation: bool = True  # select the best checkpoint on a validation split (test-split prompts disjoint from the reported held-out ones)
    default_drafter: bool = True  # shipped, it is the head LLM(drafter="eagle") loads for its target; False: a baseline (its card says so)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("draft_vocab", "unroll", "rows", "row_len", "max_doc_tokens", "max_new_tokens", "regen_batch", "eval_every", "eval_depth"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(f"recipe {name} must be >= 1, got {getattr(self, name)}")
        from tandem.config import WEIGHTS

        if self.weights not in WEIGHTS:
            raise InvalidParameterError(f"recipe weights must be one of {sorted(WEIGHTS)}, got {self.weights!r}")
        if self.head_intermediate is not None and self.head_intermediate < 1:
            raise InvalidParameterError(f"recipe head_intermediate must be >= 1, got {self.head_intermediate}")
        object.__setattr__(self, "domains", tuple(self.domains))
        unknown = set(self.domains) - set(TRAIN_DOMAINS)
        if not self.domains or unknown:
            raise InvalidParameterError(f"recipe domains must be a non-empty subset of {TRAIN_DOMAINS}, got {self.domains}")
        if not 0.0 < self.step_weight <= 1.0:
            raise InvalidParameterError(f"recipe step_weight must be in (0, 1], got {self.step_weight}")


TRAIN_DOMAINS = ("code", "sql", "math", "chat", "translation")

RECIPES = {
    "eagle-smollm2": Recipe(),
    # Aurora's static drafter: general chat / instruction data only (alpaca, chatterbot, the extra English chat
    # prompts); no code, SQL, math or translation. Reported on every domain's held-out answers, selected on chat.
    "eagle-smollm2-general": Recipe(domains=("chat",), chatterbot=True, default_drafter=False),
    # Qwen2.5-Coder-1.5B (issue 53 item 3). Features from the int4 target, the model a CPU user serves: at fp32 its
    # prefill would take 4x the memory traffic. The draft layer's MLP is half the target's width (4480 of 8960): a
    # draft token then reads ~55 M weights, and a training step costs about half (the CPU budget is the limit here).
    # Batches of 2 x 1024 tokens and a checkpoint every 20 steps keep an interrupted run's loss to minutes.
    "eagle-qwen2.5-coder-1.5b": Recipe(model="qwen2.5-coder-1.5b", weights="int4", head_intermediate=4480, rows=2, eval_every=20, warmup=20),
    # its general-data variant, the flywheel's starting point (as eagle-smollm2-general is for SmolLM2)
    "eagle-qwen2.5-coder-1.5b-general": Recipe(model="qwen2.5-coder-1.5b", weights="int4", head_intermediate=4480, rows=2, eval_every=20, warmup=20,
                                               domains=("chat",), chatterbot=True, default_drafter=False),
}


def get_recipe(name: str, **overrides) -> Recipe:
    if name not in RECIPES:
        raise InvalidParameterError(f"unknown recipe {name!r}; known: {sorted(RECIPES)}")
    return replace(RECIPES[name], **{k: v for k, v in overrides.items() if v is not None})


def load_target(recipe: Recipe):
    from tandem.llm import load_tokenizer
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model

    from tandem.config import WEIGHTS

    model_dir = resolve_model(recipe.model)
    target = load_transformer(model_dir)
    target.pack(gemm=WEIGHTS[recipe.weights])
    return target, load_tokenizer(model_dir)



def describe(recipe: Recipe) -> dict:
    return asdict(recipe)
