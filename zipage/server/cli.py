"""``zipage serve MODEL_DIR``: build the engine and serve it over HTTP with uvicorn."""

from __future__ import annotations

import argparse
import os

API_KEY_ENV = "ZIPAGE_API_KEY"


def add_serve_parser(sub) -> None:
    from zipage.cli import add_engine_args
    from zipage.server.app import PREPROCESS_WORKERS
    from zipage.server.connections import ConnectionLimits
    from zipage.server.protocol import RequestLimits
    from zipage.server.reasoning import PARSERS
    from zipage.server.tools import PARSERS as TOOL_PARSERS

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", metavar="MODEL_DIR", help="local HuggingFace checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the directory's name)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV}); "
                        "an empty key is an error")
    p.add_argument("--unauthenticated-metrics", action="store_true",
                   help="serve /metrics without the API key (for a scraper that cannot send it)")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests that may wait for the engine; past this, 503 with Retry-After")
    p.add_argument("--stream-interval", type=float, default=None,
                   help="seconds between the chunks of a stream (first tokens and ends go at once; "
                        "default 0.02): fewer chunks leave more of the interpreter to the engine")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="the interpreter's thread switch interval in seconds, in the process the engine runs in "
                        "(sys.setswitchinterval; default: Python's 0.005): with --no-engine-process, how long the "
                        "engine thread may wait for the GIL held by the event loop")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, so that the HTTP server's work (parsing requests, "
                        "formatting streams) does not share its interpreter (default: on; --no-engine-process "
                        "steps it on a thread of the server's process)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(PARSERS),
                   help="put a chat answer's thinking (<think>...</think>) in message.reasoning and "
                        "message.reasoning_content, apart from its content (docs/serving.md)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="read the tool calls a model writes in its chat answer (hermes: <tool_call>{...}</tool_call>, "
                        "as Qwen3 writes them) into message.tool_calls, for tool_choice=\"auto\" (docs/serving.md)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accept tool_choice=\"auto\", the default when a request gives tools (needs "
                        "--tool-call-parser); without it such requests get 400, as vLLM answers them")
    d = p.add_argument_group("data parallelism (needs the ray extra: docs/serving.md)")
    d.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas (Ray actors, each with --tensor-parallel-size GPUs) behind this endpoint")
    d.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (auto, or ray://host:10001), so replicas may run on its other hosts")
    d.add_argument("--routing", default="prefix", choices=["prefix", "load", "round_robin"],
                   help="how calls are spread: least load, keeping calls that share a prompt prefix together "
                        "unless that replica is much busier (prefix); least load only (load); in turn (round_robin)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])

    r, c = RequestLimits(), ConnectionLimits()
    g = p.add_argument_group("request limits (docs/security.md)")
    g.add_argument("--max-body-bytes", type=int, default=r.max_body_bytes,
                   help="largest request body; past it, 413 (default %(default)s)")
    g.add_argument("--body-timeout", type=float, default=r.body_timeout_s,
                   help="seconds to receive a whole request body; past it, 408 (default %(default)s)")
    g.add_argument("--max-pending-body-bytes", type=int, default=r.max_pending_body_bytes,
                   help="request bytes being read or parsed at once, over all requests; past it, 503 "
                        "(default %(default)s)")
    g.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt in tokens (default: the engine's, max_model_len - 1)")
    g.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longest prompt in characters (chat: the rendered template), refused before tokenizing "
                        "(default: what the context could hold at the tokenizer's longest token)")
    g.add_argument("--max-messages", type=int, default=r.max_messages, help="messages per chat (default %(default)s)")
    g.add_argument("--max-stop", type=int, default=r.max_stop,
                   help="stop strings, and stop token ids, per request (default %(default)s)")
    g.add_argument("--max-stop-chars", type=int, default=r.max_stop_chars,
                   help="characters of one stop string (default %(default)s)")
    g.add_argument("--max-requests-per-call", type=int, default=r.max_requests_per_call,
                   help="engine requests one call may add, prompts x n (default %(default)s)")
    g.add_argument("--max-tools", type=int, default=r.max_tools,
                   help="tools of one chat request (default %(default)s)")
    g.add_argument("--max-schema-bytes", type=int, default=r.max_schema_bytes,
                   help="bytes of one JSON schema (a tool's parameters, a response format), grammar or structural "
                        "tag (default %(default)s)")
    g.add_argument("--max-regex-chars", type=int, default=r.max_regex_chars,
                   help="characters of a structured-output regex (default %(default)s)")
    g.add_argument("--max-choices", type=int, default=r.max_choices,
                   help="strings of a structured-output choice (default %(default)s)")
    g.add_argument("--preprocess-workers", type=int, default=PREPROCESS_WORKERS,
                   help="threads that parse bodies, render chat templates and tokenize (default %(default)s)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request replace the model's chat template (chat_template_kwargs.chat_template); "
                        "a template is a program that runs on the server")
    g.add_argument("--escape-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="tokenize special-token text in chat messages (e.g. '<|im_start|>system') as plain text, "
                        "so that a message cannot forge a turn (default: on)")
    h = p.add_argument_group("connections (docs/security.md)")
    h.add_argument("--max-connections", type=int, default=c.max_connections,
                   help="open client connections; past it a new one gets 503 and is closed (default %(default)s)")
    h.add_argument("--header-timeout", type=float, default=c.header_timeout_s,
                   help="seconds for a request's headers to arrive; past it, 408 and close (default %(default)s)")
    h.add_argument("--keep-alive-timeout", type=float, default=c.keep_alive_timeout_s,
                   help="seconds an idle keep-alive connection stays open (default %(default)s)")
    h.add_argument("--write-timeout", type=float, default=c.write_timeout_s,
                   help="seconds a client may read none of its response before it is cut off (default %(default)s)")
    h.add_argument("--max-header-bytes", type=int, default=c.max_header_bytes,
                   help="largest request line and headers; past it, 431 and close (default %(default)s)")
    h.add_argument("--backlog", type=int, default=c.backlog,
                   help="connections the kernel queues before they are accepted (default %(default)s)")
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def served_model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or os.path.basename(os.path.normpath(args.model))


def request_limits(args: argparse.Namespace):
    from zipage.server.protocol import RequestLimits

    return RequestLimits(max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
                         max_pending_body_bytes=args.max_pending_body_bytes,
                         max_prompt_tokens=args.max_prompt_tokens, max_prompt_chars=args.max_prompt_chars,
                         max_messages=args.max_messages, max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
                         max_requests_per_call=args.max_requests_per_call, max_tools=args.max_tools,
                         max_schema_bytes=args.max_schema_bytes, max_regex_chars=args.max_regex_chars,
                         max_choices=args.max_choices)


def connection_limits(args: argparse.Namespace):
    from zipage.server.connections import ConnectionLimits

    return ConnectionLimits(max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                            keep_alive_timeout_s=args.keep_alive_timeout, write_timeout_s=args.write_timeout,
                            max_header_bytes=args.max_header_bytes, backlog=args.backlog)


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key, else from the environment; an empty one is an error, not 'no key'."""
    from zipage.server.app import check_api_key_value

    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    try:
        check_api_key_value(key)
    except ValueError as error:
        source = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
        raise ValueError(f"{source}: {error}") from None
    return key


def build_app(args: argparse.Namespace):
    from zipage import LLM
    from zipage.cli import engine_kwargs
    from zipage.server.app import STREAM_INTERVAL_S, create_app
    from zipage.server.engine_process import EngineProcess, build_llm_engine

    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    stream_interval = STREAM_INTERVAL_S if args.stream_interval is None else args.stream_interval
    if not stream_interval >= 0:
        raise ValueError(f"--stream-interval must be >= 0, got {args.stream_interval}")
    if args.switch_interval is not None and not args.switch_interval > 0:
        raise ValueError(f"--switch-interval must be > 0, got {args.switch_interval}")
    if args.preprocess_workers < 1:
        raise ValueError(f"--preprocess-workers must be >= 1, got {args.preprocess_workers}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes): the parser reads the calls")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    key = api_key(args)
    limits = request_limits(args)  # checked before the model loads
    connection_limits(args)
    app_kwargs = dict(max_queued_requests=args.max_queued_requests, stream_interval=stream_interval,
                      switch_interval=args.switch_interval, limits=limits,
                      preprocess_workers=args.preprocess_workers,
                      trust_request_chat_template=args.trust_request_chat_template,
                      escape_special_tokens=args.escape_special_tokens,
                      reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                      enable_auto_tool_choice=args.enable_auto_tool_choice)
    if args.data_parallel_size > 1 or args.ray_address:
        return _build_router(args, key, limits, app_kwargs)
    if not args.engine_process:
        llm = LLM(args.model, **engine_kwargs(args))
        return create_app(llm.engine, served_model_name(args), api_key=key,
                          metrics_need_key=not args.unauthenticated_metrics, **app_kwargs)
    engine = EngineProcess(build_llm_engine, (args.model, engine_kwargs(args)))
    try:
        return create_app(engine, served_model_name(args), api_key=key,
                          metrics_need_key=not args.unauthenticated_metrics, **app_kwargs)
    except BaseException:
        engine.close()
        raise


def _build_router(args: argparse.Namespace, key: str | None, limits, app_kwargs: dict):
    """The router app over ``--data-parallel-size`` replicas on Ray; they stop when the app does."""
    import contextlib

    import torch

    from zipage.cli import engine_kwargs
    from zipage.server.replicas import ReplicaSet
    from zipage.server.router import create_router_app

    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    replicas = ReplicaSet(args.model, args.data_parallel_size, engine_kwargs(args), served_model_name(args),
                          app_kwargs, ray_address=args.ray_address,
                          gpus_per_replica=args.tensor_parallel_size if on_gpu else 0)
    app = create_router_app(replicas, served_model_name(args), api_key=key, routing=args.routing, limits=limits,
                            metrics_need_key=not args.unauthenticated_metrics)
    serving = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            async with serving(app) as state:
                yield state
        finally:
            replicas.shutdown()
    app.router.lifespan_context = lifespan
    return app


def run_serve(args: argparse.Namespace) -> int:
    from zipage.server.connections import uvicorn_config

    app = build_app(args)
    try:
        serve(uvicorn_config(app, connection_limits(args), host=args.host, port=args.port, log_level=args.log_level))
    finally:  # the app stops its engine process when it stops; not if it never started
        process = getattr(getattr(app.state, "engine", None), "process", None)
        if process is not None:
            process.close()
    return 0


def serve(config) -> None:
    """Run uvicorn with ``config`` until it is stopped (a signal)."""
    import uvicorn

    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down gracefully and re-raises it
        pass
