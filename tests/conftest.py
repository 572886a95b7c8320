import os

import pytest
import torch

from tandem.models.tiny import make_tiny_model

ARCHS = ("llama", "qwen2", "qwen3")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("TANDEM_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: use --runslow or TANDEM_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    """One seeded tiny random HF-format model per architecture."""
    return {arch: str(make_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=1)) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_dirs) -> str:
    return tiny_dirs["llama"]


@pytest.fixture(scope="session")
def small_vocab_model(tmp_path_factory) -> str:
    """The distribution tests' tiny llama of SMALL_VOCAB tokens."""
    from tiny_helpers import SMALL_VOCAB  # here, not at the top: every test loads this file, few need the helpers

    return str(make_tiny_model(tmp_path_factory.mktemp("v12"), "llama", seed=11, vocab_size=SMALL_VOCAB))
