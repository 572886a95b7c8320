"""More train-split prompts for the two domains whose data sets are used up: SQL and chat.

Every built-in SQL prompt (Spider / CoSQL, ~220 in the train split) and chat prompt (alpaca_en_demo) is
regenerated already; these add prompts whose answer the target writes (tandem.training.sources):
- sql: new questions over the same database schemas, from templates filled with each schema's table and
  column names, in exactly the built-in format: a built-in prompt is kept verbatim up to its question.
- chat: English user turns from other files of the pinned packages (llamafactory's English demos; evals
  sets whose questions read as open questions once their answer options are cut off).

Each prompt keeps the project's split rule (`prompt_split` on its domain and id; test-side ones are dropped)
and none repeats a built-in prompt's text, so a head never trains on a held-out prompt.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import string
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tandem.data import prompts as P
from tandem.data.packages import EVALS_DATA, read_jsonl, read_member

EXTRA_DOMAINS = ("sql", "chat")


def extra_prompts(archives: dict[str, Path], domains: Iterable[str] = EXTRA_DOMAINS) -> list[P.Prompt]:
    """The extra train-split prompts of `domains` (sql, chat), each domain's sources interleaved so any prefix
    mixes them; the same list on every run and machine."""
    builtin = P.load_prompts("builtin", domains=P.DOMAINS + P.UNSEEN_DOMAINS)
    taken = {p.prompt for p in builtin}
    made = []
    if "sql" in domains:
        made += sql_prompts(sql_schemas(p for p in builtin if p.domain == "sql" and P.prompt_split(p) == "train"))
    if "chat" in domains:
        made += chat_prompts(archives)
    return list(_new_train_prompts(made, taken))


def interleave(groups: list[list[P.Prompt]]) -> list[P.Prompt]:
    """One item of each group in turn (order kept within a group)."""
    longest = max((len(g) for g in groups), default=0)
    return [g[i] for i in range(longest) for g in groups if i < len(g)]


def _new_train_prompts(prompts: Iterable[P.Prompt], taken: set[str]) -> Iterator[P.Prompt]:
    """Train-split prompts whose text is neither a built-in prompt's nor an earlier one's."""
    seen = set(taken)
    for p in prompts:
        if p.prompt not in seen and len(p.prompt) <= P.MAX_PROMPT_CHARS and P.prompt_split(p) == "train":
            seen.add(p.prompt)
            yield p


# ---- sql: templated questions over the built-in schemas ---------------------------------------------------
SQL_SOURCE = "tandem/sqlgen"
SQL_VARIANTS = 4  # fillings tried per (schema, template); repeated questions are skipped
SPIDER_QUESTION = "\nQuestion: "
COSQL_QUESTION = "\nQ: "


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # Spider's: number, text, time, others (CoSQL schemas borrow them; "text" where unknown)


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]


@dataclass(frozen=True)
class Link:
    """Two columns a join can match: a foreign key, or one column name two tables share."""

    table: str
    column: str
    other_table: str
    other_column: str


@dataclass(frozen=True)
class Schema:
    style: str  # "spider" (the question follows the tables) or "cosql" (it follows question-SQL pairs)
    prefix: str  # a built-in prompt, verbatim up to its (first) question
    tables: tuple[Table, ...]
    links: tuple[Link, ...]

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.prefix.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Template:
    name: str
    question: str
    sql: str
    join: bool = False  # filled from a Link (t1, t2, ...) rather than from one table

    @property
    def fields(self) -> set[str]:
        return {f for _, f, _, _ in string.Formatter().parse(self.question + self.sql) if f}


# Slots: t/T a table (words / SQL name), c, c2 columns, n a numeric column with thresholds v < v2, s a text
# column, g a grouping column, k a small count, L a letter, sub a substring; joins: t1/t2, K1/K2 the matched
# columns, on how they match (a relative clause), c1 a column of t1, n1 a numeric one, cj a column of t2.
SQL_TEMPLATES = (
    Template("count_rows", "How many rows does the {t} table have?", "SELECT count(*) FROM {T}"),
    Template("list_column", "List the {c} of every entry in {t}.", "SELECT {C} FROM {T}"),
    Template("list_two", "Show the {c} and {c2} of each {t} entry.", "SELECT {C}, {C2} FROM {T}"),
    Template("distinct", "What are the distinct values of {c} in the {t} table?", "SELECT DISTINCT {C} FROM {T}"),
    Template("count_distinct", "How many different {c} values appear in {t}?", "SELECT count(DISTINCT {C}) FROM {T}"),
    Template("above", "Which {t} entries have a {n} greater than {v}? Give their {c}.", "SELECT {C} FROM {T} WHERE {N} > {v}"),
    Template("count_below", "How many {t} entries have a {n} below {v}?", "SELECT count(*) FROM {T} WHERE {N} < {v}"),
    Template("between", "List the {c} of the {t} entries whose {n} is between {v} and {v2}.", "SELECT {C} FROM {T} WHERE {N} BETWEEN {v} AND {v2}"),
    Template("contains", "Find the {c} of every {t} entry whose {s} contains '{sub}'.", "SELECT {C} FROM {T} WHERE {S} LIKE '%{sub}%'"),
    Template("starts_with", "Which {s} values in {t} start with the letter {L}?", "SELECT {S} FROM {T} WHERE {S} LIKE '{L}%'"),
    Template("group_count", "For each {g}, how many {t} entries are there?", "SELECT {G}, count(*) FROM {T} GROUP BY {G}"),
    Template("group_having", "Which {g} values occur in more than {k} rows of {t}?", "SELECT {G} FROM {T} GROUP BY {G} HAVING count(*) > {k}"),
    Template("most_common", "What is the most common {g} in the {t} table?", "SELECT {G} FROM {T} GROUP BY {G} ORDER BY count(*) DESC LIMIT 1"),
    Template("top_k", "Show the {c} of the {k} {t} entries with the highest {n}.", "SELECT {C} FROM {T} ORDER BY {N} DESC LIMIT {k}"),
    Template("lowest", "What is the {c} of the {t} entry with the smallest {n}?", "SELECT {C} FROM {T} ORDER BY {N} ASC LIMIT 1"),
    Template("max_min", "What are the maximum and minimum {n} in {t}?", "SELECT max({N}), min({N}) FROM {T}"),
    Template("average", "What is the average {n} of all {t} entries?", "SELECT avg({N}) FROM {T}"),
    Template("total", "What is the total {n} over the whole {t} table?", "SELECT sum({N}) FROM {T}"),
    Template("group_average", "What is the average {n} for each {g} in {t}?", "SELECT {G}, avg({N}) FROM {T} GROUP BY {G}"),
    Template("above_average", "List the {c} of the {t} entries whose {n} is above the average.", "SELECT {C} FROM {T} WHERE {N} > (SELECT avg({N}) FROM {T})"),
    Template("sorted", "List every {c} in {t}, sorted by {n} from highest to lowest.", "SELECT {C} FROM {T} ORDER BY {N} DESC"),
    Template("alphabetical", "List all {s} values of the {t} table in alphabetical order.", "SELECT {S} FROM {T} ORDER BY {S} ASC"),
    Template("join_pairs", "Show the {c1} of each {t1} entry with the {cj} of the {t2} entry {on}.", "SELECT T1.{C1}, T2.{CJ} FROM {T1} AS T1 JOIN {T2} AS T2 ON T1.{K1} = T2.{K2}", join=True),
    Template("join_count", "For each {c1} in {t1}, how many {t2} entries are there {on}?", "SELECT T1.{C1}, count(*) FROM {T1} AS T1 JOIN {T2} AS T2 ON T1.{K1} = T2.{K2} GROUP BY T1.{C1}", join=True),
    Template("join_missing", "Which {t1} entries have a {k1} that matches no {k2} in {t2}? List their {c1}.", "SELECT {C1} FROM {T1} WHERE {K1} NOT IN (SELECT {K2} FROM {T2})", join=True),
    Template("join_filter", "For the {t1} entries whose {n1} is over {v}, what is the {cj} of the {t2} entries {on}?", "SELECT T2.{CJ} FROM {T1} AS T1 JOIN {T2} AS T2 ON T1.{K1} = T2.{K2} WHERE T1.{N1} > {v}", join=True),
)


def sql_schemas(prompts: Iterable[P.Prompt]) -> list[Schema]:
    """Each distinct schema of these SQL prompts, first seen first. CoSQL schemas list no column types:
    they take those of the same table in a Spider schema; Spider schemas list no foreign keys: they take
    those CoSQL declares between the same tables."""
    prefixes = list(dict.fromkeys(x for x in map(_schema_prefix, (p.prompt for p in prompts)) if x))
    parsed = [(x, _parse_tables(x)) for x in prefixes]
    types = {(t.name.lower(), c.name.lower()): c.type for x, tables in parsed if _style(x) == "spider" for t in tables for c in t.columns}
    keys = {tuple(k.lower() for k in m) for x, _ in parsed for m in _COSQL_KEY.findall(x)}
    schemas = []
    for prefix, tables in parsed:
        typed = tuple(Table(t.name, tuple(Column(c.name, types.get((t.name.lower(), c.name.lower()), c.type)) for c in t.columns)) for t in tables)
        schemas.append(Schema(_style(prefix), prefix, typed, _links(typed, keys)))
    return schemas


def sql_prompts(schemas: list[Schema]) -> list[P.Prompt]:
    """Every schema's templated prompts, interleaved so any prefix covers all schemas."""
    return interleave([list(_schema_prompts(s)) for s in schemas])


