"""`tandem bench decode`: speculative decoding per drafter and per domain, against plain decoding (and peers).

All drafters run over the same loaded target, interleaved prompt by prompt so that machine noise hits
them alike; speedups are ratios measured in this one run. Greedy output of every drafter is compared
token by token with plain decoding (`greedy_matches_ar`).

A runner named `NAME@W` for W in bf16 / int8 / int4 (`ar@int8`, `eagle_ngram@int4`) runs on another copy of the
target with those weights (`LLM(weights=W)`): its speedup is still against fp32 `ar`, and its greedy output is compared
with `ar@W`, plain decoding of the same target (speculation is lossless w.r.t. the served target). `weights=W` (`--weights`)
serves the base target itself with W weights: `ar` and every unsuffixed runner are then the W model (one copy in
memory instead of two, for targets too big for both).

Peers (`--peers hf,ortg,llama`) decode the same prompt ids in the same loop. Each summary's `greedy_match_share` is the
share of prompts whose output equals its reference's: plain decoding of the same weights (`ar` / `ar@W`; for llama.cpp
the runner at its GGUF's bits, e.g. `ar@int8` for Q8_0, where there is one). Across engines it need not be 1.0.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

from tqdm import tqdm

from tandem.bench.machine import machine_info
from tandem.data.prompts import Prompt, load_prompts, render_chat
from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError


@dataclass(frozen=True)
class DecodeBenchConfig:
    model: str = "smollm2-135m"
    drafters: tuple[str, ...] = ("ar", "ngram", "self_draft")  # "ar" = plain decoding
    prompts: str = "builtin"  # or a JSONL file of {"domain", "prompt"}
    per_domain: int = 4  # prompts per domain (None-like 0 = all)
    max_tokens: int = 96
    batch_size: int = 1
    num_draft_tokens: int = 4
    adaptive_k: bool = False
    drafter_model: str | None = None  # draft_model / HF assisted generation
    drafter_path: str | None = None  # eagle / mtp heads: one DIR, or "eagle=DIR,mtp=DIR"
    peers: tuple[str, ...] = ()  # "hf", "ortg" (onnxruntime-genai), "llama" (llama.cpp); the last two in child processes
    weights: str = "fp32"  # the base target's served weights: "ar" is plain decoding of this model
    ortg_python: str | None = None  # the interpreter that has onnxruntime-genai (default: the peer harness's venv)
    ortg_model: str | None = None  # its fp32 model directory (default: the peer harness's SmolLM2 export)
    llama_gguf: str = "q8_0"  # a GGUF file, or "shipped" / "q8_0": built from the zoo model (tandem.bench.peers.llama_peer)
    llama_draft_gguf: str | None = None  # llama_draft's GGUF (a file, or shipped / q8_0 of --drafter-model); None: no llama_draft
    llama_python: str | None = None  # the interpreter that has llama_cpp (default: the peer harness's venv)
    llama_pld_tokens: int = 10  # llama_pld's num_pred_tokens (llama-cpp-python's default)
    pack_weights: bool = True  # False saves a copy of the weights (big targets next to HF peers in one process)
    compile: bool = False  # every engine on the compiled decode / verify forward (tandem.models.compiled)
    tree: tuple[int, int, int] | None = None  # dynamic trees (eagle_tree*): (max_nodes, topk, depth); None: the drafter's default
    min_confidence: float | None = None  # eagle chains: path-confidence cut-off (None: the drafter's default)
    rounds: int = 1  # passes over the prompts, each interleaved; the summaries give every round's rate and their spread
    llama_modes: tuple[str, ...] = ()  # C++ tools and / or the binding (tandem.bench.peers.llama_peer); () = cli, lookup (+ spec with a draft GGUF)
    llama_spec: tuple[tuple[int, int, float], ...] = ((8, 0, 0.75),)  # llama_spec runners: (draft max, draft min, p min)
    llama_lookup: tuple[int, ...] = (8,)  # llama_lookup runners: draft max (its n-gram cache drafts up to this many)

    def __post_init__(self) -> None:
        if "ar" not in self.drafters:
            raise InvalidParameterError("--drafters must include 'ar' (the baseline every speedup is measured against)")
        if self.batch_size < 1 or self.max_tokens < 1 or self.rounds < 1:
            raise InvalidParameterError("batch_size, max_tokens and rounds must be >= 1")
        for name in self.drafters:
            if "@" in name and name.split("@", 1)[1] not in WEIGHT_SUFFIXES:
                raise InvalidParameterError(f"runner {name!r}: the part after '@' must be one of {WEIGHT_SUFFIXES}")
        unknown = set(self.peers) - set(PEERS)
        if unknown:
            raise InvalidParameterError(f"--peers: unknown {sorted(unknown)}; choose from {PEERS}")
        for weights in {n.split("@", 1)[1] for n in self.drafters if "@" in n}:
            if f"ar@{weights}" not in self.drafters:
                raise InvalidParameterError(f"{weights} runners need 'ar@{weights}' too (their greedy reference: plain decoding of the {weights} target)")
        if self.tree is not None and (len(self.tree) != 3 or min(self.tree) < 1):
            raise InvalidParameterError(f"--tree takes NODES,TOPK,DEPTH, each >= 1; got {self.tree}")
        if self.weights not in ("fp32",) + WEIGHT_SUFFIXES:
            raise InvalidParameterError(f"--weights must be one of {('fp32',) + WEIGHT_SUFFIXES}, got {self.weights!r}")
        if self.weights != "fp32" and not self.pack_weights:
            raise InvalidParameterError(f"--weights {self.weights} needs packed weights (drop --no-pack)")
        if self.llama_pld_tokens < 1:
            raise InvalidParameterError(f"--llama-pld-tokens must be >= 1, got {self.llama_pld_tokens}")
        if "llama" in self.peers:  # a missing GGUF file or a spec without a zoo model fails here, before any model loads
            from tandem.bench.peers.llama_peer import check_modes, gguf_path

            gguf_path(self.llama_gguf, self.model, "--llama-gguf")
            if self.llama_draft_gguf:
                gguf_path(self.llama_draft_gguf, self.drafter_model, "--llama-draft-gguf (of --drafter-model)")
            check_modes(self)


PEERS = ("hf", "ortg", "llama")
WEIGHT_SUFFIXES = ("bf16", "int8", "int4")  # NAME@W: the runner serves the target with W weights (tandem.config.WEIGHTS)


EMPTY_METRICS = {"steps": 0, "drafted_tokens": 0, "accepted_tokens": 0, "draft_time_s": 0.0, "mean_draft_length": 0.0}


@dataclass
class Tally:
    """Sums over requests; the summary turns them into rates and ratios."""

    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0  # verify steps (each request's first token comes from prefill, not a step)
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    draft_len_sum: float = 0.0
    decode_tokens: int = 0  # engines that time their decoding apart from prefill (llama.cpp's tools) say so in metrics
    decode_s: float = 0.0
    matches: bool = True
    compared: int = 0  # requests with a reference output
    matched: int = 0  # of those, equal to it

    def add(self, out, seconds: float, reference: list[int] | None) -> None:
        m = EMPTY_METRICS | (out.metrics or {})
        self.requests += 1
        self.tokens += generated(out)
        self.seconds += seconds
        self.steps += m["steps"]
        self.drafted += m["drafted_tokens"]
        self.accepted += m["accepted_tokens"]
        self.draft_s += m["draft_time_s"]
        self.draft_len_sum += m["mean_draft_length"] * m["steps"]
        self.decode_tokens += m.get("decode_tokens", 0)
        self.decode_s += m.get("decode_s", 0.0)
        if reference is not None:
            self.compared += 1
            self.matched += out.token_ids == reference
            self.matches &= out.token_ids == reference

    def merge(self, other: "Tally") -> None:
        for name in ("requests", "tokens", "seconds", "steps", "drafted", "accepted", "draft_s", "draft_len_sum", "compared", "matched",
                     "decode_tokens", "decode_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.matches &= other.matches

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self, ar: "Tally | None") -> dict:
        steps = max(self.steps, 1)
        out = {
            "requests": self.requests, "tokens": self.tokens, "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.rate, 3),
            "acceptance_length": round((self.tokens - self.requests) / steps, 3) if self.steps else None,
            "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else 0.0,
            "mean_draft_length": round(self.draft_len_sum / steps, 3),
            "draft_ms_per_drafted_token": round(1000 * self.draft_s / self.drafted, 3) if self.drafted else 0.0,
            "greedy_matches_ar": self.matches,
            "greedy_match_share": round(self.matched / self.compared, 3) if self.compared else None,
        }
        if self.decode_s:
            out["decode_tokens_per_s"] = round(self.decode_tokens / self.decode_s, 3)  # prefill left out
        if ar is not None and ar.rate:
            out["speedup_vs_ar"] = round(self.rate / ar.rate, 3)
        return out


def generated(out) -> int:
    """Tokens a runner generated: its own count where it gives one (a tool that prints text), else its ids."""
    return len(out.token_ids) if getattr(out, "count", None) is None else out.count


def batch_seconds(outputs, wall: float) -> float:
    """The batch's time: the wall clock, or the sum of the engine's own timings where every output carries one (a tool
    started per request, whose process start and model load are not decoding)."""
    own = [getattr(o, "seconds", None) for o in outputs]
    return wall if None in own else sum(own)


def run_decode_bench(config: DecodeBenchConfig) -> dict:
    """Every runner (tandem drafters, then the peers) decodes each prompt batch in turn, interleaved."""
    from tandem.llm import LLM

    if "llama" in config.peers:  # no peer venv or no built tools: say so before the target loads
        from tandem.bench.peers.llama_peer import check_peer_set_up

        check_peer_set_up(config)
    base = LLM(model=config.model, max_batch_size=config.batch_size, pack_weights=config.pack_weights, compile=config.compile,
               weights=config.weights)
    prompts = _prompts(config)
    token_ids = render_chat(prompts, base.tokenizer)
    params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0)
    targets = {"": base} | {w: _weights_target(config, w) for w in WEIGHT_SUFFIXES if f"ar@{w}" in config.drafters}
    order = sorted(config.drafters, key=lambda n: n.split("@")[0] != "ar")  # references first
    runners = {name: _tandem_runner(_llm_for(targets[_weights_of(name)], name.split("@")[0], config), params) for name in order}
    if "hf" in config.peers:
        from tandem.bench.peers.peers import hf_runners

        runners |= hf_runners(base, config)
    if "ortg" in config.peers:
        from tandem.bench.peers.peers import ortg_runners

        runners |= ortg_runners(base, config)
    reference_of, peer_info = {}, {}
    if "llama" in config.peers:
        from tandem.bench.peers.llama_peer import llama_runners

        llama, peer_info["llama"] = llama_runners(base, config, token_ids)
        peer_info["llama"]["runners"] = list(llama)
        runners |= llama
        peer_info["llama"]["reference"] = _reference_at(peer_info["llama"]["weights"], config)
        reference_of |= dict.fromkeys(llama, peer_info["llama"]["reference"])
    for run in runners.values():
        run([token_ids[0][:16]])  # warm-up
    rounds = [_run_round(runners, prompts, token_ids, config.batch_size, reference_of, r) for r in range(config.rounds)]
    result = {"config": asdict(config), "machine": machine_info(), "num_prompts": len(prompts), "drafters": _summaries(rounds),
              "load_average": {"rounds": [r["load_average"] for r in rounds], "end": list(os.getloadavg())},
              "bits_per_weight": _bits_per_runner(targets, order, peer_info.get("llama"))}
    return result | ({"peers": peer_info} if peer_info else {})


def _run_round(runners: dict, prompts: list[Prompt], token_ids: list[list[int]], batch_size: int, reference_of: dict, r: int) -> dict:
    """One pass over the prompts, every runner on each batch in turn: {"load_average": at its start, "tallies": per runner
    and domain}."""
    load = list(os.getloadavg())
    tallies: dict[str, dict[str, Tally]] = {name: {} for name in runners}
    for start in tqdm(range(0, len(prompts), batch_size), desc=f"bench decode, round {r + 1}", unit="batch"):
        batch = list(range(start, min(start + batch_size, len(prompts))))
        references: dict[str, list] = {}
        for name, run in runners.items():  # "ar" and "ar@W" first: the references for greedy identity
            t = time.perf_counter()
            outputs = run([token_ids[i] for i in batch])
            seconds = batch_seconds(outputs, time.perf_counter() - t)
            plain = reference_of.get(name) or (f"ar@{_weights_of(name)}" if "@" in name else "ar")
            if name == plain:
                references[plain] = [o.token_ids for o in outputs]
            _tally(tallies[name], [prompts[i].domain for i in batch], outputs, seconds, None if name == plain else references[plain])
    return {"load_average": load, "tallies": tallies}


def _bits_per_runner(targets: dict, tandem_runners: list[str], llama: dict | None) -> dict:
    """Bits per weight of the target each runner decodes (blocks, LM head, embeddings; llama.cpp's draft model too)."""
    from tandem.bench.peers.bits import model_bits

    bits = {name: {"target": model_bits(targets[_weights_of(name)].target)} for name in tandem_runners}
    if llama:
        for name in llama.get("runners", []):
            draft = llama.get("draft") if ("spec" in name or name == "llama_draft") else None
            bits[name] = {"target": llama["bits_per_weight"]} | ({"draft": draft["bits_per_weight"]} if draft else {})
    return bits


def _reference_at(weights: str | None, config: DecodeBenchConfig) -> str:
    """The tandem runner a peer at `weights` is compared with: plain decoding at those weights where one runs, else `ar`."""
    if weights and weights != config.weights and f"ar@{weights}" in config.drafters:
        return f"ar@{weights}"
    return "ar"


def _weights_of(name: str) -> str:  # "ngram@int4" -> "int4"; a peer or plain name -> ""
    return name.split("@", 1)[1] if "@" in name else ""


def _weights_target(config: DecodeBenchConfig, weights: str):
    from tandem.llm import LLM

    return LLM(model=config.model, max_batch_size=config.batch_size, compile=config.compile, weights=weights)


def _tandem_runner(llm, params: SamplingParams):
    return lambda batch: llm.generate(batch, params)


def _prompts(config: DecodeBenchConfig) -> list[Prompt]:
    split = "test" if config.prompts == "builtin" else "all"
    return load_prompts(config.prompts, per_domain=config.per_domain or None, split=split)


def _llm_for(base, name: str, config: DecodeBenchConfig):
    if name == "ar":
        return base
    options = dict(zip(("max_nodes", "tree_topk", "tree_depth"), config.tree)) if config.tree and name.startswith("eagle_tree") else {}
    if config.min_confidence is not None:  # drafters without a confidence cut ignore it
        options["min_confidence"] = config.min_confidence
    return base.with_drafter(name, config.num_draft_tokens, config.drafter_model, drafter_path_for(name, config.drafter_path), config.adaptive_k, **options)


def drafter_path_for(name: str, spec: str | None) -> str | None:
    """`--drafter-path DIR` for every drafter, or `eagle=DIR,mtp=DIR` (eagle_tree and the eagle_*ngram hybrids fall back to eagle's)."""
    if not spec or "=" not in spec:
        return spec
    paths = dict(item.split("=", 1) for item in spec.split(",") if item)
    return paths.get(name) or (paths.get("eagle") if name.startswith("eagle") else None)


def _tally(per_domain: dict, domains: list[str], outputs, seconds: float, reference) -> None:
    """Split a batch's wall time over its requests by token share, then add each to its domain."""
    total = sum(generated(o) for o in outputs) or 1
    for i, (domain, out) in enumerate(zip(domains, outputs)):
        share = seconds * generated(out) / total
        per_domain.setdefault(domain, Tally()).add(out, share, None if reference is None else reference[i])


def _overall(per_domain: dict[str, Tally]) -> Tally:
    total = Tally()
    for tally in per_domain.values():
        total.merge(tally)
    return total


def _summaries(rounds: list[dict]) -> dict:
    """Per runner: the summary over all rounds (overall and per domain) and each round's rate and speedup, with their
    spread (min, max) when there is more than one round."""
    tallies = {name: {} for name in rounds[0]["tallies"]}
    for r in rounds:
        for name, per_domain in r["tallies"].items():
            for domain, tally in per_domain.items():
                tallies[name].setdefault(domain, Tally()).merge(tally)
    ar_domains = tallies["ar"]
    ar_overall = _overall(ar_domains)
    out = {}
    for name, per_domain in tallies.items():
        per_round = [_overall(r["tallies"][name]).summary(_overall(r["tallies"]["ar"])) for r in rounds]
        out[name] = {"overall": _overall(per_domain).summary(ar_overall),
                     "per_domain": {d: t.summary(ar_domains.get(d)) for d, t in sorted(per_domain.items())}}
        if len(rounds) > 1:
            out[name]["rounds"] = [{k: s.get(k) for k in ("tokens_per_s", "speedup_vs_ar")} for s in per_round]
            out[name]["spread"] = {k: [min(s[k] for s in per_round), max(s[k] for s in per_round)] for k in ("tokens_per_s", "speedup_vs_ar")}
    return out
