"""`tandem serve`: parse -> ServerConfig -> serve (imports nothing heavy until the command runs)."""
from __future__ import annotations

import argparse
import os


def add_serve_command(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    p.add_argument("--model", default="smollm2-135m", help="zoo name or local HF-format directory")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--drafter", default=None, help="ngram | draft_model | self_draft | eagle | mtp (default: none)")
    p.add_argument("--drafter-path", default=None, help="eagle/mtp: directory of a trained head")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="the most a request drafts in a step")
    p.add_argument("--fixed-k", action="store_true", help="draft --num-draft-tokens every step (default: the speculation controller picks "
                   "each step's draft shape, plain included, by measured tokens/s; /metrics shows its choices)")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="eagle without --drafter-path: the day-0 head's draft vocabulary")
    p.add_argument("--online", action="store_true", help="the flywheel: train the eagle head on live traffic and hot-swap it")
    p.add_argument("--state-dir", default=None, help="checkpoints, traces, drafter versions; resumed on start (default with --online: $TANDEM_HOME/serve/MODEL)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"), help="require `Authorization: Bearer KEY` on /v1 (env TANDEM_API_KEY)")
    p.add_argument("--admin-key", default=os.environ.get("TANDEM_ADMIN_KEY"), help="enable /admin routes behind this key (env TANDEM_ADMIN_KEY)")
    p.add_argument("--max-batch-size", type=int, default=None, help="requests decoded together (default: as many KV rows as --kv-cache-memory holds, <= 64)")
    p.add_argument("--max-queue", type=int, default=None, help="requests queued beyond the running batch; more get 429 (default: 4 x max batch)")
    p.add_argument("--kv-cache-memory", type=float, default=None, help="GiB of KV cache that size the default batch (default: a quarter of RAM, <= 8)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may run before it is aborted (408); 0 = none")
    p.add_argument("--queue-timeout", type=float, default=60.0, help="seconds a request may wait for a batch row (503 queue_timeout); 0 = none")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="on SIGTERM/SIGINT: seconds requests in flight get to finish (0: stop at once)")
    p.add_argument("--no-spill", action="store_true", help="--online: keep traces in memory only (no Parquet under the state dir)")
    p.add_argument("--spill-max-gb", type=float, default=2.0, help="--online: spilled traces kept on disk, oldest deleted beyond (GiB)")
    p.add_argument("--spill-max-age-hours", type=float, default=168.0, help="--online: spilled traces older than this are deleted")
    p.add_argument("--trainer-process", action="store_true", help="--online: train in a child process, not a thread of the server")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="json: one JSON object per line, with request ids")
    p.add_argument("--prefill-tokens-per-step", type=int, default=None, help="prompt tokens prefilled per engine step (vLLM's "
                   "max-num-batched-tokens, for prompts): more admits a burst sooner, fewer keeps running requests' steps short")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--publish-every", type=int, default=None, help="--online: trainer steps per published drafter version")
    p.add_argument("--checkpoint-every", type=int, default=100, help="--online: trainer steps between checkpoints (one more at shutdown)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from tandem.server.app import serve

    serve(config_from_args(args), args.log_level)
    return 0


def config_from_args(args: argparse.Namespace):
    """The ServerConfig `tandem serve` runs (also the Ray path's, tandem.cluster.cli)."""
    from tandem.server.runtime import ServerConfig

    return ServerConfig(
        model=args.model, served_model_name=args.served_model_name, drafter=args.drafter, drafter_path=args.drafter_path,
        num_draft_tokens=args.num_draft_tokens, adaptive_k=not args.fixed_k, draft_vocab_size=args.draft_vocab_size, online=args.online, state_dir=args.state_dir, host=args.host, port=args.port,
        api_key=args.api_key, admin_key=args.admin_key, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
        max_model_len=args.max_model_len, max_body_bytes=args.max_body_bytes, threads=args.threads,
        publish_every=args.publish_every, checkpoint_every=args.checkpoint_every,
        kv_cache_bytes=None if args.kv_cache_memory is None else int(args.kv_cache_memory * (1 << 30)),
        request_timeout_s=args.request_timeout or None, queue_timeout_s=args.queue_timeout or None, drain_timeout_s=args.drain_timeout,
        spill_traces=not args.no_spill, spill_max_bytes=int(args.spill_max_gb * (1 << 30)), spill_max_age_s=args.spill_max_age_hours * 3600,
        trainer_process=args.trainer_process, json_logs=args.log_format == "json",
        **({} if args.prefill_tokens_per_step is None else {"prefill_tokens_per_step": args.prefill_tokens_per_step}),
    )
