"""What `tandem rl --compare` reports: rollout and step speedups per drafter, the Amdahl prediction,
the batch-size sweep, and a plot (held-out reward and exact accuracy, rollout time per drafter, the long-tail profile).

Step time of drafter d (all measured in the same steps, same prompts, seeds and weights):
    step_d = rollout_d + update + sync_target + resync_d
where update (the learner's forward/backward/optimiser, incl. online EAGLE training) is shared. The
rollout share of a plain-decoding step is f = rollout_ar / step_ar, s = rollout_ar / rollout_d, and
Amdahl's prediction of the step speedup is 1 / (f / s + 1 - f); the measured step speedup is
step_ar / step_d, which also pays d's re-sync.

At temperature > 0 the drafters' rollouts have different lengths (speculative sampling draws its random
numbers differently, so the samples differ from the first token on, with the same distribution): wall
times then compare different amounts of work, so the token rate (completion tokens / rollout time) is
reported next to them and the batch sweep's speedup is a ratio of token rates.
"""
from __future__ import annotations

import time

from tandem.config import SamplingParams


def summarize(history: list[dict], baseline: str = "ar") -> dict:
    if not history:
        return {}
    drafters = list(history[0]["rollout_s"])
    update = sum(h["train_s"] for h in history)
    sync_target = sum(h["sync"].get("target", 0.0) for h in history)
    rollout = {d: sum(h["rollout_s"][d] for h in history) for d in drafters}
    resync = {d: sum(h["sync"].get(f"resync/{d}", 0.0) + (h["sync"].get("publish/eagle", 0.0) if d.startswith("eagle") else 0.0)
                     for h in history) for d in drafters}
    step = {d: rollout[d] + update + sync_target + resync[d] for d in drafters}
    out = {"steps": len(history), "update_s": round(update, 3), "sync_target_s": round(sync_target, 3), "per_drafter": {}}
    base = baseline if baseline in drafters else drafters[0]
    f = rollout[base] / step[base]
    out["generation_share"] = round(f, 4)
    for d in drafters:
        s = rollout[base] / rollout[d]
        amdahl = 1.0 / (f / s + 1.0 - f)
        measured = step[base] / step[d]
        out["per_drafter"][d] = {
            "rollout_s": round(rollout[d], 3), "step_s": round(step[d], 3), "resync_s": round(resync[d], 4),
            "resync_share_of_step": round(resync[d] / step[d], 4), "rollout_speedup": round(s, 3),
            "step_speedup": round(measured, 3), "amdahl_prediction": round(amdahl, 3),
            "measured_vs_amdahl": round(measured / amdahl - 1.0, 4),
            "acceptance_length": round(sum(h["acceptance_length"][d] for h in history) / len(history), 3),
            "steps_same_rollouts_as_first": sum(h["same_rollouts"][d] for h in history if "same_rollouts" in h),
        }
        if all("rollout_tokens" in h for h in history):
            rate = {k: sum(h["rollout_tokens"][k] for h in history) / rollout[k] for k in (base, d)}
            out["per_drafter"][d] |= {"rollout_tokens_per_s": round(rate[d], 2), "rollout_rate_speedup": round(rate[d] / rate[base], 3)}
    out["step_wall_s_mean"] = round(sum(h["step_wall_s"] for h in history) / len(history), 3)
    out["tail"] = tail_profile(history)
    out["eagle_staleness"] = [h.get("eagle_staleness") for h in history] if "eagle_staleness" in history[0] else None
    return out


TAIL_BUCKETS = ((1, 1), (2, 4), (5, 15), (16, 1 << 30))  # live-batch ranges of the tail profile


