"""Checkpoint / resume of a GRPO run: safetensors for every tensor, JSON for the rest (never pickle).

Layout: policy.safetensors (learner parameters), optimizer.safetensors (AdamW moments and step per
parameter, keyed "<param>::<field>"), optional eagle/ (head via save_eagle) + eagle_optimizer.safetensors,
state.json (step, versions, the learning-rate schedule, the run's config, history, evals, the model when given). Written into a
temporary directory that is renamed into place, so a crash never leaves a half-written checkpoint. A
checkpoint resumes only the run it came from: a different GRPOConfig is refused, naming the fields that
differ (`steps` may grow: a run can be extended).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tandem.errors import TandemError

STATE_FILE = "state.json"
SCHEMA_VERSION = 2
EXTENDABLE = ("steps", "eval_every")  # config fields a resumed run may change
GENERATOR_KEY = "__generator__"


def optimizer_tensors(optimizer: torch.optim.Optimizer, named_params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in named_params.items():
        for key, value in optimizer.state.get(param, {}).items():
            out[f"{name}::{key}"] = (value if torch.is_tensor(value) else torch.tensor(value)).detach().contiguous().clone()
    return out


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, named_params: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor]) -> None:
    for name, param in named_params.items():
        state = {key.split("::", 1)[1]: value for key, value in tensors.items() if key.split("::", 1)[0] == name}
        if state:
            optimizer.state[param] = state


def _trainable(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def save_checkpoint(trainer, path: str | Path, model: str | None = None) -> Path:
    """`model`: the run's model (zoo name or directory), recorded for `tandem export`."""
    from safetensors.torch import save_file

    from tandem.models.eagle import save_eagle

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy, moments, learner_state, lr = trainer.learner.checkpoint()  # a local Learner or a remote one (tandem.cluster.learner)
    save_file({n: t.contiguous() for n, t in policy.items()}, str(tmp / "policy.safetensors"))
    save_file(moments, str(tmp / "optimizer.safetensors"))
    state = {
        "schema_version": SCHEMA_VERSION, "step": trainer.step_index, "learner": learner_state,
        "lr": lr, "config": trainer.cfg.as_dict(), "history": trainer.history, "evals": trainer.evals,
    } | ({"model": model} if model else {})
    if trainer.online is not None:
        online = trainer.online
        save_eagle(online.head, tmp / "eagle")
        extra = {GENERATOR_KEY: online.generator.get_state()}  # the chain-root sampler: resume draws the same roots
        save_file(optimizer_tensors(online.optimizer, _trainable(online.head)) | extra, str(tmp / "eagle_optimizer.safetensors"))
        state |= {"eagle_trained_version": online.trained_version, "eagle_steps": online.steps}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
    old = path.with_name(path.name + ".old")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(trainer, path: str | Path) -> None:
    """Restore learner, optimizer, EAGLE head and loop state, then push the policy to the rollout engines."""
    from safetensors.torch import load_file

    from tandem.models.eagle import load_eagle

    path = Path(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
        policy = load_file(str(path / "policy.safetensors"))
        moments = load_file(str(path / "optimizer.safetensors"))
    except (OSError, ValueError, RuntimeError) as e:
        raise TandemError(f"cannot read a GRPO checkpoint from {path}: {e}") from e
    if state.get("schema_version") != SCHEMA_VERSION:
        raise TandemError(f"{path / STATE_FILE} has schema version {state.get('schema_version')}, expected {SCHEMA_VERSION}")
    check_config(state.get("config", {}), json.loads(json.dumps(trainer.cfg.as_dict())), path)
    learner = trainer.learner
    try:
        learner.restore(policy, moments, state["learner"])
    except TandemError as e:
        raise TandemError(f"{path}: {e}") from e
    trainer.step_index, trainer.history, trainer.evals = int(state["step"]), list(state["history"]), list(state["evals"])
    if trainer.online is not None and (path / "eagle").exists():
        online = trainer.online
        with torch.no_grad():
            online.head.load_state_dict(load_eagle(path / "eagle", learner.model).state_dict())
        tensors = load_file(str(path / "eagle_optimizer.safetensors"))
        online.generator.set_state(tensors.pop(GENERATOR_KEY))
        load_optimizer_tensors(online.optimizer, _trainable(online.head), tensors)
        online.trained_version, online.steps = int(state["eagle_trained_version"]), int(state["eagle_steps"])
    trainer.sync()


def check_config(saved: dict, current: dict, path: Path) -> None:
    """Refuse to resume under a changed config (the schedule, the data order and the objective depend on it)."""
    changed = sorted(k for k in set(saved) | set(current) if k not in EXTENDABLE and saved.get(k) != current.get(k))
    if changed:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
        raise TandemError(f"{path} was written by a run with another config ({detail}); resume with the same settings")
