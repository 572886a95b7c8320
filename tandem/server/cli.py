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
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--draft-vocab-size", type=int, default=None, help="eagle without --drafter-path: the day-0 head's draft vocabulary")
    p.add_argument("--online", action="store_true", help="the flywheel: train the eagle head on live traffic and hot-swap it")
    p.add_argument("--state-dir", default=None, help="checkpoints, traces, drafter versions; resumed on start (default with --online: $TANDEM_HOME/serve/MODEL)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"), help="require `Authorization: Bearer KEY` on /v1 (env TANDEM_API_KEY)")
    p.add_argument("--admin-key", default=os.environ.get("TANDEM_ADMIN_KEY"), help="enable /admin routes behind this key (env TANDEM_ADMIN_KEY)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=64, help="requests queued beyond the running batch; more get 429")
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
        num_draft_tokens=args.num_draft_tokens, draft_vocab_size=args.draft_vocab_size, online=args.online, state_dir=args.state_dir, host=args.host, port=args.port,
        api_key=args.api_key, admin_key=args.admin_key, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
        max_model_len=args.max_model_len, max_body_bytes=args.max_body_bytes, threads=args.threads,
        publish_every=args.publish_every, checkpoint_every=args.checkpoint_every,
    )
