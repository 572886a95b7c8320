"""Incremental detokenization with stop strings (ChoiceText), over a byte-level decode like the tiny models'."""
from tandem.server.generation import ChoiceText, spec_usage


def byte_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def feed(choice, chunks, finish_reason="length"):
    deltas = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        deltas.append(choice.push(list(chunk), last, finish_reason if last else None))
    return deltas


def test_a_partial_utf8_character_is_held_back():
    snow = "é".encode()  # two bytes
    choice = ChoiceText(byte_decode, ())
    deltas = feed(choice, [b"a", snow[:1], snow[1:], b"b"])
    assert deltas == ["a", "", "é", "b"] and choice.text == "aéb" and choice.finish_reason == "length"


def test_a_stop_string_across_pushes_cuts_text_and_tokens():
    choice = ChoiceText(byte_decode, ("END",))
    deltas = [choice.push(list(b"hello E"), False, None), choice.push(list(b"N"), False, None), choice.push(list(b"D and more"), False, None)]
    assert deltas == ["hello", " ", ""] and "".join(deltas) == choice.text == "hello "
    assert choice.done and choice.finish_reason == "stop" and choice.num_tokens == len(b"hello ")
    assert choice.push(list(b"x"), True, "length") == ""  # tokens after the stop are ignored


def test_a_held_back_prefix_is_released_when_it_does_not_become_a_stop():
    choice = ChoiceText(byte_decode, ("STOP",))
    assert choice.push(list(b"abcST"), False, None) == "ab"
    assert choice.push(list(b"ay"), True, "stop") == "cSTay" and choice.text == "abcSTay"


def test_spec_usage_sums_choices():
    a = {"drafts": 2, "drafted_tokens": 8, "accepted_tokens": 4, "steps": 3, "output_tokens": 8, "accepted_per_position": [2, 1, 1], "drafter_versions": [0]}
    b = {"drafts": 1, "drafted_tokens": 4, "accepted_tokens": 0, "steps": 2, "output_tokens": 3, "accepted_per_position": [0], "drafter_versions": [1]}
    usage = spec_usage([a, b])
    assert usage["drafted_tokens"] == 12 and usage["accepted_tokens"] == 4 and usage["verify_steps"] == 5
    assert usage["acceptance_length"] == round((7 + 2) / 5, 4) and usage["acceptance_rate"] == round(4 / 12, 4)
    assert usage["accepted_per_position"] == [2, 1, 1] and usage["drafter_versions"] == [0, 1]


class CountingDecode:
    """byte_decode that counts the tokens it was asked to decode (the cost of detokenization)."""

    def __init__(self):
        self.tokens = 0

    def __call__(self, ids):
        self.tokens += len(ids)
        return byte_decode(ids)


def test_detokenization_is_incremental():
    """Each token costs O(1) decoded tokens, not a re-decode of the whole choice (2,000 tokens: 2 M before)."""
    text = ("the quick brown fox é jumps " * 80).encode()[:2000]
    decode = CountingDecode()
    choice = ChoiceText(decode, ("NEVER",))
    released = "".join(choice.push([b], i == len(text) - 1, "length" if i == len(text) - 1 else None) for i, b in enumerate(text))
    assert released == choice.text == text.decode("utf-8", errors="replace")
    assert decode.tokens <= 4 * len(text)


def test_a_stop_hit_late_in_a_long_choice_decodes_only_its_window():
    body = ("abcdefghij" * 300).encode()
    decode = CountingDecode()
    choice = ChoiceText(decode, ("XYZ",))
    for b in body:
        choice.push([b], False, None)
    spent = decode.tokens
    choice.push(list(b"--XYZ tail"), False, None)
    assert choice.done and choice.text == body.decode() + "--" and choice.num_tokens == len(body) + 2
    assert decode.tokens - spent <= 12 * (len(body) + 12)  # a few prefix decodes of the last window, not one per token


def test_incremental_text_equals_a_whole_decode_with_a_real_tokenizer(tiny_llama):
    """Windows of a byte-level BPE tokenizer with specials glue back to the decode of all ids."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
        choice = ChoiceText(decode, ())
        pos, out = 0, []
        while pos < len(ids):
            step = rng.randint(1, 5)
            last = pos + step >= len(ids)
            out.append(choice.push(ids[pos:pos + step], last, "length" if last else None))
            pos += step
        assert "".join(out) == choice.text == decode(ids)


def test_include_stop_str_in_output_keeps_the_stop_string_and_its_tokens():
    choice = ChoiceText(byte_decode, ("END",), include_stop=True)
    deltas = [choice.push(list(b"hello E"), False, None), choice.push(list(b"ND and more"), False, None)]
    assert "".join(deltas) == choice.text == "hello END" and choice.num_tokens == len(b"hello END") and choice.finish_reason == "stop"


def test_a_stop_string_before_min_tokens_does_not_end_the_choice():
    choice = ChoiceText(byte_decode, ("ab",), min_tokens=4)
    assert choice.push(list(b"ab"), False, None) == "a" and not choice.done  # 2 tokens < min_tokens: no stop check yet
    assert choice.push(list(b"cd"), False, None) == "bc" and not choice.done  # "ab" ends inside the first 4 tokens' text
    choice.push(list(b"xab"), False, None)
    assert choice.done and choice.text == "abcdx" and choice.num_tokens == 5


def test_echo_and_logprobs_are_taken_once_prompt_tokens_first():
    choice = ChoiceText(byte_decode, (), echo="hi")
    choice.echo_logprobs = [(104, None, None), (105, -1.5, [(105, -1.5), (7, -2.0)])]
    choice.push(list(b"ok"), True, "length", logprobs=[-0.5, -0.25], top_logprobs=[[(111, -0.5)], [(107, -0.25)]])
    assert choice.take_echo() == "hi" and choice.take_echo() == ""
    assert choice.take_logprobs() == [(104, None, None), (105, -1.5, [(105, -1.5), (7, -2.0)]), (111, -0.5, [(111, -0.5)]), (107, -0.25, [(107, -0.25)])]
    assert choice.take_logprobs() == []
