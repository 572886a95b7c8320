import pytest

from flywheel_helpers import load_target


@pytest.fixture(scope="module")
def target(tiny_llama):
    return load_target(tiny_llama)
