#!/usr/bin/env bash
# Replace the fixtures here with real outputs of a build (`tandem peers setup llama-cpp`): the 0.5B's shipped GGUF as
# target (and draft), 24 tokens, 2 threads, the prompt in llama-completion.prompt. Then update the figures that
# tests/bench/test_llama_tools.py expects from them (REAL there).
#   tests/bench/fake_llama_tools/capture.sh [BIN_DIR] [GGUF]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN="${1:-${TANDEM_HOME:-$HOME/.cache/tandem}/peers/llama.cpp-0.3.36/build/bin}"
GGUF="${2:-${TANDEM_BENCH_CACHE:-$HOME/.cache/tandem-peers}/models/gguf_zoo/qwen2.5-coder-0.5b.gguf}"
PROMPT="$(cat "$HERE/llama-completion.prompt"; printf x)"
PROMPT="${PROMPT%x}"  # keep the trailing newline
COMMON=(-m "$GGUF" -p "$PROMPT" --no-escape -n 24 -c 512 -t 2 -tb 2 --temp 0 --seed 0)
run() {  # run TOOL ARGS...: TOOL.stdout, TOOL.stderr, TOOL.prompt
  local tool=$1
  shift
  "$BIN/$tool" "${COMMON[@]}" "$@" >"$HERE/$tool.stdout" 2>"$HERE/$tool.stderr"
  printf '%s' "$PROMPT" >"$HERE/$tool.prompt"
}
run llama-completion -no-cnv --no-display-prompt
run llama-speculative-simple --spec-type draft-simple --spec-draft-n-max 8 -md "$GGUF" --spec-draft-n-min 0 --spec-draft-p-min 0.75 -td 2 -tbd 2
run llama-lookup --spec-draft-n-max 8
