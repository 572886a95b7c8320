"""`tandem bench quality`: what each served precision (fp32 / bf16 / int8 / int4) costs in model quality, per domain.

Held-out text per domain: the built-in prompts' test split (`tandem.data.prompts`), each rendered as a chat turn and
followed by the fp32 model's own greedy continuation (`--max-tokens`). Each precision then reads every sequence
teacher-forced (one forward) and decodes the prompt greedily itself. Reported per domain and overall:

- `prompt_logprob`: mean log-prob of the chat-rendered prompt's tokens after the first (human-written text, with the
  chat template's tokens, which every precision predicts alike);
- `continuation_logprob`: mean log-prob of the fp32 greedy continuation's tokens (fp32's own choices: fp32 is
  favoured here by construction, the drop is what a precision loses on text fp32 is sure of);
- `top1_agreement`: the fraction of continuation positions where the precision's argmax (teacher-forced) is the
  fp32 greedy token (fp32 itself scores just under 1 where its prefill and decode paths round near-ties apart);
- `greedy_prefix_agreement`: the precision's own greedy output against fp32's, token by token: the mean over prompts
  of (tokens before the first difference) / (fp32's tokens), 1.0 = identical outputs.
Log-probs are nats per token; deltas are against fp32 in the same run.

Peers (`--peers llama --llama-gguf q8_0,shipped`, tandem/bench/peers/quality_llama.py): each llama.cpp GGUF is a column
beside tandem's precisions (`llama:Q8_0`, `llama:Q4_K_M`, named after the GGUF's file type), measured on the same ids
(its tokenizer checked against tandem's) with the same four metrics and deltas against tandem's fp32. Read them knowing
where tandem's fp32 weights come from: the zoo ships each model as a GGUF (Q4_K_M for the Qwen2.5-Coder models, Q4_1
for SmolLM2) and tandem dequantizes it to fp32. So `shipped` (llama:Q4_K_M for Qwen) IS the model tandem's fp32 is:
its delta is ~0 by construction (only llama.cpp's arithmetic differs), not what 4-bit weights cost; `q8_0` is
llama.cpp's 8-bit quantization of those same weights, the counterpart of tandem's int8. The result says so (`notes`).
"""
from __future__ import annotations

import gc
import statistics
from dataclasses import asdict, dataclass

import torch

from tandem.bench.machine import machine_info
from tandem.bench.speculation.quality_metrics import Sample, forced_metrics, prefix_agreement
from tandem.config import WEIGHTS, SamplingParams
from tandem.data.prompts import DOMAINS, load_prompts, render_chat
from tandem.errors import InvalidParameterError


@dataclass(frozen=True)
class QualityBenchConfig:
    model: str = "smollm2-135m"
    weights: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")  # fp32 first: the reference
    per_domain: int = 4  # test-split prompts per domain
    max_tokens: int = 48  # fp32 greedy continuation length (the held-out continuation)
    domains: tuple[str, ...] = DOMAINS
    prompts: str = "builtin"  # or a JSONL file of {"domain", "prompt"} (all its prompts count as held out)
    peers: tuple[str, ...] = ()  # "llama": llama.cpp's GGUFs as columns (tandem.bench.peers.quality_llama)
    llama_gguf: tuple[str, ...] = ("q8_0", "shipped")  # GGUF files, or shipped / q8_0 of the zoo model (bench.llama_peer)
    llama_python: str | None = None  # the interpreter that has llama_cpp (default: the peer harness's venv)

    def __post_init__(self) -> None:
        if not self.weights or self.weights[0] != "fp32":
            raise InvalidParameterError("--weights must start with fp32 (the reference every precision is compared with)")
        unknown = [w for w in self.weights if w not in WEIGHTS]
        if unknown:
            raise InvalidParameterError(f"--weights: unknown {unknown}; choose from {sorted(WEIGHTS)}")
        if self.per_domain < 1 or self.max_tokens < 1:
            raise InvalidParameterError("per_domain and max_tokens must be >= 1")
        if set(self.peers) - {"llama"}:
            raise InvalidParameterError(f"--peers: unknown {sorted(set(self.peers) - {'llama'})}; choose from ['llama']")
        if "llama" in self.peers:  # a missing GGUF file, or a spec without a zoo model, fails before any model loads
            from tandem.bench.peers.llama_peer import gguf_path

            if not self.llama_gguf:
                raise InvalidParameterError("--peers llama needs at least one --llama-gguf")
            for spec in self.llama_gguf:
                gguf_path(spec, self.model, "--llama-gguf")


def teacher_forced(target, sample: Sample) -> dict[str, float]:
    """One forward over prompt + continuation: mean log-probs and top-1 agreement with the fp32 continuation."""
    ids = torch.tensor([sample.prompt + sample.continuation])
    with torch.inference_mode():
        logits = target(ids).logits[0].float()  # [T, V]
    logprobs = torch.log_softmax(logits[:-1], dim=-1)  # position t predicts token t + 1
    token_lp = logprobs.gather(1, ids[0, 1:, None])[:, 0]  # [T - 1]
    return forced_metrics(token_lp.tolist(), logprobs.argmax(-1).tolist(), sample)


def _samples(llm, config: QualityBenchConfig) -> list[Sample]:
    split = "test" if config.prompts == "builtin" else "all"
    prompts = load_prompts(config.prompts, domains=config.domains, per_domain=config.per_domain, split=split)
    ids = render_chat(prompts, llm.tokenizer)
    params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0)
    outputs = llm.generate(ids, params)
    return [Sample(prompt.domain, prompt_ids, list(output.token_ids)) for prompt, prompt_ids, output in zip(prompts, ids, outputs)]


