"""llama.cpp (llama-cpp-python) as a peer of `tandem bench decode` and `bench quality`, in its own process (its own
Python and venv).

llama-cpp-python is not a tandem dependency, and two thread pools in one process spin-wait against each other, so the
peer runs here, in the interpreter that has it (the peer harness's venv), driven over stdin / stdout like
ortg_worker.py: one JSON line per request, answered by one JSON line.

  {"ids": [...], "max_tokens": N, "mode": "plain" | "pld" | "draft"}  ->  {"token_ids": [...], "metrics": {...} | null}
  {"tokenize": "text"}                                                  ->  {"token_ids": [...]}  (the GGUF's own tokenizer)
  {"score": [ids]}  (needs --score)                                     ->  {"logprobs": [...], "argmax": [...]}
      teacher-forced: position t's log-prob of ids[t + 1] and its argmax, t < len(ids) - 1 (`tandem bench quality`)
  anything that fails                                                   ->  {"error": "..."}

Modes, each its own `Llama` over the same GGUF (mmap'd once by the OS), greedy (temp 0, top-k 1, no repeat penalty),
the KV cache reset before each prompt (no prefix reuse across prompts): `plain`; `pld`, llama-cpp-python's
`LlamaPromptLookupDecoding` (max_ngram_size 2, num_pred_tokens --num-pred-tokens); `draft`, a smaller GGUF drafting
--draft-tokens tokens greedily through the same `LlamaDraftModel` interface (llama-cpp-python ships no model drafter:
`DraftLlama` below is one, reusing its KV prefix between calls through `Llama.generate`'s prefix match). With a
draft model llama-cpp-python computes the logits of every evaluated token (its `logits_all`), the prompt's included.
`score` reads the ids in one eval (chunks of n_batch) on a `Llama(logits_all=True)` of its own (the `plain` one keeps
llama.cpp's last-token-only logits, so its greedy decoding is the same as without --score) and log-softmaxes the logits
in numpy, fp64; more ids than --n-ctx are refused. Generation stops after an EOS id (returned, as tandem returns it) or
max_tokens. Speculative modes report {"steps", "drafted_tokens", "accepted_tokens", "draft_time_s", "mean_draft_length"}
counted in the token loop.

`--quantize SRC DST` instead writes a Q8_0 copy of a GGUF (llama.cpp's llama_model_quantize, requantizing: each
tensor is dequantized to fp32 and quantized again) and exits. Imports nothing from tandem.
"""
import argparse
import json
import sys
import time

GREEDY = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 14: "Q4_K_S", 15: "Q4_K_M", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


class Counter:
    """Acceptance of one request: each draft call is a verify round; a yielded token equal to the next drafted one is accepted."""

    def __init__(self):
        self.steps = self.drafted = self.accepted = 0
        self.draft_s = 0.0
        self.draft, self.j = [], 0

    def drafted_now(self, tokens, seconds: float) -> None:
        self.steps += 1
        self.drafted += len(tokens)
        self.draft_s += seconds
        self.draft, self.j = [int(t) for t in tokens], 0

    def emitted(self, token: int) -> None:
        if self.j < len(self.draft) and token == self.draft[self.j]:
            self.accepted += 1
            self.j += 1
        else:
            self.j = len(self.draft)  # the round's correction (or bonus) token ends it

    def metrics(self) -> dict:
        return {"steps": self.steps, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "draft_time_s": self.draft_s, "mean_draft_length": self.drafted / self.steps if self.steps else 0.0}


def counting(draft_model, state: dict):
    """Wraps a LlamaDraftModel: times each call and tells the current request's Counter what it proposed."""
    def call(input_ids, **kwargs):
        t = time.perf_counter()
        tokens = draft_model(input_ids, **kwargs)
        state["counter"].drafted_now(tokens, time.perf_counter() - t)
        return tokens
    return call


def draft_llama_class():
    import numpy as np
    from llama_cpp.llama_speculative import LlamaDraftModel

    class DraftLlama(LlamaDraftModel):
        """A smaller Llama drafting `k` greedy tokens (stopping at an EOS) after the target's tokens so far."""

        def __init__(self, llm, k: int, eos: set):
            self.llm, self.k, self.eos = llm, k, eos

        def __call__(self, input_ids, **kwargs):
            out = []
            for token in self.llm.generate(list(input_ids), reset=True, **GREEDY):  # reuses its KV prefix
                out.append(int(token))
                if len(out) >= self.k or out[-1] in self.eos:
                    break
            return np.array(out, dtype=np.intc)

    return DraftLlama


def generate(llm, ids: list, max_tokens: int, eos: set, counter) -> list:
    llm.reset()  # no KV prefix reuse across prompts (tandem's runners reuse none either)
    out = []
    for token in llm.generate(ids, reset=True, **GREEDY):
        token = int(token)
        if counter is not None:
            counter.emitted(token)
        out.append(token)
        if token in eos or len(out) >= max_tokens:
            break
    return out