_SPIDER_TABLE = re.compile(r"^Table: (.+?)\. Columns: (.*)$", re.M)
_SPIDER_COLUMN = re.compile(r"(.+?) \((\w+)\)(?:, |$)")
_COSQL_TABLE = re.compile(r"^Table (\S+), columns = \[(.*)\]$", re.M)
_COSQL_KEY = re.compile(r"(\w+)\.(\w+) = (\w+)\.(\w+)")


def _schema_prefix(text: str) -> str | None:
    """The prompt up to its question (Spider: through "Question: "; CoSQL: before the first "Q: ")."""
    if SPIDER_QUESTION in text:
        return text[: text.index(SPIDER_QUESTION) + len(SPIDER_QUESTION)]
    if COSQL_QUESTION in text:
        return text[: text.index(COSQL_QUESTION)]
    return None


def _style(prefix: str) -> str:
    return "spider" if prefix.endswith(SPIDER_QUESTION) else "cosql"


def _parse_tables(prefix: str) -> tuple[Table, ...]:
    if _style(prefix) == "spider":
        return tuple(Table(name, tuple(Column(c, t) for c, t in _SPIDER_COLUMN.findall(cols))) for name, cols in _SPIDER_TABLE.findall(prefix))
    return tuple(Table(name, tuple(Column(c, "text") for c in cols.split(",") if c != "*")) for name, cols in _COSQL_TABLE.findall(prefix))


