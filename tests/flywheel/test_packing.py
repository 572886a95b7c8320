"""Traces packed end to end give each trace what its own unroll gives (tandem.flywheel.packing)."""
import pytest
import torch

from tandem.flywheel.objective import generated_roots, trace_example
from tandem.flywheel.packing import pack_layout, packed_unroll
from tandem.training.offline import eagle_states

from flywheel_helpers import eagle_engine, served_traces

UNROLL = 3


@pytest.fixture(scope="module")
def served(target):
    engine = eagle_engine(target)
    return engine.drafter.head.eval(), served_traces(target, n=4, seed=3, engine=engine)


def _roots(trace, every: int):
    first = generated_roots(trace)
    return first, first[::every].contiguous()  # step-0 roots, a sample of chains (increasing)


def test_the_layout_keeps_each_trace_in_its_own_block():
    """Three examples of 4, 2 and 3 tokens at unroll 3: each block is its t = L - 1 entries plus 2 padding entries;
    ids are x_1 .. x_t, positions restart at 0, padding has id 0 and zero features."""
    from tandem.training.offline import Example

    def example(tokens):
        n = len(tokens)
        return Example(torch.tensor(tokens), torch.full((n, 3), float(tokens[0])), torch.zeros(n, 1), torch.zeros(n, dtype=torch.long), 1)

    offsets, ids, taps, segment, positions = pack_layout([example([5, 6, 7, 8]), example([9, 10]), example([11, 12, 13])], UNROLL)
    assert offsets == [0, 5, 8]
    assert ids[0].tolist() == [6, 7, 8, 0, 0, 10, 0, 0, 12, 13, 0, 0]
    assert segment.tolist() == [0] * 5 + [1] * 3 + [2] * 4
    assert positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    assert taps[0, :, 0].tolist() == [5, 5, 5, 0, 0, 9, 0, 0, 11, 11, 0, 0]


@torch.no_grad()
def test_packed_unroll_equals_each_trace_alone(served):
    """Every trace's step-0 states at its generated roots and its chains' states at steps 1 and 2 equal those of its
    own unroll (eagle_states on that trace alone), and its slice of the packed step-0 keys equals its own."""
    head, traces = served
    examples = [trace_example(t) for t in traces]
    roots = [_roots(t, 3) for t in traces]
    packed = packed_unroll(head, examples, UNROLL, [c for _, c in roots], [f for f, _ in roots])
    for i, (example, (first, chain)) in enumerate(zip(examples, roots)):
        alone, _, (keys, values) = eagle_states(head, [example], UNROLL, chain, first, project=False)
        assert [h.shape for h in packed.hidden[i]] == [h.shape for h in alone]
        for got, want in zip(packed.hidden[i], alone):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        o, t = packed.offsets[i], keys.shape[2]
        torch.testing.assert_close(packed.context[0][:, :, o : o + t], keys, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_without_the_segment_mask_a_trace_would_see_the_one_before(served):
    """The negative control: the same packed entries with attention causal over the whole packing (no segment) change
    the second trace's states, so the equality above depends on the mask."""
    from tandem.models.eagle_train import unroll_states

    head, traces = served
    examples = [trace_example(t) for t in traces[:2]]
    roots = [_roots(t, 3) for t in traces[:2]]
    offsets, ids, taps, segment, positions = pack_layout(examples, UNROLL)
    first = torch.cat([f + o for (f, _), o in zip(roots, offsets)])
    chain = torch.cat([c + o for (_, c), o in zip(roots, offsets)])
    masked, _ = unroll_states(head, ids, head.fuse([taps]), UNROLL, chain, first, project=False, segment=segment, positions=positions)
    leaky, _ = unroll_states(head, ids, head.fuse([taps]), UNROLL, chain, first, project=False, positions=positions)
    n0 = len(roots[0][0])
    torch.testing.assert_close(leaky[0][:, :n0], masked[0][:, :n0])  # the first trace has nothing before it
    assert (leaky[0][:, n0:] - masked[0][:, n0:]).abs().max() > 1e-3
