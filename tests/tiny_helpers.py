"""Set-up shared by tests that serve random prompts on the tiny models (importable from any test dir)."""
import numpy as np
import torch
from scipy.stats import chi2

from tandem.config import EngineConfig, SamplingParams
from tandem.engine.engine import Engine
from tandem.models.loader import load_transformer
from tandem.ops.ngram import ngram_candidates, ngram_propose
from tandem.ops.tree import trie_from_sequences

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# The distribution tests' model (conftest's small_vocab_model): few enough tokens that the exact distribution of the
# first three outputs can be enumerated; their prompt repeats, so prompt lookup drafts from it.
SMALL_VOCAB = 12
SMALL_VOCAB_PROMPT = [3, 5, 7, 3, 5, 7, 3, 5]
SAMPLES = 1200  # seeds per chi-square test
FALSE_FAILURE = 1e-4  # each chi-square test's p-value threshold: its false-failure probability (fixed seeds: deterministic)


def make_prompts(n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(length),), generator=gen).tolist() for length in torch.randint(4, 20, (n,), generator=gen)]


def repetitive_prompts(n=4, seed=0):
    """Prompts with repeats, so prompt lookup finds matches: 5 random tokens, 3 more, the 5 again and their first 2."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        chunk = torch.randint(0, 256, (5,), generator=gen).tolist()
        out.append(chunk + torch.randint(0, 256, (3,), generator=gen).tolist() + chunk + chunk[:2])
    return out


def load_packed(path):
    model = load_transformer(path)
    model.pack()
    return model


def chi_square_p_value(counts: dict[tuple, int], expected_probs: dict[tuple, float], n: int) -> float:
    """Goodness of fit of n outputs (`counts`: output -> times seen) to `expected_probs` (output -> probability): one cell
    per output expected >= 5 times, the rest pooled into one more cell when that is expected >= 5 times; when it is not,
    more than 10 outputs there (mass where the target has almost none) are a clear failure (p = 0)."""
    big = [c for c in expected_probs if expected_probs[c] * n >= 5]
    rest_expected = n - sum(expected_probs[c] * n for c in big)
    rest_observed = n - sum(counts.get(c, 0) for c in big)
    stat = sum((counts.get(c, 0) - expected_probs[c] * n) ** 2 / (expected_probs[c] * n) for c in big)
    dof = len(big) - 1
    if rest_expected >= 5:
        stat += (rest_observed - rest_expected) ** 2 / rest_expected
        dof += 1
    elif rest_observed > 10:
        return 0.0
    return float(chi2.sf(stat, dof))


def plain_outputs(target, prompt_ids, params):
    """Plain greedy/sampled decoding of the prompts (target: a loaded model or a model directory)."""
    model = load_packed(target) if isinstance(target, str) else target
    return [r.output_ids for r in Engine(model, EngineConfig(max_batch_size=4, max_model_len=256)).run(prompt_ids, params)]


def first_step_drafts(drafter_name, counts: dict[tuple, int]) -> int:
    """Drafted tokens of SAMPLES requests of max_tokens 3 on SMALL_VOCAB_PROMPT (`counts`: output -> times seen): one
    token, at each request's first verify (a budget of 1 there, 0 after). Model drafters fill it; prompt lookup (chain or
    tree) drafts the token that followed the latest earlier match of the context's longest suffix (first token 3 -> 5,
    5 -> 5: the prompt ends in 5, 7 -> 3), and nothing for a token the prompt lacks."""
    if drafter_name in ("ngram", "ngram_tree"):
        return sum(n for output, n in counts.items() if output[0] in SMALL_VOCAB_PROMPT)
    return SAMPLES


def watch_added_requests(engine) -> list:
    """Observe `engine`: the returned list fills with every Request added to it, in order (for callers that hand back
    something else than the requests, such as RolloutEngine)."""
    added, add = [], engine.add_request

    def add_and_keep(*args, **kwargs):
        request_id = add(*args, **kwargs)
        added.append(engine.waiting[-1])
        return request_id

    engine.add_request = add_and_keep
    return added


def watch_decode_steps(engine) -> list:
    """Observe `engine`: the returned list fills with every request's RequestStep at every decode step, in order."""
    steps = []
    engine.observers.append(lambda record: steps.extend(record.requests) if record.kind == "decode" else None)
    return steps