def _links(tables: tuple[Table, ...], keys: set[tuple[str, ...]]) -> tuple[Link, ...]:
    """Known foreign keys between these tables, then column names two tables share (both directions)."""
    column = {(t.name.lower(), c.name.lower()): (t.name, c.name) for t in tables for c in t.columns}
    links = [Link(*column[a, b], *column[c, d]) for a, b, c, d in sorted(keys) if (a, b) in column and (c, d) in column]
    for t in tables:
        for u in tables:
            shared = {c.name for c in t.columns} & {c.name for c in u.columns} if t.name != u.name else set()
            links += [Link(t.name, name, u.name, name) for name in sorted(shared)]
    return tuple(dict.fromkeys(links))


def _schema_prompts(schema: Schema) -> Iterator[P.Prompt]:
    """Variant-major, so the first prompts of a schema already cover every template. A template's variant n
    draws from its own seeded generator: an id names the same text on every machine."""
    seen: set[str] = set()
    for n in range(SQL_VARIANTS):
        for template in SQL_TEMPLATES:
            rng = random.Random(f"sqlgen:{schema.hash}:{template.name}:{n}")
            filled = _fill(template, schema, rng)
            if filled is None or filled[0] in seen:
                continue
            seen.add(filled[0])
            text = _render(schema, template, filled, rng)
            yield P.Prompt("sql", text, SQL_SOURCE, f"sqlgen/{schema.hash}/{template.name}/{n}")


