"""What a cluster benchmark writes at the end: its arguments, its figures, when and under what load; printed and
optionally saved as JSON (`--json`)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


def write_result(command: str, args, figures: dict) -> dict:
    """`figures` between the command with its arguments and the time and load average; printed, and written
    to `args.json` when that is set. Returns the whole record."""
    out = {"command": command, "args": {k: v for k, v in vars(args).items() if k != "func"}, **figures,
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average": [round(x, 2) for x in os.getloadavg()]}
    text = json.dumps(out, indent=1)
    print(text, flush=True)
    if getattr(args, "json", None):
        Path(args.json).write_text(text + "\n")
    return out