def score(llm, ids: list, n_ctx: int) -> dict:
    """Teacher-forced: one eval of `ids` from an empty KV cache, every position's logits kept (`logits_all`)."""
    import numpy as np

    if not 2 <= len(ids) <= n_ctx:
        raise ValueError(f"score needs 2 to n_ctx = {n_ctx} token ids, got {len(ids)} (start the worker with a larger --n-ctx)")
    if min(ids) < 0 or max(ids) >= llm.n_vocab():
        raise ValueError(f"score: token ids must be in [0, {llm.n_vocab()})")
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)  # row t: the logits after ids[: t + 1]
    shifted = logits - logits.max(axis=1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    following = np.asarray(ids[1:])
    return {"logprobs": logprobs[np.arange(len(following)), following].tolist(), "argmax": logprobs.argmax(axis=1).tolist()}


def build(a, eos: set) -> tuple[dict, dict, dict]:
    """The Llama of each mode, the shared request state, and what the ready line reports."""
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    state = {"counter": None, "draft_llm": None, "score_llm": None}
    common = {"n_ctx": a.n_ctx, "n_threads": a.threads, "n_threads_batch": a.threads, "n_batch": 512, "seed": 0, "verbose": False}
    modes = {"plain": Llama(model_path=a.gguf, **common)}
    if a.num_pred_tokens > 0:
        pld = LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=a.num_pred_tokens)
        modes["pld"] = Llama(model_path=a.gguf, draft_model=counting(pld, state), **common)
    if a.score:
        state["score_llm"] = Llama(model_path=a.gguf, logits_all=True, **common)
    if a.draft_gguf:
        state["draft_llm"] = Llama(model_path=a.draft_gguf, **common)
        drafter = draft_llama_class()(state["draft_llm"], a.draft_tokens, eos)
        modes["draft"] = Llama(model_path=a.gguf, draft_model=counting(drafter, state), **common)
    plain = modes["plain"]
    info = {"ready": f"llama-cpp-python {llama_cpp.__version__}", "file_type": FILE_TYPES.get(llama_cpp.llama_model_ftype(plain.model), "other"),
            "n_vocab": plain.n_vocab(), "eos": plain.token_eos(), "modes": sorted(modes), "score": a.score,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    if state["draft_llm"] is not None:
        info["draft_file_type"] = FILE_TYPES.get(llama_cpp.llama_model_ftype(state["draft_llm"].model), "other")
    return modes, state, info


def answer(request: dict, modes: dict, state: dict, eos: set, n_ctx: int) -> dict:
    if "tokenize" in request:
        return {"token_ids": modes["plain"].tokenize(request["tokenize"].encode(), add_bos=False, special=False)}
    if "score" in request:
        if state["score_llm"] is None:
            raise ValueError("score: this worker was started without --score")
        return score(state["score_llm"], [int(i) for i in request["score"]], n_ctx)
    mode = request["mode"]
    if mode not in modes:
        raise ValueError(f"mode {mode!r} not loaded; this worker has {sorted(modes)}")
    counter = None if mode == "plain" else Counter()
    state["counter"] = counter
    if mode == "draft":
        state["draft_llm"].reset()  # the draft model starts each prompt fresh too
    out = generate(modes[mode], [int(i) for i in request["ids"]], int(request["max_tokens"]), eos, counter)
    return {"token_ids": out, "metrics": None if counter is None else counter.metrics()}


def quantize_q8_0(src: str, dst: str, threads: int) -> int:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread, params.ftype, params.allow_requantize = threads, llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, True
    return int(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gguf", help="the target's GGUF")
    p.add_argument("--draft-gguf", default=None, help="a smaller GGUF for the draft mode (same vocabulary)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--eos", default="", help="comma list of EOS ids (generation stops after one, which is returned)")
    p.add_argument("--num-pred-tokens", type=int, default=10, help="pld mode's num_pred_tokens (0: no pld mode)")
    p.add_argument("--draft-tokens", type=int, default=4, help="tokens the draft model proposes per round")
    p.add_argument("--score", action="store_true", help="load a logits_all Llama for score requests")
    p.add_argument("--quantize", nargs=2, metavar=("SRC", "DST"), help="write a Q8_0 copy of SRC to DST and exit")
    a = p.parse_args()
    if a.quantize:
        return quantize_q8_0(*a.quantize, a.threads)
    if not a.gguf:
        p.error("--gguf is required")
    eos = {int(e) for e in a.eos.split(",") if e}
    modes, state, info = build(a, eos)
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        try:
            reply = answer(json.loads(line), modes, state, eos, a.n_ctx)
        except Exception as error:  # one bad request must not end the peer
            reply = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
