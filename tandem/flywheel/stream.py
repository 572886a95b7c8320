"""The domain-shifting request stream the flywheel is measured on: prompts in blocks per domain.

A stream is `requests` prompts in blocks of `block` per domain, cycling through `domains` (tandem.data.prompts
.domain_stream). `build_stream` renders them with the chat template and keys them (`prompt_key`), so a
replay cache, a benchmark, the demo and the live engine all refer to one request the same way.

`SPECIALISED` is Aurora's traffic: five specialised domains, none of which the general head
(recipe eagle-smollm2-general) trains on. `top_up` adds more prompts where a domain's built-in pool is
shorter than the stream needs (more seeded math variants, the extra SQL prompts), so a long stream repeats
as few prompts as the data allows: a repeated prompt replays a continuation the flywheel has already
trained on, which would flatter it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from tandem.data.prompts import DOMAINS, Prompt, domain_stream, load_prompts, prompt_split, render_chat
from tandem.errors import InvalidParameterError

SPECIALISED = ("code", "sql", "math", "summary", "translation")


@dataclass(frozen=True)
class StreamSpec:
    prompts: str = "builtin"  # "builtin" or a JSONL file of {domain, prompt}
    requests: int = 2000
    block: int = 200
    domains: tuple[str, ...] = DOMAINS
    max_prompt_tokens: int = 448  # longer prompts are left out of the stream
    static_prompts: int = 0  # first-domain train-split prompts set aside to train a static head (never in the stream)
    top_up: bool = False  # builtin only: more math variants and the extra SQL prompts where a domain runs short
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "domains", tuple(self.domains))
        if self.requests < 1 or self.block < 1 or not self.domains or self.max_prompt_tokens < 1 or self.static_prompts < 0:
            raise InvalidParameterError("a stream needs requests, block, max_prompt_tokens >= 1, static_prompts >= 0 and some domains")


def prompt_key(prompt: Prompt) -> str:
    return f"{prompt.domain}:{prompt.id or hashlib.sha256(prompt.prompt.encode()).hexdigest()[:16]}"


def keyed_ids(prompts: list[Prompt], tokenizer, max_len: int) -> dict[str, list[int]]:
    rendered = render_chat(prompts, tokenizer)
    return {prompt_key(p): ids for p, ids in zip(prompts, rendered) if len(ids) <= max_len}


def build_stream(spec: StreamSpec, tokenizer) -> tuple[list[Prompt], dict[str, list[int]], dict[str, list[int]]]:
    """(stream prompts, their token ids by key, static-head training ids by key). The static head's prompts
    (first domain, train split) never appear in the stream; with builtin prompts the first domain's stream
    prompts come from the test split only (as `bench shift` always drew them)."""
    first = spec.domains[0]
    builtin = spec.prompts == "builtin"
    static_ids: dict[str, list[int]] = {}
    if spec.static_prompts:
        static_pool = load_prompts(spec.prompts, domains=[first], split="train" if builtin else "all", seed=spec.seed)
        static_ids = dict(list(keyed_ids(static_pool[: 2 * spec.static_prompts], tokenizer, spec.max_prompt_tokens).items())[: spec.static_prompts])
    pool = load_prompts(spec.prompts, domains=spec.domains, seed=spec.seed)
    if builtin and spec.top_up:
        pool += top_up(pool, spec)
    pool = [p for p in pool if prompt_key(p) not in static_ids]
    if builtin:  # the first domain's stream prompts come from the test split (a static head may train on its train split)
        pool = [p for p in pool if p.domain != first or prompt_split(p) == "test"]
    ids = keyed_ids(pool, tokenizer, spec.max_prompt_tokens)
    pool = [p for p in pool if prompt_key(p) in ids]
    stream = domain_stream(pool, spec.requests, spec.block, spec.domains, spec.seed)
    return stream, {prompt_key(p): ids[prompt_key(p)] for p in stream}, static_ids


def per_domain_need(spec: StreamSpec) -> dict[str, int]:
    """Requests each domain gets in the stream (blocks cycle through `domains`)."""
    need = dict.fromkeys(spec.domains, 0)
    for i in range(spec.requests):
        need[spec.domains[(i // spec.block) % len(spec.domains)]] += 1
    return need


def top_up(pool: list[Prompt], spec: StreamSpec) -> list[Prompt]:
    """More prompts for the domains of `spec` whose pool is shorter than their share of the stream: seeded
    gsm_symbolic variants beyond the built-in ones (math) and the extra SQL prompts built from the Spider /
    CoSQL schemas (tandem.training.more_prompts); other domains are left as they are."""
    from tandem.data import prompts as P
    from tandem.data.packages import package_files

    have = {d: sum(p.domain == d for p in pool) for d in spec.domains}
    short = {d for d, n in per_domain_need(spec).items() if n > have[d]}
    extra: list[Prompt] = []
    if "math" in short:
        seen = {p.prompt for p in pool}
        wanted = per_domain_need(spec)["math"] - have["math"]
        for p in P.math_prompts(package_files()["reasoning-gym"], range(P.GSM_VARIANTS, 8 * P.GSM_VARIANTS)):
            if len(extra) >= wanted:
                break
            if p.prompt not in seen:
                seen.add(p.prompt)
                extra.append(p)
    if "sql" in short:
        from tandem.training.more_prompts import extra_prompts

        extra += extra_prompts(package_files(), ("sql",))[: per_domain_need(spec)["sql"] - have["sql"]]
    return extra
