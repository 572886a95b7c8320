"""Prompt loading, validation, splits and domain streams; the real fetch is one slow test."""

import json
from collections import Counter
from pathlib import Path

import pytest

from tandem.data import prompts as prompts_mod
from tandem.data.prompts import (
    DOMAINS,
    UNSEEN_DOMAINS,
    Prompt,
    domain_stream,
    ensure_builtin_prompts,
    load_prompts,
    prompt_split,
    render_chat,
)
from tandem.errors import InvalidParameterError


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _write_rows(path: Path, rows: list[dict]) -> Path:
    return _write_lines(path, [json.dumps(r, ensure_ascii=False) for r in rows])


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """200 prompts per built-in domain, ids unique, deterministic."""
    rows = [{"domain": d, "prompt": f"{d} prompt {i}", "id": f"{d}/{i}"} for d in DOMAINS for i in range(200)]
    return _write_rows(tmp_path / "corpus.jsonl", rows)


def test_user_jsonl_round_trip(tmp_path: Path) -> None:
    path = _write_rows(
        tmp_path / "p.jsonl",
        [
            {"domain": "code", "prompt": "def f():", "source": "mine", "id": "a"},
            {"domain": "legal", "prompt": "Résumé ce contrat."},
        ],
    )
    got = load_prompts(path)
    assert got == [Prompt("code", "def f():", "mine", "a"), Prompt("legal", "Résumé ce contrat.")]
    assert load_prompts(str(path), domains=["legal"]) == [Prompt("legal", "Résumé ce contrat.")]