def tail_profile(history: list[dict]) -> dict:
    """Per engine and live-batch range, over all steps: decode steps, seconds, share of the rollout time,
    tokens-per-step-weighted mean draft length and the share of requests the controller let speculate."""
    out = {}
    for name in history[0].get("decisions", {}) if history else []:  # records without decisions (hand-made) have no profile
        rows, total = {}, 0.0
        for low, high in TAIL_BUCKETS:
            steps = seconds = k_sum = on = n = 0.0
            for h in history:
                for batch, d in h["decisions"][name].items():
                    if low <= int(batch) <= high:
                        steps += d["steps"]
                        seconds += d["seconds"]
                        k_sum += d["mean_k"] * d["steps"] * int(batch)
                        on += d["spec_share"] * d["steps"] * int(batch)
                        n += d["steps"] * int(batch)
            label = f"{low}" if low == high else (f"{low}-{high}" if high < 1 << 30 else f">={low}")
            rows[label] = {"steps": int(steps), "seconds": round(seconds, 3), "mean_k": round(k_sum / n, 3) if n else 0.0,
                           "spec_share": round(on / n, 3) if n else 0.0}
            total += seconds
        for r in rows.values():
            r["time_share"] = round(r["seconds"] / total, 4) if total else 0.0
        out[name] = rows
    return out


def batch_sweep(engines, prompts: list[list[int]], sizes: list[int], max_tokens: int, temperature: float, seed: int) -> dict:
    """Rollout wall time per drafter at each batch size (size prompts x 1 sample), and the decisions."""
    out = {}
    for size in sizes:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        row = {}
        for engine in engines:
            if size > engine.engine.config.max_batch_size:
                continue
            batch = engine.generate_rollouts(prompts[:size], 1, params)
            row[engine.name] = {"wall_s": round(batch.wall_s, 4), "acceptance_length": round(batch.acceptance_length(), 3),
                                "tokens": sum(len(r.completion_ids) for r in batch.rollouts), "decisions": batch.decisions()}
        for r in row.values():
            r["tokens_per_s"] = round(r["tokens"] / r["wall_s"], 2)
        base = row.get("ar")  # not necessarily the first engine
        for r in row.values():
            r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3) if base else None  # token rates: lengths differ
        out[str(size)] = row
    return out


def learning_curves(evals: list[dict], reward_label: str = "reward") -> list[tuple[str, list[int], list[float]]]:
    """The plot's learning panel: (label, steps, values) per held-out curve, the reward and the exact accuracy
    (evals from before exact accuracy was recorded have the reward alone)."""
    steps = [e["step"] for e in evals]
    curves = []
    for mode in ("greedy", "sampled"):
        curves.append((f"{reward_label}, {mode}", steps, [e[mode] for e in evals]))
        if evals and all(f"{mode}_exact" in e for e in evals):
            curves.append((f"exact accuracy, {mode}", steps, [e[f"{mode}_exact"] for e in evals]))
    return curves


def plot(history: list[dict], evals: list[dict], path: str, title: str = "", reward_label: str = "reward") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for label, steps, values in learning_curves(evals, reward_label):
        ax.plot(steps, values, marker="o", linestyle="--" if label.startswith("exact") else "-", label=label)
    ax.set_xlabel("GRPO step"), ax.set_ylabel("held-out score"), ax.set_ylim(0, 1), ax.legend(fontsize=8), ax.set_title("learning")
    ax = axes[1]
    for d in history[0]["rollout_s"]:
        ax.plot([h["step"] for h in history], [h["rollout_s"][d] for h in history], marker=".", label=d)
    ax.plot([h["step"] for h in history], [h["train_s"] for h in history], "k--", label="update (learner)")
    ax.set_xlabel("GRPO step"), ax.set_ylabel("seconds"), ax.legend(), ax.set_title("rollout time per drafter")
    ax = axes[2]
    last = history[-1]
    for d, profile in last["profiles"].items():
        t, xs, ys = 0.0, [], []
        for batch, seconds, *_ in profile:
            xs += [t, t + seconds]
            ys += [batch, batch]
            t += seconds
        ax.plot(xs, ys, label=d)
    ax.set_xlabel("seconds into the rollout"), ax.set_ylabel("live batch (sequences decoding)"), ax.legend()
    ax.set_title(f"the long tail (step {last['step']})")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
