"""tandem.heap: a training process's large tensors reuse freed memory (measured in fresh processes: the setting is
process-wide)."""
import json
import subprocess
import sys

import pytest

PROBE = """
import json, resource, sys, torch
from tandem.heap import reuse_freed_memory
applied = reuse_freed_memory() if sys.argv[1] == "reuse" else None
x = torch.empty(730, 16384); x.fill_(1.0); del x  # one step's logits (48 MB), allocated and freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.empty(730, 16384); x.fill_(1.0)  # the next step's
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _second_allocation(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_next_steps_tensor_reuses_the_freed_pages():
    """By default glibc maps a fresh 48 MB block and the kernel faults in (and zeroes) each of its pages again; with
    reuse_freed_memory the block comes back from the heap and touching it faults (almost) nothing."""
    reused = _second_allocation("reuse")
    if not reused["applied"]:
        pytest.skip("not glibc: no mallopt")
    default = _second_allocation("default")
    pages = 730 * 16384 * 4 // 4096
    assert default["faults"] >= 0.5 * pages or default["faults"] >= 20  # fresh pages (fewer with transparent huge pages)
    assert reused["faults"] <= 0.05 * max(default["faults"], 1) + 5