def _measure(llm, samples: list[Sample], references: list[list[int]]) -> list[dict[str, float]]:
    params = SamplingParams(max_tokens=max(len(s.continuation) for s in samples), temperature=0.0)
    greedy = llm.generate([s.prompt for s in samples], params)
    rows = []
    for sample, output, reference in zip(samples, greedy, references):
        row = teacher_forced(llm.target, sample)
        row["greedy_prefix_agreement"] = prefix_agreement(list(output.token_ids)[: len(reference)], reference)
        rows.append(row)
    return rows


def _summarise(rows: list[dict[str, float]], samples: list[Sample]) -> dict[str, dict[str, float]]:
    groups = {"overall": list(range(len(rows)))}
    for i, s in enumerate(samples):
        groups.setdefault(s.domain, []).append(i)
    return {name: {k: round(statistics.fmean(rows[i][k] for i in idx), 4) for k in rows[0]} for name, idx in groups.items()}


def run_quality_bench(config: QualityBenchConfig) -> dict:
    """fp32 first (it writes the continuations), then each precision on the same samples, then each llama.cpp GGUF;
    one model loaded at a time."""
    from tandem.llm import LLM

    if "llama" in config.peers:  # no peer venv or GGUF: say so before any model loads
        from tandem.bench.peers import quality_llama

        python, ggufs = quality_llama.prepare_ggufs(config, torch.get_num_threads())
    results, samples, references = {}, None, None
    for weights in config.weights:
        llm = LLM(model=config.model, weights=weights, max_batch_size=4)
        if samples is None:
            samples = _samples(llm, config)
            references = [s.continuation for s in samples]
            tokenizer, eos = llm.tokenizer, sorted(llm.target.cfg.eos_token_ids)
        results[weights] = _summarise(_measure(llm, samples, references), samples)
        del llm
        gc.collect()
    peers, notes = {}, []
    if "llama" in config.peers:
        columns = quality_llama.llama_columns(python, ggufs, samples, tokenizer, eos, torch.get_num_threads())
        for name, (rows, info) in columns.items():
            results[name], peers[name] = _summarise(rows, samples), info
        notes = quality_llama.llama_notes(config.model, peers)
    _add_deltas(results)
    return {"config": asdict(config), "machine": machine_info(), "num_samples": len(samples),
            "continuation_tokens": sum(len(s.continuation) for s in samples), "weights": results} | (
        {"peers": peers, "notes": notes} if peers else {})


def _add_deltas(results: dict) -> None:
    for by_domain in results.values():
        for name, row in by_domain.items():
            base = results["fp32"][name]
            row["prompt_logprob_delta"] = round(row["prompt_logprob"] - base["prompt_logprob"], 4)
            row["continuation_logprob_delta"] = round(row["continuation_logprob"] - base["continuation_logprob"], 4)


def quality_table(result: dict) -> str:
    """Per domain and overall, each column but fp32: continuation log-prob delta / top-1 agreement / greedy prefix
    agreement; then fp32's own log-probs and the notes."""
    columns = [name for name in result["weights"] if name != "fp32"]
    fp32 = result["weights"]["fp32"]
    lines = ["| domain | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for domain in [d for d in fp32 if d != "overall"] + ["overall"]:
        cells = [result["weights"][c][domain] for c in columns]
        lines.append(f"| {domain} | " + " | ".join(f"{r['continuation_logprob_delta']:+.3f} / {r['top1_agreement']:.3f} / "
                                                    f"{r['greedy_prefix_agreement']:.2f}" for r in cells) + " |")
    lines.append(f"fp32: {fp32['overall']['continuation_logprob']:.3f} nats / token on its continuation, "
                 f"{fp32['overall']['prompt_logprob']:.2f} on the prompts ({result['num_samples']} prompts, "
                 f"{result['continuation_tokens']} continuation tokens)")
    return "\n".join(lines + [f"note: {n}" for n in result.get("notes", [])])


def add_bench_quality_command(bench) -> None:
    d = QualityBenchConfig()
    p = bench.add_parser("quality", help="quality of each served precision against fp32, per domain (log-prob, agreement)")
    p.add_argument("--model", default=d.model)
    p.add_argument("--weights", default=",".join(d.weights), help="comma list, fp32 first (the reference)")
    p.add_argument("--per-domain", type=int, default=d.per_domain)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--domains", default=",".join(d.domains))
    p.add_argument("--prompts", default=d.prompts, help="builtin (its test split) or a JSONL file of {domain, prompt}")
    p.add_argument("--peers", default="", help="llama: llama.cpp's GGUFs (--llama-gguf) as columns, in a child process")
    p.add_argument("--llama-gguf", default=",".join(d.llama_gguf), help="comma list of GGUFs: files, or shipped (the zoo's "
                   "GGUF, e.g. Q4_K_M: the weights tandem's fp32 is dequantized from) / q8_0 (made from it), built on first "
                   "use under $TANDEM_BENCH_CACHE/models/gguf_zoo")
    p.add_argument("--llama-python", default=None, help="Python that has llama_cpp (default: the peer harness's venv under $TANDEM_BENCH_CACHE)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run)


def _run(args) -> int:
    import json
    import sys
    from pathlib import Path

    def items(text: str) -> tuple[str, ...]:
        return tuple(x for x in text.split(",") if x)

    torch.set_num_threads(args.threads)
    config = QualityBenchConfig(args.model, items(args.weights), args.per_domain, args.max_tokens, items(args.domains), args.prompts,
                                items(args.peers), items(args.llama_gguf), args.llama_python)
    result = run_quality_bench(config)
    text = json.dumps(result, indent=2)
    print(text)
    print(quality_table(result), file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0