def _render(schema: Schema, template: Template, filled: tuple[str, str, str], rng: random.Random) -> str:
    """Spider: the question after the tables. CoSQL: after two question-SQL pairs from other templates on
    the same table, as every built-in CoSQL prompt has (its instruction asks for an answer in their context)."""
    question, _, table = filled
    if schema.style == "spider":
        return schema.prefix + question
    others = [t for t in SQL_TEMPLATES if not t.join and t.name != template.name]
    pairs = [p for p in (_fill(t, schema, rng, table) for t in rng.sample(others, 6)) if p is not None][:2]
    return schema.prefix + "".join(f"{COSQL_QUESTION}{q}\nA: {sql}" for q, sql, _ in pairs) + COSQL_QUESTION + question


def _fill(template: Template, schema: Schema, rng: random.Random, table: str | None = None) -> tuple[str, str, str] | None:
    """(question, SQL, table) from slots drawn with `rng`; None when no table of the schema has the slots
    the template needs (e.g. a numeric column, or a link for a join)."""
    if template.join:
        options = [_link_slots(schema, link, rng) for link in schema.links if table in (None, link.table)]
    else:
        options = [_table_slots(t, rng) for t in schema.tables if table in (None, t.name) and t.columns]
    options = [o for o in options if template.fields <= o.keys()]
    if not options:
        return None
    slots = rng.choice(options)
    return template.question.format(**slots), template.sql.format(**slots), slots["table"]


_LETTERS = "ABCDEFGHJKLMNPRSTW"
_SUBSTRINGS = ("a", "e", "an", "er", "in", "on", "ar", "el", "son", "ing")


def _table_slots(table: Table, rng: random.Random) -> dict[str, str]:
    cols = list(table.columns)
    numeric = [c for c in cols if c.type == "number" and not _is_key(c.name)]
    text = [c for c in cols if c.type == "text"]
    slots = {"table": table.name, "t": _words(table.name), "T": _ident(table.name), "k": str(rng.choice((2, 3, 5))), "L": rng.choice(_LETTERS), "sub": rng.choice(_SUBSTRINGS)}
    n = rng.choice(numeric) if numeric else None
    if n is not None:
        low, high = _thresholds(n.name, rng)
        slots |= {"n": _words(n.name), "N": _ident(n.name), "v": str(low), "v2": str(high)}
    if text:
        s = rng.choice(text)
        slots |= {"s": _words(s.name), "S": _ident(s.name)}
    others = [c for c in cols if c != n] or cols
    picked = rng.sample(others, min(2, len(others)))
    slots |= {"c": _words(picked[0].name), "C": _ident(picked[0].name)}
    if len(picked) == 2:
        slots |= {"c2": _words(picked[1].name), "C2": _ident(picked[1].name)}
    groups = [c for c in others if c.type != "number" and not _is_key(c.name)]
    if groups:
        g = rng.choice(groups)
        slots |= {"g": _words(g.name), "G": _ident(g.name)}
    return slots


