"""The server-vs-engine benchmark on SmolLM2: both sides decode the same prompts greedily to the same tokens."""
import json

import pytest

from tandem.bench.serving.server_gap import main


@pytest.mark.slow
def test_server_and_engine_produce_the_same_tokens(tmp_path):
    out = tmp_path / "gap.json"
    assert main(["--num-prompts", "3", "--max-tokens", "8", "--threads", "1", "--rounds", "1", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["rounds"]
    assert row["server"]["failed"] == 0
    assert row["server"]["output_tokens"] == row["engine"]["output_tokens"] == 3 * 8  # greedy, the same prompts; no EOS within 8