def test_blank_lines_are_skipped_and_line_numbers_stay_true(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "p.jsonl", ['{"domain": "chat", "prompt": "hi"}', "", "{oops"])
    with pytest.raises(InvalidParameterError, match=r"p\.jsonl:3: invalid JSON"):
        load_prompts(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "invalid JSON"),
        ('["chat", "hi"]', "expected a JSON object"),
        ('{"prompt": "hi"}', "missing required field 'domain'"),
        ('{"domain": "chat"}', "missing required field 'prompt'"),
        ('{"domain": "", "prompt": "hi"}', "field 'domain' is empty"),
        ('{"domain": "chat", "prompt": "   "}', "field 'prompt' is empty"),
        ('{"domain": "chat", "prompt": 3}', "field 'prompt' must be a string"),
        ('{"domain": "chat", "prompt": "hi", "id": null}', "field 'id' must be a string"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = _write_lines(tmp_path / "bad.jsonl", ['{"domain": "chat", "prompt": "fine"}', line])
    with pytest.raises(InvalidParameterError, match=rf"bad\.jsonl:2: {message}") as info:
        load_prompts(path)
    assert isinstance(info.value, ValueError)


def test_extra_fields_are_accepted_and_ignored(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "p.jsonl", [
        '{"domain": "code", "prompt": "sort a list", "category": "easy", "repeat": true, "id": "c1"}',
        '{"domain": "chat", "prompt": "hi", "source": "me", "meta": {"k": [1, 2]}, "weight": 0.5}',
    ])
    prompts = load_prompts(path, domains=["code", "chat"])
    assert [(p.domain, p.prompt, p.id, p.source) for p in prompts] == [("code", "sort a list", "c1", ""), ("chat", "hi", "", "me")]


def test_empty_and_missing_files_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError, match="no prompts"):
        load_prompts(_write_lines(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(InvalidParameterError, match="cannot read prompt file"):
        load_prompts(tmp_path / "absent.jsonl")


def test_bad_arguments_are_rejected(corpus: Path) -> None:
    with pytest.raises(InvalidParameterError, match="split"):
        load_prompts(corpus, split="validation")
    with pytest.raises(InvalidParameterError, match="per_domain"):
        load_prompts(corpus, per_domain=0)
    with pytest.raises(InvalidParameterError, match=r"no prompts for domain\(s\) \['poetry'\]"):
        load_prompts(corpus, domains=["code", "poetry"])


def test_per_domain_is_a_seeded_sample(corpus: Path) -> None:
    got = load_prompts(corpus, domains=["math", "sql"], per_domain=10, seed=1)
    assert [p.domain for p in got] == ["math"] * 10 + ["sql"] * 10
    assert got == load_prompts(corpus, domains=["math", "sql"], per_domain=10, seed=1)
    # Two seeds picking the same 10 of 200 in the same order has probability ~1e-23.
    assert got != load_prompts(corpus, domains=["math", "sql"], per_domain=10, seed=2)
    assert load_prompts(corpus, domains=["sql"], per_domain=10, seed=1) == got[10:]


def test_split_is_deterministic_disjoint_and_about_80_20(corpus: Path) -> None:
    everything = load_prompts(corpus)
    train = load_prompts(corpus, split="train")
    test = load_prompts(corpus, split="test")
    assert set(train).isdisjoint(test)
    assert set(train) | set(test) == set(everything)
    assert load_prompts(corpus, split="test", seed=5) == load_prompts(corpus, split="test", seed=5)
    # The split is a fixed hash, so these counts never change; the band just documents "about 20 %".
    for domain, count in Counter(p.domain for p in test).items():
        assert 20 <= count <= 60, (domain, count)


def test_template_variants_share_a_split() -> None:
    variants = [Prompt("math", f"variant {v}", id=f"gsm/{t}#{v}") for t in range(50) for v in range(4)]
    by_template: dict[str, set[str]] = {}
    for p in variants:
        by_template.setdefault(p.id.split("#")[0], set()).add(prompt_split(p))
    assert all(len(splits) == 1 for splits in by_template.values())
    assert {s for splits in by_template.values() for s in splits} == {"train", "test"}


def test_domain_stream_blocks_follow_the_order() -> None:
    pool = [Prompt(d, f"{d} {i}") for d in DOMAINS for i in range(7)]
    stream = domain_stream(pool, num_requests=53, block=4, seed=3)
    assert len(stream) == 53
    expected = [DOMAINS[(i // 4) % len(DOMAINS)] for i in range(53)]
    assert [p.domain for p in stream] == expected
    assert stream == domain_stream(pool, num_requests=53, block=4, seed=3)
    assert stream != domain_stream(pool, num_requests=53, block=4, seed=4)


def test_domain_stream_cycles_through_a_small_domain_without_early_repeats() -> None:
    pool = [Prompt("sql", f"q{i}") for i in range(3)] + [Prompt("chat", f"c{i}") for i in range(50)]
    stream = domain_stream(pool, num_requests=20, block=10, order=("sql", "chat"), seed=0)
    sql = [p.prompt for p in stream[:10]]
    assert all(len(set(sql[i : i + 3])) == 3 for i in range(0, 9, 3))
    assert len({p.prompt for p in stream[10:]}) == 10


def test_domain_stream_rejects_missing_domains_and_bad_sizes() -> None:
    pool = [Prompt("code", "x")]
    with pytest.raises(InvalidParameterError, match="no prompts for domain"):
        domain_stream(pool, num_requests=5, block=1)
    with pytest.raises(InvalidParameterError, match="block"):
        domain_stream(pool, num_requests=5, block=0, order=("code",))
    assert domain_stream(pool, num_requests=0, block=1, order=("code",)) == []


def test_render_chat_applies_the_template() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "user", "assistant", ":", "hello", "world", "bye"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    ids = render_chat([Prompt("chat", "hello world"), Prompt("chat", "bye")], tokenizer)
    assert ids == [[1, 3, 4, 5, 2, 3], [1, 3, 6, 2, 3]]


def test_builtin_cache_is_written_atomically_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    fetched = [Prompt("code", "def f():", "fake", "f/0"), Prompt("chat", "hi", "fake", "c/0")]
    monkeypatch.setattr(prompts_mod, "_fetch_builtin", lambda tmp, progress: fetched)
    path = ensure_builtin_prompts(progress=False)
    assert path == tmp_path / "data" / "prompts-v2.jsonl"
    assert [p.name for p in path.parent.iterdir()] == [path.name]

    def no_fetch(tmp: Path, progress: bool) -> list[Prompt]:
        raise AssertionError("cache exists; must not fetch again")

    monkeypatch.setattr(prompts_mod, "_fetch_builtin", no_fetch)
    assert load_prompts("builtin") == fetched


def test_unseen_domains_load_only_when_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    fetched = [Prompt("code", "def f():", "fake", "f/0"), Prompt(UNSEEN_DOMAINS[0], "sum up", "fake", "s/0")]
    monkeypatch.setattr(prompts_mod, "_fetch_builtin", lambda tmp, progress: fetched)
    assert load_prompts("builtin") == fetched[:1]
    assert load_prompts("builtin", domains=UNSEEN_DOMAINS) == fetched[1:]


def test_clean_drops_empty_long_and_duplicate_prompts() -> None:
    raw = [Prompt("chat", " hi "), Prompt("chat", "hi"), Prompt("chat", ""), Prompt("chat", "x" * 1501)]
    assert list(prompts_mod._clean(raw)) == [Prompt("chat", "hi")]


@pytest.mark.slow
def test_real_fetch_yields_all_domains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    ensure_builtin_prompts(progress=False)
    counts = Counter(p.domain for p in load_prompts("builtin"))
    assert set(counts) == set(DOMAINS)
    unseen = load_prompts("builtin", domains=UNSEEN_DOMAINS, split="test")
    assert {p.domain for p in unseen} == set(UNSEEN_DOMAINS) and len(unseen) >= 100
    assert all(counts[d] >= 50 for d in DOMAINS), counts
    assert all(len(p.prompt) <= 1500 for p in load_prompts("builtin"))


@pytest.mark.slow
def test_extra_math_variants_are_new_texts_on_their_templates_side_of_the_split() -> None:
    from tandem.data.packages import package_files
    from tandem.training import sources

    wheel = package_files()["reasoning-gym"]
    builtin = list(prompts_mod.math_prompts(wheel, range(4)))
    extra = list(prompts_mod.math_prompts(wheel, sources.EXTRA_MATH_VARIANTS))
    assert list(prompts_mod.math_prompts(wheel, range(4))) == builtin  # seeded: same text on every run
    assert len(extra) == 2 * len(builtin)
    split_of = {p.id.split("#")[0]: prompt_split(p) for p in builtin}
    assert all(prompt_split(p) == split_of[p.id.split("#")[0]] for p in extra)
    regen = [d for d in sources.regeneration_prompts(domains=("math",)) if d.domain == "math"]
    test_templates = {t for t, s in split_of.items() if s == "test"}
    assert test_templates and not any(d.id.split("#")[0] in test_templates for d in regen)
    assert len({d.prompt for d in regen}) == len(regen) > 2 * sum(s == "train" for s in split_of.values()) * 4