def _link_slots(schema: Schema, link: Link, rng: random.Random) -> dict[str, str]:
    tables = {t.name: t for t in schema.tables}
    mine = [c for c in tables[link.table].columns if c.name != link.column] or list(tables[link.table].columns)
    theirs = [c for c in tables[link.other_table].columns if c.name != link.other_column] or list(tables[link.other_table].columns)
    c1, cj = rng.choice(mine), rng.choice(theirs)
    slots = {"table": link.table, "t1": _words(link.table), "T1": _ident(link.table), "t2": _words(link.other_table), "T2": _ident(link.other_table),
             "k1": _words(link.column), "K1": _ident(link.column), "k2": _words(link.other_column), "K2": _ident(link.other_column),
             "c1": _words(c1.name), "C1": _ident(c1.name), "cj": _words(cj.name), "CJ": _ident(cj.name),
             "on": f"with the same {_words(link.column)}" if link.column == link.other_column else f"whose {_words(link.other_column)} equals its {_words(link.column)}"}
    numeric = [c for c in mine if c.type == "number" and not _is_key(c.name)]
    if numeric:
        n1 = rng.choice(numeric)
        slots |= {"n1": _words(n1.name), "N1": _ident(n1.name), "v": str(_thresholds(n1.name, rng)[0])}
    return slots


def _thresholds(column: str, rng: random.Random) -> tuple[int, int]:
    """Two increasing numbers of a plausible size for the column (years look like years, ages like ages)."""
    name = column.lower()
    if "year" in name:
        low = rng.randrange(1990, 2016)
        return low, low + rng.choice((5, 10))
    if "age" in name:
        low = rng.randrange(18, 50)
        return low, low + rng.choice((10, 20))
    low = rng.choice((1, 2, 3, 5, 10, 20, 50, 100, 500, 1000))
    return low, low * rng.choice((2, 5, 10))


def _is_key(name: str) -> bool:
    """Identifier-like columns: averaging or thresholding them makes no sense."""
    return name.lower().endswith(("id", "no", "code"))


def _words(name: str) -> str:
    """A SQL name as words: `Number_products` -> "number products", `CountryName` -> "country name"."""
    spaced = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", name).replace("_", " ")
    return " ".join(w if w.isupper() and len(w) > 1 else w.lower() for w in spaced.split())


def _ident(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z_]\w*", name) else f'"{name}"'


# ---- chat: English user turns from other files of the pinned packages ---------------------------------------
LLAMAFACTORY_FILES = (
    "dpo_en_demo.json", "kto_en_demo.json", "glaive_toolcall_en_demo.json", "identity.json",
    "v1_sft_demo.jsonl", "v1_dpo_demo.jsonl", "reason_tool_use_demo_50.jsonl",
)
MIN_CHAT_CHARS = 20  # shorter turns ("hi", "Who are you?") say little about decoding a real answer


def chat_prompts(archives: dict[str, Path]) -> list[P.Prompt]:
    """English, 20..1,500 characters, no answer-option lists; one source after another in turn."""
    groups = [list(_llamafactory_turns(archives, name)) for name in LLAMAFACTORY_FILES]
    groups += [list(_evals_questions(archives, path, short, rewrite)) for path, short, rewrite in EVALS_CHAT_SETS]
    return interleave([[p for p in g if _is_chat_prompt(p.prompt)] for g in groups])


def _llamafactory_turns(archives: dict[str, Path], name: str) -> Iterator[P.Prompt]:
    data = read_member(archives["llamafactory"], f"data/{name}")
    rows = read_jsonl(data) if name.endswith(".jsonl") else json.loads(data)
    stem = name.rsplit(".", 1)[0]
    for i, row in enumerate(rows):
        text = _first_user_turn(row)
        if text:
            yield P.Prompt("chat", text, f"llamafactory/{stem}", f"{stem}/{i}")


