"""`tandem bench decode`'s command line: its options and the DecodeBenchConfig they build (the bench itself:
decode.py)."""
from __future__ import annotations

import json
from pathlib import Path

from tandem.errors import InvalidParameterError


def add_bench_decode_command(bench) -> None:
    p = bench.add_parser("decode", help="speculative decoding per drafter and domain (optionally vs peers: HF, onnxruntime-genai, llama.cpp)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafters", default="ar,ngram,self_draft", help="comma list; ar = plain decoding; NAME@W (W = bf16, int8, int4) runs on the target with W weights (needs ar@W)")
    p.add_argument("--prompts", default="builtin", help="builtin or a JSONL file of {domain, prompt}")
    p.add_argument("--per-domain", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--adaptive-k", action="store_true")
    p.add_argument("--drafter-model", default=None)
    p.add_argument("--drafter-path", default=None, help="a head directory, or eagle=DIR,mtp=DIR")
    p.add_argument("--peers", default="", help="comma list: hf (HF transformers), ortg (onnxruntime-genai plain + n-gram), "
                   "llama (llama.cpp: --llama-modes); ortg and llama run in child processes")
    p.add_argument("--rounds", type=int, default=1, help="passes over the prompts; each runner's rate per round and their spread")
    p.add_argument("--weights", default="fp32", choices=("fp32", "bf16", "int8", "int4"),
                   help="serve the base target with these weights: ar (and every runner without @W) is then that model")
    p.add_argument("--ortg-python", default=None, help="Python that has onnxruntime-genai (default: the peer harness's venv under $TANDEM_BENCH_CACHE)")
    p.add_argument("--ortg-model", default=None, help="onnxruntime-genai model dir (default: the peer harness's SmolLM2 fp32 export)")
    from tandem.bench.peers.llama_peer import add_llama_options

    add_llama_options(p)
    p.add_argument("--no-pack", action="store_true", help="don't prepack target weights (halves memory, slower)")
    p.add_argument("--compile", action="store_true", help="every runner on the compiled decode / verify forward (compiles each shape once)")
    p.add_argument("--tree", default=None, help="NODES,TOPK,DEPTH of the eagle_tree* drafters' dynamic trees (default 12,3,5)")
    p.add_argument("--min-confidence", type=float, default=None,
                   help="eagle chains (and eagle_ngram's) end below this path confidence; 0: full chains (default: 0.08 for a trained head)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_bench_decode)


def _bench_decode(args) -> int:
    import torch

    from tandem.bench.speculation.decode import DecodeBenchConfig, run_decode_bench
    from tandem.bench.peers.llama_peer import llama_options

    torch.set_num_threads(args.threads)
    config = DecodeBenchConfig(
        model=args.model, drafters=tuple(d for d in args.drafters.split(",") if d), prompts=args.prompts,
        per_domain=args.per_domain, max_tokens=args.max_tokens, batch_size=args.batch_size,
        num_draft_tokens=args.num_draft_tokens, adaptive_k=args.adaptive_k, drafter_model=args.drafter_model,
        drafter_path=args.drafter_path, peers=tuple(p for p in args.peers.split(",") if p), pack_weights=not args.no_pack,
        ortg_python=args.ortg_python, ortg_model=args.ortg_model, weights=args.weights,
        rounds=args.rounds, **llama_options(args),
        compile=args.compile, tree=_int_triple(args.tree, "--tree"), min_confidence=args.min_confidence,
    )
    result = run_decode_bench(config)
    text = json.dumps(result, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(text)
    return 0


def _int_triple(text: str | None, flag: str) -> tuple[int, int, int] | None:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise InvalidParameterError(f"{flag} takes three integers, e.g. 24,4,6; got {text!r}") from None
    if len(values) != 3:
        raise InvalidParameterError(f"{flag} takes three integers, e.g. 24,4,6; got {text!r}")
    return values
