"""The group suffix drafter: what it drafts from (siblings, history, other prompts), its bounds, and losslessness
(greedy identity with plain decoding, and the target's distribution at T = 1)."""
import dataclasses

import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.drafters.suffix import SuffixDrafter
from tandem.engine.engine import Engine
from tandem.engine.request import Request
from tandem.errors import InvalidParameterError
from tandem.models.loader import load_transformer
from tests.engine.test_lossless_e2e import exact_distribution, sample_outputs
from tiny_helpers import FALSE_FAILURE, SAMPLES, chi_square_p_value

PROMPT = [1, 2, 3, 4, 5]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def request(rid, prompt, output=(), params=GREEDY):
    r = Request(rid, list(prompt), params, Request.make_generator(0))
    r.output_ids = list(output)
    return r


def start(drafter, r, first):
    r.output_ids = [first]
    drafter.on_prefill(r, None)


def emit(drafter, r, tokens):
    r.output_ids += tokens
    drafter.on_verified([r], [], [], [], None)


def draft(drafter, r, budget=8):
    return drafter.propose([r], [budget])[0].tokens.tolist()


def test_a_sibling_drafts_what_another_sibling_wrote():
    d = SuffixDrafter(num_draft_tokens=4, min_prob=0.0, prior=0.0)
    a, b = request("a", PROMPT), request("b", PROMPT)
    start(d, a, 10)
    emit(d, a, [11, 12, 13, 14, 15])
    start(d, b, 10)  # b's context ends ...5, 10: a continued it with 11 12 13 14
    assert draft(d, b) == [11, 12, 13, 14]
    assert draft(d, b, budget=2) == [11, 12]
    emit(d, b, [11, 12, 20])  # b went its own way after 12: nothing followed ...12, 20 yet
    assert draft(d, b) == []


def test_the_most_frequent_continuation_wins_and_min_prob_stops_the_chain():
    d = SuffixDrafter(num_draft_tokens=4, min_prob=0.5, prior=0.0)
    siblings = [request(f"s{i}", PROMPT) for i in range(4)]
    for s, tail in zip(siblings, ([7, 8, 9], [7, 8, 9], [7, 8, 30], [7, 31, 32])):
        start(d, s, 6)
        emit(d, s, tail)
    probe = request("p", PROMPT)
    start(d, probe, 6)  # after 5, 6: 7 (4 of 4), then 8 (3 of 4), then 9 (2 of 3): path 1, .75, .5
    assert draft(d, probe) == [7, 8, 9]
    assert d.lookup(probe, 8)[2] == pytest.approx([1.0, 0.75, 0.5])
    d.min_prob = 0.6
    assert draft(d, probe) == [7, 8]
    d.prior, d.min_prob = 1.0, 0.0
    assert d.lookup(probe, 8)[2] == pytest.approx([1.0, 0.75, 0.5])  # greedy: the prior is not applied
    sampled = request("q", PROMPT, params=SamplingParams(max_tokens=24, temperature=1.0))
    start(d, sampled, 6)  # a sampled request: each step discounted, 4/5, 3/5, 2/4 (4 siblings continued ...5, 6)
    assert d.lookup(sampled, 8)[2] == pytest.approx([0.8, 0.8 * 0.6, 0.8 * 0.6 * 0.5])


def test_history_outlives_the_request_and_other_prompts_help_with_lower_priority():
    d = SuffixDrafter(num_draft_tokens=3, min_prob=0.0, prior=0.0)
    old = request("old", PROMPT)
    start(d, old, 40)
    emit(d, old, [41, 42, 43, 44])
    d.release(old)
    again = request("again", PROMPT)  # a later RL step (or a repeated serving request) with the same prompt
    start(d, again, 40)
    assert draft(d, again) == [41, 42, 43]
    other = request("other", [9, 9, 9])  # a different prompt: only the cross-prompt history has 42 -> 43
    start(d, other, 42)
    assert draft(d, other) == [43, 44]
    d.cross_prompt = False
    assert draft(d, other) == []


