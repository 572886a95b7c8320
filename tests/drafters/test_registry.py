"""The drafter registry: a drafter is named by the name it was built under (calibration costs and the controller key on it)."""
import pytest

from tandem.drafters import build_drafter
from tandem.drafters.base import registered
from tandem.errors import InvalidParameterError


@pytest.mark.parametrize("name", ["ngram", "ngram_tree", "suffix", "suffix_tree"])
def test_a_model_free_drafter_carries_its_registry_name(name):
    assert build_drafter(name, num_draft_tokens=4).name == name


def test_tree_variants_are_told_apart_from_their_chains():
    """ngram_tree used to call itself `ngram`: a calibrated ngram_tree cost was stored under a name the controller never
    looked up, and a tree's cost could be taken for the chain's."""
    assert build_drafter("ngram_tree", num_draft_tokens=4).name != build_drafter("ngram", num_draft_tokens=4).name


def test_every_registered_name_is_listed_and_unknown_names_are_refused():
    assert {"ngram", "ngram_tree", "suffix", "suffix_tree", "self_draft", "self_draft_int4", "draft_model", "draft_model_int4",
            "draft_model_int8", "eagle", "eagle_tree"} <= set(registered())
    with pytest.raises(InvalidParameterError, match="unknown drafter 'ngramm'"):
        build_drafter("ngramm")
