"""Composition: a GRPO run from a model name and a list of drafters (what `tandem rl` calls)."""
from __future__ import annotations

from tandem.config import EngineConfig
from tandem.errors import InvalidParameterError
from tandem.rl.grpo import GRPOConfig, GRPOTrainer, Learner
from tandem.rl.rollout import RolloutEngine

MAX_PROMPT_TOKENS = 128  # chat-rendered task prompts are far shorter


def build_engines(target, drafters: list[str], max_batch: int, max_len: int, num_draft_tokens: int = 4, adaptive_k: bool = True,
                  model_name: str | None = None) -> list[RolloutEngine]:
    """One RolloutEngine per drafter name ("ar" = plain decoding), all sharing `target`. With adaptive_k each
    speculative engine gets the speculation controller `LLM` uses (calibrated costs for `model_name` on this
    machine when recorded, else measured online): draft length and on/off follow the live rollout batch."""
    from tandem.drafters import build_drafter
    from tandem.engine.control import SpeculationController

    if len(set(drafters)) != len(drafters) or not drafters:
        raise InvalidParameterError(f"drafters must be distinct and non-empty, got {drafters}")
    config = EngineConfig(max_batch_size=max_batch, max_model_len=max_len)  # a rollout batch's distinct prompts prefill packed
    engines = []
    for name in drafters:
        drafter = None if name == "ar" else build_drafter(name, target=target, num_draft_tokens=num_draft_tokens, max_batch=max_batch, max_len=max_len)
        policy = None
        if drafter is not None and adaptive_k:
            policy = SpeculationController.for_engine(target, drafter, model_name=model_name, max_k=num_draft_tokens)
        engines.append(RolloutEngine(target, drafter, config, draft_policy=policy, name=name))
    return engines


def build_trainer(model: str, drafters: list[str], cfg: GRPOConfig, num_draft_tokens: int = 4, adaptive_k: bool = True,
                  max_batch: int | None = None, reward_fn=None, eagle_lr: float = 1e-3) -> GRPOTrainer:
    """Rollout target (packed) and learner (a second, trainable copy) loaded from `model`."""
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
    eagle = next((e for e in engines if e.name in ("eagle", "eagle_tree")), None)
    online = OnlineEagle(eagle.drafter, lr=eagle_lr, seed=cfg.seed) if eagle is not None else None
    learner = Learner(load_transformer(path), cfg, taps=online.taps if online is not None else ())
    kwargs = {"reward_fn": reward_fn} if reward_fn is not None else {}
    return GRPOTrainer(learner, engines, load_tokenizer(path), cfg, online=online, **kwargs)
