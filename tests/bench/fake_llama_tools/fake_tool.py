"""Stands in for llama.cpp's C++ tools in tests (tests/bench/test_llama_tools.py): `fake_tool.py TOOL ARGS...` prints
TOOL's output as llama-cpp-python 0.3.36's llama.cpp prints it (TOOL.stdout and TOOL.stderr here; TOOL.prompt: the
prompt of that output), with the prompt it is given (-p) in place of that one, and appends its argv as a JSON line to
$FAKE_LLAMA_ARGV when set. The outputs are real: captured by `capture.sh` here (2026-12-06, the 0.5B's shipped
Q4_K_M GGUF as target and draft, 24 tokens, 2 threads, `nice -n 19` on a loaded 2-vCPU Zen 4: the rates are not figures).
`llama-tokenize` prints the byte values of its -p text
(the tests' byte tokenizer), shifted by one for a GGUF whose name contains "other" (another vocabulary). A GGUF whose
name contains "broken" makes every tool fail as a tool does: a message on stderr, exit code 1. `--version` prints a
build's version lines."""
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> int:
    tool, args = sys.argv[1], sys.argv[2:]
    if os.environ.get("FAKE_LLAMA_ARGV"):
        with open(os.environ["FAKE_LLAMA_ARGV"], "a", encoding="utf-8") as log:
            log.write(json.dumps([tool, *args]) + "\n")
    if args == ["--version"]:
        print("version: 1 (0c1e570)\nbuilt with GNU 12.2.0 for Linux x86_64", file=sys.stderr)
        return 0
    gguf, prompt = args[args.index("-m") + 1], args[args.index("-p") + 1]
    if "broken" in gguf:
        print(f"llama_model_load: error loading model: failed to open {gguf}", file=sys.stderr)
        return 1
    if tool == "llama-tokenize":
        shift = 1 if "other" in os.path.basename(gguf) else 0
        print("[" + ", ".join(str(b + shift) for b in prompt.encode()) + "]")
        return 0
    captured = (HERE / f"{tool}.prompt").read_text(encoding="utf-8")
    stdout = (HERE / f"{tool}.stdout").read_text(encoding="utf-8")
    sys.stdout.write(stdout.replace(captured, prompt, 1))
    sys.stderr.write((HERE / f"{tool}.stderr").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