def test_memory_is_bounded():
    d = SuffixDrafter(num_draft_tokens=4, max_prompts=3, max_group_nodes=400, keep_finished=8)
    gen = torch.Generator().manual_seed(0)
    for p in range(6):
        prompt = [100 + p] * 3
        for s in range(4):
            r = request(f"{p}-{s}", prompt)
            start(d, r, 1)
            for _ in range(10):
                emit(d, r, torch.randint(0, 50, (5,), generator=gen).tolist())
                live = sum(len(out) for out in d._groups[tuple(prompt)].live.values())
                assert len(d._groups[tuple(prompt)].trie) <= max(400, 2 * (1 + d.depth * (len(prompt) + live)))
                assert len(d._groups[tuple(prompt)].finished) <= 8
            d.release(r)
    stats = d.stats()
    assert stats["prompts"] == 3 and stats["live"] == 0
    assert stats["history_nodes"] <= 400 + 51 * d.depth  # rebuilt from the newest half past 400 nodes


def total_nodes(d) -> int:
    stats = d.stats()
    return stats["nodes"] + stats["history_nodes"]


def test_a_new_prompt_is_kept_when_every_older_prompt_is_live():
    """Past max_prompts, or past max_total_nodes, with every older prompt live, eviction must not pick the prompt that
    just arrived (it used to, and on_prefill raised KeyError)."""
    d = SuffixDrafter(num_draft_tokens=4, max_prompts=1, min_prob=0.0, prior=0.0)
    a, b, b2 = request("a", PROMPT), request("b", [9, 8, 7]), request("b2", [9, 8, 7])
    start(d, a, 10)
    start(d, b, 20)
    emit(d, b, [21, 22])
    start(d, b2, 20)
    assert draft(d, b2) == [21, 22] and d.stats()["prompts"] == 2 and d.stats()["live"] == 3
    d = SuffixDrafter(num_draft_tokens=4, max_total_nodes=300, min_prob=0.0, prior=0.0)
    a, b = request("a", PROMPT), request("b", [9, 8, 7])
    start(d, a, 10)
    emit(d, a, list(range(11, 60)))  # one live prompt alone past the cap
    assert total_nodes(d) <= 300
    start(d, b, 20)
    assert total_nodes(d) <= 300 and d.stats()["prompts"] == 2 and d.stats()["live"] == 2
    emit(d, a, [60])
    assert draft(d, a) == []  # it still decodes and drafts from what is left (nothing followed ...59, 60)


def test_the_node_cap_holds_exactly_at_the_boundary():
    """depth 3 (max_match 2 + 1 draft token): prompt [1, 2, 3] and first token 4 make 10 group nodes (the root, the 6
    substrings of 1 2 3, then 4, 3 4, 2 3 4) + the history's root = 11. At a cap of 11 nothing is lost; a sibling with
    the same context adds no node; one token more (5, 4 5, 3 4 5: 14 nodes) trims the live group (to its newest 2
    context tokens per request: 9 nodes), and the sibling still drafts the 5 that followed 4."""
    d = SuffixDrafter(num_draft_tokens=1, max_match=2, max_total_nodes=11, min_prob=0.0, prior=0.0)
    a, b = request("a", [1, 2, 3]), request("b", [1, 2, 3])
    start(d, a, 4)
    trie = d._groups[(1, 2, 3)].trie
    assert total_nodes(d) == 11 and trie.find([1, 2, 3]) == 6 and trie.find([2, 3, 4]) == 9  # nodes are numbered as made
    assert trie.find([1, 2, 3, 4]) == -1 and trie.find([4, 1]) == -1  # deeper than 3; never occurred
    start(d, b, 4)
    assert total_nodes(d) == 11 and d._groups[(1, 2, 3)].trie is trie
    emit(d, a, [5])
    assert total_nodes(d) == 9 and d.stats()["live"] == 2
    assert draft(d, b) == [5]


