"""The verdict of `tandem bench soak`: each request's end classified (5xx attributed to the injected faults), RSS and
state-directory growth against what they may hold, every check of the run, and the report's table."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.server.admin import KEEP_VERSIONS

# RSS growth after the warm-up that is not a leak: by then the weights, their packed copies, the KV cache, the
# drafter and the thread pools are allocated; what may still grow is the allocator's high-water mark (a batch of
# longer prompts than any seen in the warm-up: activations, freed to the allocator but not to the OS) and Python's
# per-request objects (bounded by the concurrency). Both are a fraction of what the server already holds, so the
# bound is a quarter of the warm-up-end RSS, at least 128 MB (a small model's allocator arenas alone reach tens of MB).
RSS_GROWTH_FRACTION = 0.25
RSS_GROWTH_FLOOR_MB = 128.0
# What the state directory holds: drafter version files, of which the server keeps the newest KEEP_VERSIONS plus the
# one served; online, versions are pruned every 10 s, so up to PRUNE_SLACK_VERSIONS more may exist between prunes,
# the trainer's checkpoint (overwritten in place: the head's weights and Adam's two moments, CHECKPOINT_VERSIONS
# version files) and the spilled traces (deleted beyond the server's spill cap). Nothing else is written there.
PRUNE_SLACK_VERSIONS = 8
CHECKPOINT_VERSIONS = 3


@dataclass
class Result:
    kind: str  # load | prefill_fault | step_fault
    outcome: str  # ok | client_disconnected | 4xx | 5xx | hung | transport_error
    status: int | None = None
    code: str | None = None
    response_id: str | None = None
    latency_s: float = 0.0
    error: str | None = None


def read_fault_log(path: Path) -> dict[str, list[str]]:
    """fault -> the response ids (engine request id without its `-<choice>` suffix) it failed."""
    faults: dict[str, list[str]] = {"prefill": [], "step": []}
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            faults[entry["fault"]] += [rid.rsplit("-", 1)[0] for rid in entry["request_ids"]]
    return faults


def classify(results: list[Result], faults: dict[str, list[str]]) -> dict:
    """Counts by outcome; each 5xx attributed to an injected fault or counted unexplained.

    The prefill fault's request is the one that carried its marker. A request failed by the step fault is known
    by its response id (from its stream's first chunk). A completions stream whose tokens so far decoded to no
    text has sent no chunk, so no id: such id-less `engine_step_failed` errors are matched by count to the step's
    logged requests that no client reported by id (never more of them than that)."""
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    step_ids = set(faults["step"])
    seen = {r.response_id for r in results if r.response_id in step_ids and r.outcome in ("5xx", "client_disconnected")}
    unseen = len(step_ids - seen)
    server_errors = {"injected_prefill": 0, "injected_step": 0, "injected_step_matched_by_count": 0, "unexplained": 0}
    unexplained = []
    for r in (r for r in results if r.outcome == "5xx"):
        if r.kind == "prefill_fault" and r.code == "engine_step_failed":
            server_errors["injected_prefill"] += 1
        elif r.code == "engine_step_failed" and r.response_id in step_ids:
            server_errors["injected_step"] += 1
        elif r.code == "engine_step_failed" and r.response_id is None and unseen > 0:
            unseen -= 1
            server_errors["injected_step"] += 1
            server_errors["injected_step_matched_by_count"] += 1
        else:
            server_errors["unexplained"] += 1
            unexplained.append(asdict(r))
    client_errors: dict[str, int] = {}
    for r in (r for r in results if r.outcome == "4xx"):
        client_errors[f"{r.status} {r.code}"] = client_errors.get(f"{r.status} {r.code}", 0) + 1
    return {"total": len(results), "by_outcome": outcomes, "5xx": server_errors, "4xx_by_code": client_errors,
            "unexplained_5xx": unexplained[:20], "step_fault_requests_unaccounted": unseen,
            "transport_errors": [asdict(r) for r in results if r.outcome == "transport_error"][:20]}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(round(q * (len(values) - 1))))], 3)


def growth(samples: list[dict], key: str, warmup_s: float) -> dict:
    after = [s for s in samples if s["t_s"] >= warmup_s and s[key] is not None]
    if not after:
        return {"warmup_end": None, "end": None, "max_after_warmup": None, "change": None}
    first, last = after[0][key], after[-1][key]
    return {"warmup_end": first, "end": last, "max_after_warmup": max(s[key] for s in after), "change": round(last - first, 2)}


def rss_allowance_mb(warmup_end_mb: float) -> float:
    return max(RSS_GROWTH_FLOOR_MB, RSS_GROWTH_FRACTION * warmup_end_mb)


def state_dir_allowance_mb(version_file_mb: float, online: bool, spill_cap_mb: float) -> float:
    """The most the state directory may hold (see the constants): the versions kept, and online the checkpoint and traces."""
    versions = KEEP_VERSIONS + 1 + (PRUNE_SLACK_VERSIONS if online else 0)
    return version_file_mb * (versions + (CHECKPOINT_VERSIONS if online else 0)) + (spill_cap_mb if online else 0.0)


def growth_checks(rss: dict, state_dir: dict, state_allowance_mb: float) -> dict:
    """RSS growth after the warm-up within `rss_allowance_mb`, and the state directory never above what it may hold;
    a run with no sample after the warm-up fails (nothing was checked)."""
    rss_ok = rss["warmup_end"] is not None and rss["max_after_warmup"] - rss["warmup_end"] <= rss_allowance_mb(rss["warmup_end"])
    state_ok = state_dir["max_after_warmup"] is not None and state_dir["max_after_warmup"] <= state_allowance_mb
    return {"rss_growth_within_bound": bool(rss_ok), "state_dir_within_bound": bool(state_ok)}


def verdict(requests: dict, faults: dict, publishes: dict, growth: dict) -> dict:
    """Every check of the run (`growth`: `growth_checks`); passed when all hold."""
    hung = requests["by_outcome"].get("hung", 0)
    checks = growth | {"no_hung_requests": hung == 0, "no_unexplained_5xx": requests["5xx"]["unexplained"] == 0,
              "no_transport_errors": requests["by_outcome"].get("transport_error", 0) == 0,
              "every_publish_accepted": publishes["failed"] == 0,
              "prefill_fault_hit_one_request": requests["5xx"]["injected_prefill"] == 1 and len(faults["prefill"]) == 1,
              "step_fault_fired_and_accounted": len(faults["step"]) >= 1 and requests["step_fault_requests_unaccounted"] == 0}
    return checks | {"passed": all(checks.values())}


def markdown_table(report: dict) -> str:
    r, v = report["requests"], report["verdict"]
    lines = ["| soak | value |", "|---|---|",
             f"| requests | {r['total']}: " + ", ".join(f"{k} {n}" for k, n in sorted(r["by_outcome"].items())) + " |",
             f"| 5xx | injected prefill {r['5xx']['injected_prefill']}, injected step {r['5xx']['injected_step']} "
             f"(the step's requests: {len(report['faults']['step'])}), unexplained {r['5xx']['unexplained']} |",
             f"| 4xx | {r['4xx_by_code'] or 0} |", f"| hung | {report['hung']} |",
             f"| latency p50 / p99 s | {report['latency_p50_s']} / {report['latency_p99_s']} |",
             f"| drafter publishes (ok / failed), swaps | {report['publishes']['ok']} / {report['publishes']['failed']}, "
             f"{report['server']['drafter_swaps']} |"]
    for key, label in (("rss_mb", "server RSS MB"), ("state_dir_mb", "state dir MB")):
        g = report[key]
        bound = f"growth allowed {g.get('allowed_growth')}" if key == "rss_mb" else f"allowed {g.get('allowed')}"
        lines.append(f"| {label}: warm-up end -> end (max after warm-up; {bound}) | {g['warmup_end']} -> {g['end']} ({g['max_after_warmup']}) |")
    lines.append(f"| verdict | {'passed' if v['passed'] else 'FAILED: ' + ', '.join(k for k, ok in v.items() if not ok and k != 'passed')} |")
    return "\n".join(lines)
