"""`tandem bench vocab`: the draft vocabulary's size, measured on one trained head.

A head whose LM head is the target's frozen rows runs over any draft vocabulary (`resize_draft_vocab`):
a larger one covers more of what the target writes, a smaller one makes each draft step cheaper (the
576 x Vd LM-head GEMM is most of a step). For each size this measures, in one run:
- held-out greedy-chain acceptance per domain (the recipe's evaluation over the target's own answers to
  test-split prompts, exact for greedy chains of k);
- the cost of one draft step (one token through the head, argmax), and the target's cost(1), cost(k + 1);
- the modelled chain speedup AL * cost(1) / (cost(k + 1) + k * draft step).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.bench.kernels.forward import forward_cost_ms
from tandem.bench.machine import machine_info
from tandem.errors import InvalidParameterError
from tandem.models.eagle import EagleHead, load_eagle, resize_draft_vocab, shipped_eagle_path
from tandem.models.kv_cache import KVCache
from tandem.models.loader import load_transformer
from tandem.models.zoo import resolve_model
from tandem.training.recipes import Recipe
from tandem.training.trainer import evaluate_heldout


@dataclass(frozen=True)
class VocabBenchConfig:
    heldout: str  # a recipe run's features/heldout directory
    model: str = "smollm2-135m"
    head: str | None = None  # default: the head shipped for the model
    sizes: tuple[int, ...] = (4096, 8192, 16384, 32768, 0)  # 0 = the target's whole vocabulary
    k: int = 4
    context: int = 128

    def __post_init__(self) -> None:
        if self.k < 1 or not self.sizes or any(s < 0 for s in self.sizes):
            raise InvalidParameterError("k >= 1 and sizes >= 0 (0 = whole vocabulary) are required")


def draft_step_ms(head: EagleHead, context: int, reps: int = 30) -> float:
    """Median ms of one drafted token: one cached head forward over one entry, then the argmax."""
    cache = KVCache(head.cfg.layer_config(), 1, context + reps + 8, torch.float32)
    gen = torch.Generator().manual_seed(0)
    d = head.cfg.hidden_size
    with torch.inference_mode():
        head(torch.randint(0, head.cfg.target_vocab_size, (1, context), generator=gen), torch.randn(1, context, d, generator=gen), cache=cache)
        ids, feats = torch.randint(0, head.cfg.target_vocab_size, (1, 1), generator=gen), torch.randn(1, 1, d, generator=gen)
        times = []
        for _ in range(reps + 3):
            t = time.perf_counter()
            logits, _ = head(ids, feats, cache=cache)
            logits.argmax(-1)
            times.append(time.perf_counter() - t)
            cache.truncate(0, context)
    return statistics.median(times[3:]) * 1000


def run_vocab_bench(cfg: VocabBenchConfig) -> dict:
    heldout = Path(cfg.heldout).expanduser()
    if not (heldout / "index.json").is_file():
        raise InvalidParameterError(f"{heldout} holds no feature index (a recipe run's features/heldout directory)")
    target = load_transformer(resolve_model(cfg.model))
    target.pack()
    path = cfg.head or shipped_eagle_path(target.cfg)
    if path is None:
        raise InvalidParameterError(f"no head given and none shipped for {cfg.model}")
    trained = load_eagle(path, target)
    costs = forward_cost_ms(target, ks=(1, cfg.k + 1), context=cfg.context)
    rows = []
    for size in cfg.sizes:
        head = resize_draft_vocab(trained, size or target.cfg.vocab_size, target.lm_head.weight).eval()
        report = evaluate_heldout(head, heldout, cfg.k, Recipe.row_len)  # packed as the recipe evaluates
        head.pack()
        step = draft_step_ms(head, cfg.context)
        al = report["mean_acceptance_length"]
        rows.append({
            "draft_vocab": head.cfg.draft_vocab_size, "mean_acceptance_length": al,
            "per_domain": {d: v["acceptance_length"] for d, v in report.items() if isinstance(v, dict)},
            "position0_top1": {d: v["accuracy_per_position"][0] for d, v in report.items() if isinstance(v, dict)},
            "draft_step_ms": round(step, 3),
            "modelled_speedup": round(al * costs[1] / (costs[cfg.k + 1] + cfg.k * step), 3),
        })
    return {"machine": machine_info(), "head": str(path), "k": cfg.k, "target_cost_ms": {str(k): round(v, 3) for k, v in costs.items()}, "sizes": rows}


def add_bench_vocab_command(bench) -> None:
    d = VocabBenchConfig(heldout="")
    p = bench.add_parser("vocab", help="draft vocabulary size on a trained head: held-out acceptance, draft cost, modelled speedup")
    p.add_argument("--heldout", required=True, help="a recipe run's features/heldout directory (tandem train --recipe ... --out DIR)")
    p.add_argument("--model", default=d.model)
    p.add_argument("--head", default=None, help="head directory (default: the one shipped for the model)")
    p.add_argument("--sizes", default=",".join(map(str, d.sizes)), help="comma list; 0 = the target's whole vocabulary")
    p.add_argument("--k", type=int, default=d.k, help="chain length")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run)


def _run(args) -> int:
    import json

    torch.set_num_threads(args.threads)
    sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
    result = run_vocab_bench(VocabBenchConfig(args.heldout, args.model, args.head, sizes, args.k))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0
