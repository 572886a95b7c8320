"""Statistics of a domain-shifting stream's per-request rows (pure: lists in, numbers out).

A row is {"i", "domain", "acceptance_length", "tokens_per_s", "version"}; `bench shift`, its plot and
`tandem demo` read them.
"""
from __future__ import annotations


def rolling(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def recovery(rows: list[dict], block: int, window: int, level: float = 0.9) -> list[dict]:
    """After each shift: requests until the rolling mean (over the new block only) reaches `level` x the
    mean of the block before; None if it never does within the block."""
    values = [r["acceptance_length"] for r in rows]
    out = []
    for start in range(block, len(values), block):
        before = values[start - block : start]
        target = level * sum(before) / len(before)
        block_values = values[start : start + block]
        roll = rolling(block_values, window)
        hit = next((j + 1 for j, v in enumerate(roll) if j + 1 >= min(window, len(block_values)) and v >= target), None)
        out.append({"at": start, "domain": rows[start]["domain"], "previous_level": round(target / level, 4), "requests": hit})
    return out


def summarize(results: dict[str, list[dict]], cfg) -> dict:
    """Per mode: mean acceptance length and tokens/s, ratio to `static` (when run), per-domain means, recovery
    after each shift (cfg: block, window, domains)."""
    summary = {}
    static_mean = _mean([r["acceptance_length"] for r in results["static"]]) if "static" in results else None
    plain_speed = _mean([r["tokens_per_s"] for r in results["plain"]]) if "plain" in results else None
    for mode, rows in results.items():
        values = [r["acceptance_length"] for r in rows]
        shifts = recovery(rows, cfg.block, cfg.window)
        recovered = [s["requests"] for s in shifts if s["requests"] is not None]
        tail = rows[-cfg.block :]
        summary[mode] = {
            "mean_acceptance_length": round(_mean(values), 4),
            "ratio_to_static": round(_mean(values) / static_mean, 4) if static_mean else None,
            "mean_tokens_per_s": round(_mean([r["tokens_per_s"] for r in rows]), 3),
            "tokens_per_s_ratio_to_plain": round(_mean([r["tokens_per_s"] for r in rows]) / plain_speed, 4) if plain_speed else None,
            "last_block_acceptance_length": round(_mean([r["acceptance_length"] for r in tail]), 4),
            "per_domain": {d: round(_mean([r["acceptance_length"] for r in rows if r["domain"] == d]), 4) for d in cfg.domains},
            "recovery": shifts,
            "recovered_shifts": f"{len(recovered)}/{len(shifts)}",
            "max_recovery_requests": max(recovered) if recovered else None,
            "max_recovery_fraction": round(max(recovered) / len(rows), 4) if recovered else None,
        }
        deployed = [r["deployed_acceptance_length"] for r in rows if "deployed_acceptance_length" in r]
        if deployed:  # replay with the lookup branch: the drafter as deployed, and its ratio to static's deployed drafter
            static_deployed = [r.get("deployed_acceptance_length") for r in results.get("static", [])]
            base = _mean(static_deployed) if static_deployed and None not in static_deployed else None
            summary[mode] |= {"mean_deployed_acceptance_length": round(_mean(deployed), 4),
                              "deployed_ratio_to_static": round(_mean(deployed) / base, 4) if base else None}
    return summary


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def per_block(rows: list[dict], block: int) -> list[dict]:
    """Mean acceptance length of each block of the stream, with its domain and whether the domain was seen
    in an earlier block."""
    out, seen = [], set()
    for start in range(0, len(rows), block):
        part = rows[start : start + block]
        domain = part[0]["domain"]
        out.append({"at": start, "domain": domain, "repeat": domain in seen, "acceptance_length": round(_mean([r["acceptance_length"] for r in part]), 4)})
        seen.add(domain)
    return out


def after_first_block(rows: list[dict], block: int) -> dict[str, float]:
    """Per domain: mean acceptance length over its blocks after its first one (domains served once are left out)."""
    by_domain: dict[str, list[float]] = {}
    for b in per_block(rows, block):
        if b["repeat"]:
            part = rows[b["at"] : b["at"] + block]
            by_domain.setdefault(b["domain"], []).extend(r["acceptance_length"] for r in part)
    return {d: round(_mean(v), 4) for d, v in by_domain.items()}


def recovery_within_block(rows: list[dict], block: int, window: int, level: float = 0.9) -> list[dict]:
    """The issue's recovery measure: after each shift, requests until the rolling mean (over the new block
    only) reaches `level` x the mean of the block's own last `window` requests (its final level); the
    fraction of the block that took (None: never)."""
    out = []
    for start in range(block, len(rows), block):
        values = [r["acceptance_length"] for r in rows[start : start + block]]
        final = _mean(values[-window:])
        roll = rolling(values, window)
        hit = next((j + 1 for j, v in enumerate(roll) if j + 1 >= min(window, len(values)) and v >= level * final), None)
        out.append({"at": start, "domain": rows[start]["domain"], "final_level": round(final, 4), "requests": hit,
                    "fraction": round(hit / len(values), 4) if hit is not None else None})
    return out
