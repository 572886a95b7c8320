"""The ngram / ngram_tree drafters on contexts whose drafts are worked out by hand."""
from tandem.drafters import build_drafter

CONTEXT = [3, 5, 7, 3, 5, 7, 3, 5, 5]  # the suffix 5 occurred at 7, 4 and 1, followed by 5, then 7 3 5 5, then 7 3 5 7


class Context:
    """A DraftContext stand-in: prompt lookup reads the request's ids alone."""

    def __init__(self, all_ids):
        self.all_ids = all_ids


def draft(name, all_ids, budget):
    tree = build_drafter(name, num_draft_tokens=4).propose([Context(all_ids)], [budget])[0]
    return tree.tokens.tolist(), tree.parents.tolist()


def test_a_chain_continues_the_most_recent_longest_match():
    assert draft("ngram", CONTEXT, 8) == ([5], [-1])  # the match at 7 is followed by the last token alone
    assert draft("ngram", [3, 5, 7, 3, 5, 7, 3, 5, 7], 8) == ([3, 5, 7], [-1, 0, 1])  # 7 3 5 7 matched at 2
    assert draft("ngram", [3, 5, 7, 3, 5, 7, 3, 5, 7], 2) == ([3, 5], [-1, 0])
    assert draft("ngram", [3, 5, 7, 9], 8) == ([], [])  # 9 never occurred before


def test_a_tree_merges_the_continuations_of_every_match():
    assert draft("ngram_tree", CONTEXT, 10) == ([5, 7, 3, 5, 5, 7], [-1, -1, 1, 2, 3, 3])


def test_a_tree_never_has_more_nodes_than_its_budget():
    """The budget counts nodes, as for every drafter (the engine's max_tokens room, the controller's draft shapes):
    3 nodes are 5 and 7 3 (the continuations cut to depth 3 are 5 and 7 3 5), not the 4 nodes of both whole."""
    assert draft("ngram_tree", CONTEXT, 3) == ([5, 7, 3], [-1, -1, 1])
    assert draft("ngram_tree", CONTEXT, 1) == ([5], [-1])
    assert draft("ngram_tree", CONTEXT, 0) == ([], [])
