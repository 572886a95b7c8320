"""`tandem simulate`: speculation speedup per batch size for a model on a machine, and the RL step
around it (Amdahl for synchronous RL, overlap for asynchronous RL); or the paper's figures (--paper)."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import InvalidParameterError
from tandem.sim.amdahl import amdahl, overlapped
from tandem.sim.hardware import preset
from tandem.sim.paper import qwen3_235b_a22b
from tandem.sim.parallel import replica_machine
from tandem.sim.roofline import Machine, ModelWork, forward_seconds, is_memory_bound
from tandem.sim.speculative import DraftCost, best_chain


def _dense(name: str, layers: int, d: int, inter: int, heads: int, kv_heads: int, head_dim: int, vocab: int, bpp: float) -> ModelWork:
    q, kv = heads * head_dim, kv_heads * head_dim
    params = layers * (d * (q + 2 * kv) + q * d + 3 * d * inter) + vocab * d + d
    return ModelWork(name, params, bpp, 2 * layers * kv * 2, 4.0 * layers * q)


def model_work(name: str, precision: str) -> ModelWork:
    """Model shapes from their published configs; bytes per parameter from the precision."""
    bpp = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0}.get(precision)
    if bpp is None:
        raise InvalidParameterError(f"unknown precision {precision!r}")
    shapes = {
        "smollm2-135m": lambda: _dense(name, 30, 576, 1536, 9, 3, 64, 49_152, bpp),
        "qwen2.5-1.5b": lambda: _dense(name, 28, 1536, 8960, 12, 2, 128, 151_936, bpp),
        "qwen3-8b": lambda: _dense(name, 36, 4096, 12_288, 32, 8, 128, 151_936, bpp),
        "qwen3-235b-a22b": lambda: _with_bpp(qwen3_235b_a22b(), bpp),
    }
    if name not in shapes:
        raise InvalidParameterError(f"unknown model {name!r}; known: {', '.join(shapes)}")
    return shapes[name]()


MODEL_DIMS = {"smollm2-135m": (30, 576), "qwen2.5-1.5b": (28, 1536), "qwen3-8b": (36, 4096), "qwen3-235b-a22b": (94, 4096)}  # layers, hidden


def _with_bpp(work: ModelWork, bpp: float) -> ModelWork:
    from dataclasses import replace

    return replace(work, bytes_per_param=bpp)


@dataclass(frozen=True)
class SimulateConfig:
    model: str = "qwen3-8b"
    hardware: str = "h200"
    precision: str = "bf16"
    tp: int = 1
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    context: int = 2048
    acceptance: tuple[float, ...] = (0.8, 0.7, 0.6, 0.5, 0.4)
    max_k: int = 5
    draft_fraction: float = 0.05  # one draft depth costs this fraction of a batch-1 target forward
    generation_share: float = 0.7


@dataclass(frozen=True)
class CostModel:
    """One replica's forward and draft costs for a SimulateConfig (what every table here is computed from)."""

    work: ModelWork
    machine: Machine
    draft: DraftCost

    def forward(self, batch: int, tokens: int, context: int) -> float:
        return forward_seconds(self.work, self.machine, batch, tokens, context)

    def memory_bound(self, batch: int, context: int) -> bool:
        return is_memory_bound(self.work, self.machine, batch, 1, context)


def cost_model(config: SimulateConfig, machine: Machine | None = None) -> CostModel:
    """The model's work on one replica (`machine`, else the hardware preset at config.tp), drafting at
    config.draft_fraction of a batch-1 forward per depth."""
    work = model_work(config.model, config.precision)
    layers, hidden = MODEL_DIMS[config.model]
    machine = machine or replica_machine(preset(config.hardware), config.precision, config.tp, layers, hidden)
    draft = DraftCost(per_depth_s=config.draft_fraction * forward_seconds(work, machine, 1, 1, config.context))
    return CostModel(work, machine, draft)


def simulate_batches(config: SimulateConfig, machine: Machine | None = None) -> list[dict]:
    model = cost_model(config, machine)
    forward, draft, work, machine = model.forward, model.draft, model.work, model.machine
    rows = []
    for b in config.batch_sizes:
        k, speedup = best_chain(forward, b, config.context, list(config.acceptance), config.max_k, draft)
        rows.append({
            "batch": b, "plain_tok_s": round(b / forward(b, 1, config.context), 1), "best_k": k,
            "speedup": round(speedup, 3), "memory_bound": is_memory_bound(work, machine, b, 1, config.context),
            "sync_step_speedup": round(amdahl(config.generation_share, speedup), 3),
            "async_step_speedup": round(overlapped(config.generation_share, 1 - config.generation_share, speedup), 3),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    head = "| batch | plain tok/s | memory-bound | best k | rollout speedup | sync step | async step |\n|---|---|---|---|---|---|---|"
    lines = [f"| {r['batch']} | {r['plain_tok_s']} | {'yes' if r['memory_bound'] else 'no'} | {r['best_k']} | {r['speedup']:.2f}x "
             f"| {r['sync_step_speedup']:.2f}x | {r['async_step_speedup']:.2f}x |" for r in rows]
    return "\n".join([head, *lines])
