"""onnxruntime-genai as a peer of `tandem bench decode`, in its own process (its own Python and venv).

onnxruntime-genai is not a tandem dependency, and two thread pools in one process spin-wait against each other,
so the peer runs here, in the interpreter that has it (e.g. the peer harness's venv), and is driven over stdin /
stdout: one JSON line per request, {"ids": [...], "max_tokens": N, "mode": "plain" | "ngram"}, answered by
{"token_ids": [...]} (or {"error": "..."}). While it waits for the next line its threads sleep, so tandem's
runners and this one take turns on the same cores, prompt by prompt. Greedy, batch 1; n-gram mode uses the
options of ../shared/peers (3-grams, <= 10 draft tokens). Imports nothing from tandem.
"""
import argparse
import json
import sys

MODES = {"plain": None, "ngram": {"ngram_size": 3, "max_draft_tokens": 10}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="an onnxruntime-genai model directory (genai_config.json)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eos", default="", help="comma list of EOS ids: an early stop's EOS is put back, as tandem emits it")
    a = p.parse_args()
    import numpy as np
    import onnxruntime_genai as og

    cfg = og.Config(a.model)
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": a.threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(cfg)
    eos = [int(e) for e in a.eos.split(",") if e]
    print(json.dumps({"ready": og.__version__}), flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            ids, max_tokens, spec = request["ids"], int(request["max_tokens"]), MODES[request["mode"]]
            params = og.GeneratorParams(model)
            params.set_search_options(do_sample=False, max_length=len(ids) + max_tokens)
            if spec:
                params.set_speculative_options(**spec)
            generator = og.Generator(model, params)
            generator.append_tokens(np.array([ids], dtype=np.int32))
            while not generator.is_done():
                generator.generate_next_token()
            out = [int(t) for t in generator.get_sequence(0)][len(ids):]
            cut = next((i + 1 for i, t in enumerate(out) if t in eos), None)
            out = out[:cut] if cut else out
            if eos and len(out) < max_tokens and (not out or out[-1] not in eos):
                out.append(eos[0])  # it stopped on an EOS it does not return
            reply = {"token_ids": out[:max_tokens]}
        except Exception as error:  # one bad request must not end the peer
            reply = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