@pytest.mark.parametrize("cap", [40, 97, 400])
def test_the_node_caps_hold_after_every_call(cap):
    """Three prompts, three samples each, interleaved, 12 random tokens a step, released in turn: after every
    on_prefill / on_verified / release the tries together hold <= max_total_nodes and each group <= max_group_nodes."""
    d = SuffixDrafter(num_draft_tokens=4, max_prompts=2, max_group_nodes=cap, max_total_nodes=cap, keep_finished=4)
    gen = torch.Generator().manual_seed(1)
    for wave in range(3):
        live = []
        for p in range(3):
            for s in range(3):
                r = request(f"{wave}-{p}-{s}", [200 + p] * 4 + [wave])
                start(d, r, int(torch.randint(0, 30, (1,), generator=gen)))
                live.append(r)
                assert total_nodes(d) <= cap
        for _ in range(4):
            for r in live:
                emit(d, r, torch.randint(0, 30, (3,), generator=gen).tolist())
                assert total_nodes(d) <= cap and all(len(g.trie) <= cap for g in d._groups.values())
                draft(d, r)
        for r in live:
            d.release(r)
            assert total_nodes(d) <= cap
    assert d.stats()["live"] == 0 and d.stats()["prompts"] <= 2


def test_greedy_identical_to_plain_decoding_under_a_tiny_node_cap(tiny_llama):
    """Trimming rebuilds the tries under running requests: their cursors stay valid and the output is plain greedy."""
    prompts = group_prompts()
    target = load_transformer(tiny_llama)
    target.pack()
    config = EngineConfig(max_batch_size=6, max_model_len=128)
    plain = [r.output_ids for r in Engine(target, config).run(prompts, [GREEDY] * 6)]
    drafter = build_drafter("suffix", target=target, num_draft_tokens=4, max_group_nodes=150, max_total_nodes=200)
    engine = Engine(target, config, drafter=drafter)
    for _ in range(2):
        assert [r.output_ids for r in engine.run(prompts, [GREEDY] * 6)] == plain
        assert total_nodes(drafter) <= 200


def test_bad_options_are_refused():
    with pytest.raises(InvalidParameterError):
        SuffixDrafter(min_prob=1.5)
    with pytest.raises(InvalidParameterError):
        SuffixDrafter(prior=-1.0)
    with pytest.raises(InvalidParameterError):
        build_drafter("suffix", num_draft_tokens=0)


def group_prompts():
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(0, 256, (6,), generator=gen).tolist()
    b = torch.randint(0, 256, (6,), generator=gen).tolist()
    return [a + a[:3]] * 3 + [b + b[:2]] * 3  # two GRPO groups of three samples


@pytest.mark.parametrize("name", ["suffix", "suffix_tree", "suffix_self"])
def test_greedy_identical_to_plain_decoding_with_groups(tiny_llama, name):
    prompts = group_prompts()
    target = load_transformer(tiny_llama)
    target.pack()
    plain = [r.output_ids for r in Engine(target, EngineConfig(max_batch_size=6, max_model_len=128)).run(prompts, [GREEDY] * 6)]
    drafter = build_drafter(name, target=target, num_draft_tokens=4, max_batch=6, max_len=128)
    engine = Engine(target, EngineConfig(max_batch_size=6, max_model_len=128), drafter=drafter)
    assert [r.output_ids for r in engine.run(prompts, [GREEDY] * 6)] == plain
    first = dataclasses.replace(engine.stats)
    assert [r.output_ids for r in engine.run(prompts, [GREEDY] * 6)] == plain
    stats = engine.stats
    # the second round drafts the first round's outputs, whole: each request fills its budgets (22, 17, 12, 7, 2 after
    # 1, 6, 11, 16, 21 tokens: 4 + 4 + 4 + 4 + 2 drafted) and every draft is accepted (5 verify steps)
    assert (stats.drafted_tokens - first.drafted_tokens, stats.accepted_tokens - first.accepted_tokens) == (6 * 18, 6 * 18)
    assert stats.request_steps - first.request_steps == 6 * 5
    assert stats.output_tokens == 12 + stats.request_steps + stats.accepted_tokens  # every verify emits accepted + 1


