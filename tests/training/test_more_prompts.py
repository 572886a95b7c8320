"""Extra SQL / chat regeneration prompts: built-in format, train split only, no built-in text, deterministic."""
import re
from collections import Counter

import pytest

from tandem.data import prompts as P
from tandem.training import more_prompts as M

SPIDER = (
    "Answer the following question with syntactically correct SQLite SQL. Be creative but the SQL must be correct.\n"
    "Use only the following tables and columns:\n"
    "Table: singer. Columns: Singer_ID (number), Name (text), Birth_Year (number), Net_Worth_Millions (number)\n"
    "Table: song. Columns: Song_ID (number), Title (text), Singer_ID (number), Sales (number)\n"
    "\nQuestion: How many singers are there?"
)
COSQL = (
    "TASK: Answer the following question with syntactically correct SQLite SQL. The SQL should be correct and be in context of the previous question-answer pairs.\n"
    "Table singer, columns = [*,Singer_ID,Name,Birth_Year,Net_Worth_Millions]\n"
    "Table song, columns = [*,Song_ID,Title,Singer_ID,Sales]\n"
    "Foreign_keys = [song.Singer_ID = singer.Singer_ID]\n"
    "Q: How many singers are there?\nA: SELECT count ( * )  FROM singer\n"
    "Q: And songs?\nA: SELECT count ( * )  FROM song\nQ: Which singer is the oldest?"
)


def _schemas():
    return M.sql_schemas([P.Prompt("sql", SPIDER), P.Prompt("sql", COSQL), P.Prompt("sql", SPIDER.replace("How many", "Count"))])


def test_schemas_parse_tables_types_and_links():
    spider, cosql = _schemas()  # the third prompt repeats the first one's schema
    assert spider.style == "spider" and cosql.style == "cosql"
    assert [t.name for t in spider.tables] == ["singer", "song"]
    assert [(c.name, c.type) for c in cosql.tables[0].columns][:3] == [("Singer_ID", "number"), ("Name", "text"), ("Birth_Year", "number")]  # types borrowed
    assert M.Link("song", "Singer_ID", "singer", "Singer_ID") in spider.links  # CoSQL's foreign key, lent to the Spider schema


def test_sql_prompts_keep_the_builtin_format():
    spider, cosql = _schemas()
    prompts = M.sql_prompts([spider, cosql])
    names = {p.id.split("/")[2] for p in prompts}
    assert len(names) >= 20 and names <= {t.name for t in M.SQL_TEMPLATES}
    for p in prompts:
        head, question = p.prompt.rsplit("\n", 1)
        if p.prompt.startswith(spider.prefix):
            assert question.startswith("Question: ") and "\nQ: " not in p.prompt
        else:
            assert p.prompt.startswith(cosql.prefix) and question.startswith("Q: ")
            assert re.fullmatch(r"(\nQ: [^\n]+\nA: SELECT [^\n]+){2}", head[len(cosql.prefix):]), p.prompt
        assert "{" not in question and len(question) > 20
    assert len({p.prompt for p in prompts}) == len(prompts) == len({p.id for p in prompts})


def test_sql_prompts_are_the_same_on_every_call_and_ids_name_one_text():
    first = M.sql_prompts(_schemas())
    assert first == M.sql_prompts(_schemas())
    assert all(re.fullmatch(r"sqlgen/[0-9a-f]{8}/\w+/\d", p.id) for p in first)


def test_words_and_identifiers():
    assert M._words("Number_products") == "number products" and M._words("CountryName") == "country name"
    assert M._words("MPG") == "MPG" and M._ident("18_49_Rating_Share") == '"18_49_Rating_Share"'


def test_first_user_turn_reads_every_llamafactory_format():
    assert M._first_user_turn({"instruction": "Sum these.", "input": "1 2", "output": "3"}) == "Sum these.\n\n1 2"
    assert M._first_user_turn({"conversations": [{"from": "human", "value": " Hi there "}]}) == "Hi there"
    assert M._first_user_turn({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "Q?"}]}) == "Q?"
    v1 = {"messages": [{"role": "user", "content": [{"type": "text", "value": "Tell me a joke."}]}]}
    assert M._first_user_turn(v1) == "Tell me a joke."


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("What are three tips for staying healthy in winter?", True),
        ("hi there", False),  # too short
        ("x" * 1501, False),
        ("Which is the best summary?\nPick your answer from:\n(A). World\n(B). Sports", False),
        ("Was the claim right?\nOptions:\n- yes\n- no", False),
        ("Переведите это предложение на английский язык, пожалуйста.", False),
    ],
)
def test_chat_filter(text, kept):
    assert M._is_chat_prompt(text) is kept


def test_evals_rewrites_cut_answer_options():
    assert M.EVALS_CHAT_SETS[0][2]("Kai ran. How would Kai feel? A: tired; B: sad; C: happy.") == "Kai ran. How would Kai feel?"
    assert M._passage_question("Question: Who won?\n Context: Ann won.") == "Ann won.\n\nWho won?"


# ---- the real prompts: need the pinned data packages (downloaded once) ----------------------------------------
@pytest.fixture(scope="module")
def extra():
    from tandem.data.packages import package_files

    return M.extra_prompts(package_files())


@pytest.mark.slow
def test_extra_prompts_counts_split_and_no_builtin_text(extra):
    counts = Counter(p.domain for p in extra)
    assert counts["sql"] >= 1500 and counts["chat"] >= 2000, counts
    assert len({(p.source, p.id) for p in extra}) == len(extra) == len({p.prompt for p in extra})
    assert all(P.prompt_split(p) == "train" for p in extra)
    builtin = {p.prompt for p in P.load_prompts("builtin", domains=P.DOMAINS + P.UNSEEN_DOMAINS)}
    test_texts = {p.prompt for p in P.load_prompts("builtin", split="test")}
    assert test_texts and not test_texts & {p.prompt for p in extra} and not builtin & {p.prompt for p in extra}
    assert all(len(p.prompt) <= P.MAX_PROMPT_CHARS for p in extra)
    assert len({p.source for p in extra if p.domain == "chat"}) >= 10


@pytest.mark.slow
def test_extra_prompts_are_deterministic_and_sql_ones_keep_a_builtin_prefix(extra):
    from tandem.data.packages import package_files

    assert M.extra_prompts(package_files()) == extra
    prefixes = {M._schema_prefix(p.prompt) for p in P.load_prompts("builtin", domains=["sql"], split="train")}
    sql = [p for p in extra if p.domain == "sql"]
    assert all(M._schema_prefix(p.prompt) in prefixes for p in sql)
    assert {M._style(M._schema_prefix(p.prompt)) for p in sql} == {"spider", "cosql"}


@pytest.mark.slow
def test_regeneration_prompts_alternate_extras_with_the_existing_ones_with_the_same_keys():
    from tandem.training.features import doc_key
    from tandem.training.sources import regeneration_prompts

    without = regeneration_prompts(domains=("sql", "chat", "translation"), extra=False)
    with_extra = regeneration_prompts(domains=("sql", "chat", "translation"))
    for domain in ("sql", "chat", "translation"):
        old = [doc_key(d) for d in without if d.domain == domain]
        new = [doc_key(d) for d in with_extra if d.domain == domain]
        assert [k for k in new if k in set(old)] == old  # existing documents keep their keys and their order
        assert (len(new) > len(old) + 1000) == (domain != "translation")
        if domain != "translation":
            assert new[0] == old[0] and new[1] not in set(old)  # built-in and extra alternate from the start
    assert {d.domain for d in with_extra[:3]} == {"sql", "chat", "translation"}
    assert all(d.answer is None for d in with_extra)
