"""The rollout simulator against a measured `tandem rl --json` run: predicted vs measured rollout speedups.

For every step of the run the simulator replays the measured completion lengths of the baseline engine (plain
decoding, `ar`) through `simulate_rollout` with a forward cost model (a calibration of this machine, or a
hardware preset): plain, and per speculative engine with its policy (`NAME@fixed`: always k; otherwise the
controller) and its drafter's measured quality. Quality is the acceptance length of the always-speculate twin
`NAME@fixed` where the run has one (the controller's own figure is diluted by the steps it did not speculate),
turned into one acceptance rate per draft position (`constant_acceptance`). The measured speedup is the ratio
of token rates (at T > 0 the engines' samples differ in length). The plain prediction against the measured
plain rollout time is the cost model's own error, shown per live batch too.
"""
from __future__ import annotations

from collections import defaultdict

from tandem.errors import InvalidParameterError
from tandem.ops.cost import expected_tokens_per_step
from tandem.sim.rollout import simulate_rollout
from tandem.sim.speculative import DraftCost, ForwardCost


def constant_acceptance(length: float, k: int) -> list[float]:
    """[a] * k such that a chain of k drafts emits `length` tokens per step in expectation: 1 + a + ... + a^k = length."""
    if k < 1:
        raise InvalidParameterError(f"k must be >= 1, got {k}")
    length = min(max(length, 1.0), k + 1.0)
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens_per_step([mid] * k, k) < length else (low, mid)
    return [round((low + high) / 2, 6)] * k


def _mean_acceptance(history: list[dict], name: str) -> float:
    return sum(h["acceptance_length"][name] for h in history) / len(history)


def _rate(history: list[dict], name: str) -> float:
    return sum(h["rollout_tokens"][name] for h in history) / sum(h["rollout_s"][name] for h in history)


def predicted_vs_measured(run: dict, forward: ForwardCost, drafts: dict[str, DraftCost], max_k: int, baseline: str = "ar") -> dict:
    """Per engine of the run: measured and predicted rollout speedup over plain decoding, and the cost model's error."""
    history = run.get("history") or []
    if not history or "completion_lengths" not in history[0]:
        raise InvalidParameterError("the run has no per-step completion lengths: rerun `tandem rl --json` with this version")
    engines = list(history[0]["rollout_s"])
    base = baseline if baseline in engines else engines[0]

    def predict(policy: str, alphas: list[float], draft: DraftCost) -> float:
        return sum(simulate_rollout(h["completion_lengths"][base], forward, alphas, max_k, policy, draft,
                                    int(h.get("prompt_tokens_mean", 0))).seconds for h in history)

    plain_s = predict("plain", [0.0] * max_k, DraftCost())
    measured_plain_s = sum(h["rollout_s"][base] for h in history)
    rows = []
    for name in engines:
        if name == base:
            continue
        drafter, _, mode = name.partition("@")
        policy = "fixed" if mode == "fixed" else "controller"
        quality_from = f"{drafter}@fixed" if f"{drafter}@fixed" in engines else name
        alphas = constant_acceptance(_mean_acceptance(history, quality_from), max_k)
        predicted = plain_s / predict(policy, alphas, drafts.get(drafter, DraftCost()))
        measured = _rate(history, name) / _rate(history, base)
        rows.append({"engine": name, "policy": policy, "acceptance_from": quality_from, "acceptance_per_position": alphas[0],
                     "measured_speedup": round(measured, 3), "predicted_speedup": round(predicted, 3),
                     "error": round(predicted / measured - 1.0, 4)})
    return {"baseline": base, "steps": len(history), "plain_measured_s": round(measured_plain_s, 3), "plain_predicted_s": round(plain_s, 3),
            "cost_model_error": round(plain_s / measured_plain_s - 1.0, 4), "engines": rows,
            "per_batch": _per_batch(history, base, forward)}


def _per_batch(history: list[dict], base: str, forward: ForwardCost) -> dict:
    """Plain decode steps by live batch: measured vs predicted mean seconds (context: prompt + step index)."""
    sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for h in history:
        prompt = int(h.get("prompt_tokens_mean", 0))
        for i, (batch, seconds, _k) in enumerate(h.get("profiles", {}).get(base, [])):
            row = sums[int(batch)]
            row[0] += seconds
            row[1] += forward(int(batch), 1, prompt + i)
            row[2] += 1
    return {b: {"steps": n, "measured_ms": round(1e3 * m / n, 2), "predicted_ms": round(1e3 * p / n, 2)} for b, (m, p, n) in sorted(sums.items())}


def format_comparison(result: dict, projection: bool = False) -> str:
    """`projection`: the cost model is another machine's (a GPU preset): the run's measured figures are this machine's,
    so no error is computed against them."""
    if projection:
        lines = [f"plain rollout over {result['steps']} steps: predicted {result['plain_predicted_s']} s there "
                 f"(measured here: {result['plain_measured_s']} s)",
                 "| engine | policy | acceptance/position (from) | predicted speedup there | measured here |", "|---|---|---|---|---|"]
        return "\n".join(lines + [f"| {r['engine']} | {r['policy']} | {r['acceptance_per_position']:.3f} ({r['acceptance_from']}) "
                                   f"| {r['predicted_speedup']:.3f}x | {r['measured_speedup']:.3f}x |" for r in result["engines"]])
    lines = [f"plain rollout: measured {result['plain_measured_s']} s, predicted {result['plain_predicted_s']} s "
             f"(cost model error {100 * result['cost_model_error']:+.1f} %) over {result['steps']} steps",
             "| engine | policy | acceptance/position (from) | measured speedup | predicted | error |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['engine']} | {r['policy']} | {r['acceptance_per_position']:.3f} ({r['acceptance_from']}) | {r['measured_speedup']:.3f}x "
              f"| {r['predicted_speedup']:.3f}x | {100 * r['error']:+.1f} % |" for r in result["engines"]]
    return "\n".join(lines)