def _first_user_turn(row: dict) -> str | None:
    """The opening user message in any of llamafactory's formats: alpaca (instruction + input), sharegpt
    (conversations of from/value), OpenAI messages (role/content), or v1 messages (content parts)."""
    if "instruction" in row:
        extra = (row.get("input") or "").strip()
        return row["instruction"].strip() + (f"\n\n{extra}" if extra else "")
    turns = row.get("conversations") or row.get("messages") or row.get("chosen_messages") or []
    for turn in turns:
        if turn.get("from", turn.get("role")) in ("human", "user"):
            content = turn.get("value", turn.get("content"))
            if isinstance(content, list):
                content = "\n".join(part["value"] for part in content if part.get("type") == "text")
            return content.strip() if isinstance(content, str) else None
    return None


def _evals_questions(archives: dict[str, Path], path: str, short: str, rewrite: Callable[[str], str | None]) -> Iterator[P.Prompt]:
    for i, row in enumerate(read_jsonl(read_member(archives["evals"], EVALS_DATA + path))):
        users = [m["content"] for m in row["input"] if m["role"] == "user"]
        text = rewrite(users[-1].strip()) if users else None
        if text:
            yield P.Prompt("chat", text, f"evals/{path.split('/')[0]}", f"{short}/{i}")


def _cut(pattern: str) -> Callable[[str], str]:
    """Drop the first match of `pattern` and everything after it (answer options, answer-format orders)."""
    return lambda text: re.split(pattern, text, maxsplit=1)[0].strip()


def _parable(text: str) -> str:
    return text.split("\nWhich moral", 1)[0].strip() + "\n\nWhat moral is this story trying to convey?"


def _passage_question(text: str) -> str | None:
    match = re.fullmatch(r"Question: (.*?)\n\s*Context: (.*)", text, re.S)
    return f"{match.group(2).strip()}\n\n{match.group(1).strip()}" if match else None


EVALS_CHAT_SETS: tuple[tuple[str, str, Callable[[str], str | None]], ...] = (
    ("theory_of_mind/socialiqa/test.jsonl", "socialiqa", _cut(r" A: ")),
    ("moral_exceptQA/samples.jsonl", "moral_exceptqa", _cut(r"\s*\nYes\nNo\nAnswer:")),
    ("parable-to-moral-match/parable-to-moral-match-en.jsonl", "parables", _parable),
    ("ambiguous-sentences/samples.jsonl", "ambiguous_sentences", lambda text: text.replace("..", ".")),
    ("born_first/born_first.jsonl", "born_first", _cut(r" Answer Y or N")),
    ("which_is_heavier/which_is_heavier.jsonl", "which_is_heavier", _cut(r" Answer Yes or No")),
    ("emotional-intelligence/samples.jsonl", "emotional_intelligence", _cut(r" \(a\) ")),
    ("unsolvable_questions/samples.jsonl", "unsolvable_questions", _passage_question),
)

_OPTIONS = re.compile(r"(?im)^\s*(?:\(?[a-e][).]\s|options?\s*:|choices?\s*:|answer\s*:)|\([A-E]\)\.?\s|\bA: .*; B: |pick your answer|choose your answer|i think the answer is")
_ENGLISH_WORDS = frozenset("the a an of to and or is are was were be in on at for from by with as it this that you your i my we what how why who which when where do does did can could would should will not than more".split())


def _is_chat_prompt(text: str) -> bool:
    return MIN_CHAT_CHARS <= len(text) <= P.MAX_PROMPT_CHARS and _is_english(text) and not _OPTIONS.search(text)


def _is_english(text: str) -> bool:
    """Mostly ASCII letters and some common English words (drops the demo files' translation tasks)."""
    letters = [ch for ch in text if ch.isalpha()]
    words = re.findall(r"[a-z']+", text.lower())
    ascii_share = sum(ch.isascii() for ch in letters) / max(1, len(letters))
    return ascii_share >= 0.97 and sum(w in _ENGLISH_WORDS for w in words) >= max(1, 0.05 * len(words))
