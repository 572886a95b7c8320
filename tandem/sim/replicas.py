"""N engine replicas serving one offered load: aggregate tokens/s and per-request latency, plain and with
speculation (pure math over tandem.sim.speculative's step cost).

The load is `load` concurrent requests in a closed loop (each client sends its next request when its answer
arrives), split as evenly as possible over N alike replicas: replica i decodes a batch of load / N (the first
load % N replicas one more; replicas beyond the load stay idle). A replica decodes its batch in steady state at
`context` cached tokens: plain, one token per sequence per step of forward(b, 1, c); speculative, the chain
length k in 0..max_k with the most tokens per second for that batch (best_chain: the controller with perfect
knowledge of the costs), E(k) tokens per sequence per step of draft(k) + forward(b, 1 + k, c). A request of T
output tokens takes

    latency = routing_s + T / per-sequence tokens/s          aggregate tokens/s = sum_i b_i * T / latency_i

where routing_s is the fixed per-request cost of reaching a replica (Ray's proxy and actor call: measured by
tandem.cluster.overhead). Not modelled: prefill, the batch draining as requests end (tandem.sim.rollout does
that), replicas of unequal speed, and the router's own capacity.
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import InvalidParameterError
from tandem.sim.speculative import DraftCost, ForwardCost, best_chain, step_tokens_per_s


@dataclass(frozen=True)
class ReplicaProjection:
    replicas: int
    batch: int  # requests on the busiest replica (ceil(load / replicas))
    best_k: int  # the busiest replica's chain length (0: plain)
    tok_s: float  # aggregate output tokens/s over all replicas
    latency_s: float  # one request on the busiest replica, routing included


def split_load(load: int, replicas: int) -> list[int]:
    """Requests per replica: as even as possible, the first ones one more."""
    if load < 1 or replicas < 1:
        raise InvalidParameterError(f"need load >= 1 and replicas >= 1, got {load}, {replicas}")
    size, extra = divmod(load, replicas)
    return [size + (1 if i < extra else 0) for i in range(replicas)]


def sequence_rate(forward: ForwardCost, batch: int, context: int, acceptance: list[float], k: int, draft: DraftCost) -> float:
    """Tokens/s one sequence receives in a batch of `batch` all drafting a chain of k (k = 0: plain)."""
    return step_tokens_per_s(forward, batch, context, acceptance, [1] * k, draft) / batch


def project(forward: ForwardCost, load: int, replicas: int, output_tokens: int, context: int, acceptance: list[float], max_k: int,
            draft: DraftCost = DraftCost(), routing_s: float = 0.0, speculate: bool = True) -> ReplicaProjection:
    """`load` concurrent requests of `output_tokens` each over `replicas` replicas (speculate=False: plain decoding)."""
    if output_tokens < 1 or context < 0 or routing_s < 0:
        raise InvalidParameterError(f"need output_tokens >= 1, context >= 0, routing_s >= 0; got {output_tokens}, {context}, {routing_s}")
    tok_s, busiest = 0.0, None
    for batch in (b for b in split_load(load, replicas) if b > 0):
        k = best_chain(forward, batch, context, acceptance, max_k, draft)[0] if speculate else 0
        latency = routing_s + output_tokens / sequence_rate(forward, batch, context, acceptance, k, draft)
        tok_s += batch * output_tokens / latency
        if busiest is None:  # split_load puts the largest share first
            busiest = (batch, k, latency)
    batch, k, latency = busiest
    return ReplicaProjection(replicas, batch, k, tok_s, latency)


def fits_memory(work, batch: int, context: int, device_bytes: float) -> bool:
    """The weights and `batch` sequences' KV cache at `context` tokens fit in one replica's device memory."""
    return work.total_params * work.bytes_per_param + batch * context * work.kv_bytes_per_token <= device_bytes


def replica_table(config, replica_counts: list[int], load: int, output_tokens: int, routing_s: float = 0.0, machine=None) -> list[dict]:
    """One row per replica count: plain and speculative projections on `config`'s model and hardware
    (tandem.sim.report.SimulateConfig; the same cost model as its per-batch table)."""
    from tandem.sim.hardware import preset
    from tandem.sim.report import cost_model

    model = cost_model(config, machine)
    device_bytes = preset(config.hardware).memory_gb * 1e9 * config.tp
    acceptance = list(config.acceptance)
    rows, base = [], None
    for n in replica_counts:
        plain = project(model.forward, load, n, output_tokens, config.context, acceptance, config.max_k, model.draft, routing_s, speculate=False)
        spec = project(model.forward, load, n, output_tokens, config.context, acceptance, config.max_k, model.draft, routing_s)
        base = base or plain
        rows.append({
            "replicas": n, "batch_per_replica": plain.batch, "memory_bound": model.memory_bound(plain.batch, config.context),
            "fits": fits_memory(model.work, plain.batch, config.context, device_bytes),
            "plain_tok_s": round(plain.tok_s, 1), "plain_latency_s": round(plain.latency_s, 3), "best_k": spec.best_k,
            "spec_tok_s": round(spec.tok_s, 1), "spec_latency_s": round(spec.latency_s, 3), "spec_speedup": round(spec.tok_s / plain.tok_s, 3),
            "plain_scaling": round(plain.tok_s / base.tok_s, 3),
        })
    return rows


def format_replica_table(rows: list[dict]) -> str:
    head = ("| replicas | batch / replica | fits memory | memory-bound | plain tok/s | plain latency s | scaling | best k | spec tok/s | spec latency s "
            "| spec speedup |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['replicas']} | {r['batch_per_replica']} | {'yes' if r['fits'] else 'NO'} | {'yes' if r['memory_bound'] else 'no'} | {r['plain_tok_s']} | {r['plain_latency_s']} "
             f"| {r['plain_scaling']:.2f}x | {r['best_k']} | {r['spec_tok_s']} | {r['spec_latency_s']} | {r['spec_speedup']:.2f}x |" for r in rows]
    return "\n".join([head, *lines])
