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
"""
from __future__ import annotations

import gc
import statistics
from dataclasses import asdict, dataclass

import torch

from tandem.bench.machine import machine_info
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

    def __post_init__(self) -> None:
        if not self.weights or self.weights[0] != "fp32":
            raise InvalidParameterError("--weights must start with fp32 (the reference every precision is compared with)")
        unknown = [w for w in self.weights if w not in WEIGHTS]
        if unknown:
            raise InvalidParameterError(f"--weights: unknown {unknown}; choose from {sorted(WEIGHTS)}")
        if self.per_domain < 1 or self.max_tokens < 1:
            raise InvalidParameterError("per_domain and max_tokens must be >= 1")


@dataclass
class Sample:
    domain: str
    prompt: list[int]  # chat-rendered prompt ids
    continuation: list[int]  # fp32 greedy continuation ids


def teacher_forced(target, sample: Sample) -> dict[str, float]:
    """One forward over prompt + continuation: mean log-probs and top-1 agreement with the fp32 continuation."""
    ids = torch.tensor([sample.prompt + sample.continuation])
    with torch.inference_mode():
        logits = target(ids).logits[0].float()  # [T, V]
    logprobs = torch.log_softmax(logits[:-1], dim=-1)  # position t predicts token t + 1
    next_ids = ids[0, 1:]
    token_lp = logprobs.gather(1, next_ids[:, None])[:, 0]  # [T - 1]
    p = len(sample.prompt)
    prompt_lp = token_lp[: p - 1]
    cont = slice(p - 1, p - 1 + len(sample.continuation))
    agree = (logprobs[cont].argmax(-1) == next_ids[cont]).float()
    return {"prompt_logprob": prompt_lp.mean().item(), "continuation_logprob": token_lp[cont].mean().item(),
            "top1_agreement": agree.mean().item()}


def prefix_agreement(ours: list[int], reference: list[int]) -> float:
    """Tokens before the first difference, over the reference's length (1.0: identical)."""
    same = 0
    for a, b in zip(ours, reference):
        if a != b:
            break
        same += 1
    return same / max(len(reference), 1)


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
    """fp32 first (it writes the continuations), then each precision on the same samples; one model loaded at a time."""
    from tandem.llm import LLM

    results, samples, references = {}, None, None
    for weights in config.weights:
        llm = LLM(model=config.model, weights=weights, max_batch_size=4)
        if samples is None:
            samples = _samples(llm, config)
            references = [s.continuation for s in samples]
        results[weights] = _summarise(_measure(llm, samples, references), samples)
        del llm
        gc.collect()
    for weights, by_domain in results.items():
        for name, row in by_domain.items():
            base = results["fp32"][name]
            row["prompt_logprob_delta"] = round(row["prompt_logprob"] - base["prompt_logprob"], 4)
            row["continuation_logprob_delta"] = round(row["continuation_logprob"] - base["continuation_logprob"], 4)
    return {"config": asdict(config), "machine": machine_info(), "num_samples": len(samples),
            "continuation_tokens": sum(len(s.continuation) for s in samples), "weights": results}


def add_bench_quality_command(bench) -> None:
    d = QualityBenchConfig()
    p = bench.add_parser("quality", help="quality of each served precision against fp32, per domain (log-prob, agreement)")
    p.add_argument("--model", default=d.model)
    p.add_argument("--weights", default=",".join(d.weights), help="comma list, fp32 first (the reference)")
    p.add_argument("--per-domain", type=int, default=d.per_domain)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--domains", default=",".join(d.domains))
    p.add_argument("--prompts", default=d.prompts, help="builtin (its test split) or a JSONL file of {domain, prompt}")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run)


def _run(args) -> int:
    import json
    from pathlib import Path

    torch.set_num_threads(args.threads)
    config = QualityBenchConfig(args.model, tuple(w for w in args.weights.split(",") if w), args.per_domain, args.max_tokens,
                                tuple(d for d in args.domains.split(",") if d), args.prompts)
    text = json.dumps(run_quality_bench(config), indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0
