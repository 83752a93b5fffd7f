"""``zipage serve MODEL_DIR``: build the engine and serve it over HTTP with uvicorn."""

from __future__ import annotations

import argparse
import os

API_KEY_ENV = "ZIPAGE_API_KEY"


def add_serve_parser(sub) -> None:
    from zipage.cli import add_engine_args

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", metavar="MODEL_DIR", help="local HuggingFace checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the directory's name)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every request (default: ${API_KEY_ENV})")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests that may wait for the engine; past this, 503 with Retry-After")
    p.add_argument("--stream-interval", type=float, default=None,
                   help="seconds between the chunks of a stream (first tokens and ends go at once; "
                        "default 0.02): fewer chunks leave more of the interpreter to the engine")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="the interpreter's thread switch interval in seconds while serving (sys.setswitchinterval; "
                        "default: Python's 0.005): how long the engine thread may wait for the GIL held by the "
                        "event loop")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def served_model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or os.path.basename(os.path.normpath(args.model))


def build_app(args: argparse.Namespace):
    from zipage import LLM
    from zipage.cli import engine_kwargs
    from zipage.server.app import STREAM_INTERVAL_S, create_app

    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    stream_interval = STREAM_INTERVAL_S if args.stream_interval is None else args.stream_interval
    if not stream_interval >= 0:
        raise ValueError(f"--stream-interval must be >= 0, got {args.stream_interval}")
    if args.switch_interval is not None and not args.switch_interval > 0:
        raise ValueError(f"--switch-interval must be > 0, got {args.switch_interval}")
    llm = LLM(args.model, **engine_kwargs(args))
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    return create_app(llm.engine, served_model_name(args), api_key=api_key,
                      max_queued_requests=args.max_queued_requests, stream_interval=stream_interval,
                      switch_interval=args.switch_interval)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_app(args)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