def step_budgets(steps, requests) -> list[int]:
    """The draft budget of each decode step, from first principles: max_tokens - tokens emitted before it - 1, so no
    step can emit past max_tokens (its context holds the prompt and every emitted token but the pending one)."""
    by_id = {r.request_id: r for r in requests}
    return [by_id[s.request_id].params.max_tokens - (s.context_len - len(by_id[s.request_id].prompt_ids) + 1) - 1 for s in steps]


def assert_full_budget_accounting(engine, steps, requests, nodes):
    """For a drafter that fills every budget up to `nodes` nodes (model drafters: an untrained head has no confidence
    cut): the engine drafted exactly that at every step and counted it, and every verify emitted accepted + 1 tokens
    (ignore_eos: no stop cuts a step short). Holds whatever the model's bits are."""
    budgets = step_budgets(steps, requests)
    assert [len(s.draft_tokens) for s in steps] == [min(nodes, b) for b in budgets]
    assert engine.stats.drafted_tokens == sum(min(nodes, b) for b in budgets)
    assert engine.stats.output_tokens == len(requests) + engine.stats.request_steps + engine.stats.accepted_tokens


def chain(tokens: list[int]) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a chain."""
    return list(tokens), list(range(-1, len(tokens) - 1))


def ngram_chain(context, budget: int, _drafted=None, k: int = 4) -> tuple[list[int], list[int]]:
    """What the ngram drafter (k tokens, suffixes of 1..4 tokens) drafts from a context within a budget, written with
    the op it is made of (a replay for assert_replayed_drafts)."""
    return chain(ngram_propose(context, 1, 4, min(k, budget)))


def ngram_trie(context, budget: int, _drafted=None, k: int = 4) -> tuple[list[int], list[int]]:
    """What the ngram_tree drafter (3 continuations of k tokens merged into a trie of at most 2k + 2 nodes) drafts from
    a context within a budget, written with the ops it is made of (a replay for assert_replayed_drafts)."""
    return trie_from_sequences(ngram_candidates(context, 1, 4, min(k, budget), 3), min(2 * k + 2, budget))


def assert_replayed_drafts(engine, steps, requests, replay):
    """For a drafter whose draft is a function of the context: replay(context [L] ids up to and with the pending token,
    budget, the step's drafted tokens: for a draft part of which a model made) gives the (tokens, parents) drafted at
    every step, the engine counted them, and every verify emitted accepted + 1 tokens. Holds whatever the model's bits
    are (the contexts are the ones the run produced)."""
    by_id = {r.request_id: r for r in requests}
    contexts = [np.asarray(by_id[s.request_id].all_ids[: s.context_len + 1]) for s in steps]
    want = [replay(context, budget, s.draft_tokens) for context, budget, s in zip(contexts, step_budgets(steps, requests), steps)]
    assert [(s.draft_tokens, s.draft_parents) for s in steps] == [(list(t), list(p)) for t, p in want]
    assert engine.stats.drafted_tokens == sum(len(t) for t, _ in want)
    assert engine.stats.output_tokens == len(requests) + engine.stats.request_steps + engine.stats.accepted_tokens


def assert_greedy_verdicts(steps, requests):
    """Greedy verification of chains and tries (siblings draft different tokens), step by step against the output: a
    step accepts the path from the root down the nodes whose tokens the output continues with, and emits the output's
    next len(path) + 1 tokens."""
    by_id = {r.request_id: r for r in requests}
    for s in steps:
        request = by_id[s.request_id]
        done = s.context_len - len(request.prompt_ids) + 1  # tokens emitted before the step
        following = request.output_ids[done : done + len(s.draft_tokens) + 1]
        path = []
        while len(path) < len(following) - 1:
            parent = path[-1] if path else -1
            node = next((i for i, (t, p) in enumerate(zip(s.draft_tokens, s.draft_parents)) if p == parent and t == following[len(path)]), None)
            if node is None:
                break
            path.append(node)
        assert (s.accepted_nodes, s.emitted_tokens) == (path, following[: len(path) + 1])
