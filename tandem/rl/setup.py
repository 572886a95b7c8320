"""Composition: a GRPO run from a model name and a list of drafters (what `tandem rl` calls)."""
from __future__ import annotations

from tandem.config import EngineConfig
from tandem.errors import InvalidParameterError
from tandem.rl.grpo import GRPOConfig, GRPOTrainer
from tandem.rl.learner import Learner
from tandem.rl.rollout import RolloutEngine

MAX_PROMPT_TOKENS = 512  # one-shot chat-rendered reasoning prompts: ~120-350 tokens
FIXED = "@fixed"  # "suffix@fixed": that drafter at its full draft length every step (no controller)


def build_engines(target, drafters: list[str], max_batch: int, max_len: int, num_draft_tokens: int = 4, adaptive_k: bool = True,
                  model_name: str | None = None) -> list[RolloutEngine]:
    """One RolloutEngine per drafter spec, all sharing `target`: "ar" = plain decoding; "NAME" = that drafter under
    the speculation controller `LLM` uses when adaptive_k (calibrated costs for `model_name` on this machine when
    recorded, else measured online: draft length and on/off follow the live rollout batch); "NAME@fixed" = always
    speculate at num_draft_tokens."""
    from tandem.drafters import build_drafter
    from tandem.engine.control import SpeculationController

    if len(set(drafters)) != len(drafters) or not drafters:
        raise InvalidParameterError(f"drafters must be distinct and non-empty, got {drafters}")
    config = EngineConfig(max_batch_size=max_batch, max_model_len=max_len)  # a rollout batch's distinct prompts prefill packed
    engines = []
    for spec in drafters:
        name, fixed = (spec[: -len(FIXED)], True) if spec.endswith(FIXED) else (spec, False)
        drafter = None if name == "ar" else build_drafter(name, target=target, num_draft_tokens=num_draft_tokens, max_batch=max_batch, max_len=max_len)
        policy = None
        if drafter is not None and adaptive_k and not fixed:
            policy = SpeculationController.for_engine(target, drafter, model_name=model_name, max_k=num_draft_tokens)
        engines.append(RolloutEngine(target, drafter, config, draft_policy=policy, name=spec))
    return engines


def build_trainer(model: str, drafters: list[str], cfg: GRPOConfig, num_draft_tokens: int = 4, adaptive_k: bool = True,
                  max_batch: int | None = None, reward_fn=None, eagle_lr: float = 1e-3) -> GRPOTrainer:
    """Rollout target (packed), learner (a second, trainable copy) and, with a KL term, a frozen third copy."""
    from tandem.llm import load_tokenizer
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model
    from tandem.rl.eagle_online import OnlineEagle

    path = resolve_model(model)
    target = load_transformer(path)
    target.pack()
    max_len = min(MAX_PROMPT_TOKENS + cfg.max_tokens, target.cfg.max_position)
    batch = max_batch or min(cfg.prompts_per_step * cfg.group_size, 64)
    engines = build_engines(target, drafters, batch, max_len, num_draft_tokens, adaptive_k, model_name=model)
    eagle = next((e for e in engines if e.drafter is not None and e.drafter.name in ("eagle", "eagle_tree")), None)
    online = OnlineEagle(eagle.drafter, lr=eagle_lr, seed=cfg.seed) if eagle is not None else None
    reference = load_transformer(path) if cfg.kl_coef > 0 else None
    learner = Learner(load_transformer(path), cfg, taps=online.taps if online is not None else (), reference=reference)
    kwargs = {"reward_fn": reward_fn} if reward_fn is not None else {}
    return GRPOTrainer(learner, engines, load_tokenizer(path), cfg, online=online, **kwargs)