@pytest.mark.parametrize("name", ["suffix", "suffix_tree", "suffix_self"])
def test_sampled_output_at_temperature_one_has_the_target_distribution(small_vocab_model, name):
    """The first three tokens' joint distribution over SAMPLES seeds of one prompt (all siblings of one group, so the
    suffix drafter drafts from them) against the exact one enumerated from the model: chi-square, false failure 1e-4."""
    params = SamplingParams(temperature=1.0)
    exact = exact_distribution(load_transformer(small_vocab_model), params)
    counts, engine = sample_outputs(small_vocab_model, name, params)
    stats = engine.stats
    assert stats.drafted_tokens == stats.drafts == FIRST_STEP_DRAFTS[name]
    assert stats.request_steps == 2 * SAMPLES - stats.accepted_tokens  # accepted: done in that verify; else one more, undrafted
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # the verifies both accepted and rejected drafts (the sampled path ran)
    assert chi_square_p_value(counts, exact, SAMPLES) > FALSE_FAILURE


# Drafts of one token at each request's first verify (max_tokens 3 leaves a budget of 1 there, 0 after). suffix_self's
# int8 self-draft fills the budget wherever the suffix does not; the suffix alone drafts nothing for the 19 requests
# whose first token nothing in the group had yet been seen to follow (seeded draws: the kernel's and the torch reference's
# are the same bits, so the count is the same on every path).
FIRST_STEP_DRAFTS = {"suffix": SAMPLES - 19, "suffix_tree": SAMPLES - 19, "suffix_self": SAMPLES}


@pytest.mark.slow
def test_greedy_identity_on_smollm2_with_a_group_of_samples():
    from tandem.llm import load_tokenizer
    from tandem.models.zoo import resolve_model

    path = resolve_model("smollm2-135m")
    question = "A baker sells 14 cakes a day for 6 days. How many cakes does he sell? Think step by step, then give the answer."
    prompt = list(load_tokenizer(path).apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                           tokenize=True, return_dict=False))
    params = SamplingParams(max_tokens=48, temperature=0.0)
    target = load_transformer(path)
    target.pack()
    config = EngineConfig(max_batch_size=4, max_model_len=len(prompt) + 64)
    plain = [r.output_ids for r in Engine(target, config).run([prompt] * 4, [params] * 4)]
    engine = Engine(target, config, drafter=build_drafter("suffix", target=target, num_draft_tokens=4))
    first = [r.output_ids for r in engine.run([prompt] * 4, [params] * 4)]
    second = [r.output_ids for r in engine.run([prompt] * 4, [params] * 4)]  # drafts from the first round
    assert first == plain and second == plain
    assert engine.stats.accepted_tokens > 0


def test_serving_reuses_the_history_of_repeated_requests(tiny_llama):
    """LLM(drafter="suffix"): a repeated prompt is drafted from the earlier request's output (greedy: the same output,
    nearly all of it accepted the second time)."""
    from tandem.llm import LLM

    llm = LLM(tiny_llama, max_model_len=128, max_batch_size=2, drafter="suffix", num_draft_tokens=4)
    prompt = [7, 3, 9, 12, 40, 41, 42]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = LLM(tiny_llama, max_model_len=128, max_batch_size=2).generate([prompt], params)[0].token_ids
    first = llm.generate([prompt], params)[0]
    before = llm.engine.stats.accepted_tokens
    second = llm.generate([prompt], params)[0]
    assert first.token_ids == plain and second.token_ids == plain
    assert llm.engine.stats.accepted_tokens - before >= 24  # 31 tokens after the first, drafted 4 at a time from history
