"""``zipage run-batch``: a file of OpenAI Batch requests in, a file of their results out.

The input holds one request per line, in the OpenAI Batch format (as ``vllm run-batch``
reads it)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

``url`` is ``/v1/chat/completions`` or ``/v1/completions`` and ``body`` what that endpoint
takes (``model`` may be left out: the served model). Each result line is::

    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

A request the API refuses gets its 4xx ``response``; a line with a ``custom_id`` that is
not a request the API takes (another ``url`` or ``method``, a body that is not an object,
``stream``) gets ``"response": null`` and an ``error``. A line that is not JSON, or has no
``custom_id``, stops the run before anything is sent, naming the line.

The requests go through the same HTTP API ``zipage serve`` runs, on a loopback port of
this process, many at once so that the engine batches them: validation, chat templates,
reasoning, tools and structured outputs behave exactly as served. Results are written in
the order they finish, each line whole and flushed, so a run that is killed leaves every
finished line in the output; running the same command again keeps those lines, drops a
half-written last line, and runs only the requests without a result. Every ``custom_id``
must be unique (checked before anything runs), so no line is lost or written twice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import uuid
from dataclasses import dataclass

URLS = ("/v1/chat/completions", "/v1/completions")


@dataclass
class BatchLine:
    number: int  # 1-based line of the input
    custom_id: str
    url: str | None = None
    body: dict | None = None
    error: str | None = None  # why the line is not a request


def read_requests(path: str) -> list[BatchLine]:
    """The input's requests; ``ValueError`` naming the line if one is not a JSON object with a
    ``custom_id``, or the lines if two share one (checked before anything runs)."""
    lines, seen = [], {}
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                line = _parse(number, text)
            except ValueError as error:
                raise ValueError(f"{path}: {error}") from None
            if line.custom_id in seen:
                raise ValueError(f"{path}: custom_id {line.custom_id!r} is on lines {seen[line.custom_id]} and "
                                 f"{number}; every request needs its own, so that each result is found once")
            seen[line.custom_id] = number
            lines.append(line)
    return lines


def _parse(number: int, text: str) -> BatchLine:
    """A line's request, or the reason it is not one; ``ValueError`` for a line without a
    ``custom_id`` (its result could not be told apart, nor found again on a resume)."""
    try:
        item = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"line {number} is not JSON ({error}); every line must be a request object") from None
    custom_id = item.get("custom_id") if isinstance(item, dict) else None
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError(f"line {number} has no custom_id (a non-empty string), got {_short(text)}")
    line = BatchLine(number, custom_id, item.get("url"), item.get("body"))
    if item.get("method", "POST") != "POST":
        line.error = f"method must be POST, got {item.get('method')!r}"
    elif line.url not in URLS:
        line.error = f"url must be one of {', '.join(URLS)}, got {line.url!r}"
    elif not isinstance(line.body, dict):
        line.error = f"body must be a JSON object, got {type(line.body).__name__}"
    elif line.body.get("stream"):
        line.error = "stream must be false in a batch (results are written whole)"
    return line


def _short(text: str, limit: int = 80) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."


def finished_ids(path: str) -> set[str]:
    """The ``custom_id`` of every whole result line of ``path`` (which may not exist); a last line
    cut short by a killed run is removed from the file."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1  # past the last whole line
        if end < len(data):
            f.truncate(end)
    done = set()
    for text in data[:end].decode("utf-8").splitlines():
        if text.strip():
            done.add(json.loads(text)["custom_id"])
    return done


def result_line(custom_id: str, status: int | None, body, error: str | None = None) -> str:
    response = None if status is None else {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}
    record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
              "error": None if error is None else {"code": "invalid_request", "message": error}}
    return json.dumps(record, ensure_ascii=False) + "\n"


async def _run(url: str, model_name: str, lines: list[BatchLine], output: str, concurrency: int,
               progress) -> dict:
    """Send the requests with at most ``concurrency`` in flight; append each result to ``output``."""
    import httpx

    counts = {"ok": 0, "refused": 0, "invalid": 0}
    with open(output, "a", encoding="utf-8") as out:
        def write(text: str) -> None:
            out.write(text)
            out.flush()
            progress.update(1)

        async with httpx.AsyncClient(base_url=url, timeout=None,
                                     limits=httpx.Limits(max_connections=concurrency)) as client:
            async def one(line: BatchLine) -> None:
                if line.error is not None:
                    counts["invalid"] += 1
                    write(result_line(line.custom_id, None, None, f"line {line.number}: {line.error}"))
                    return
                body = dict(line.body)
                body.setdefault("model", model_name)
                response = await client.post(line.url, json=body)
                counts["ok" if response.status_code == 200 else "refused"] += 1
                write(result_line(line.custom_id, response.status_code, response.json()))

            queue = iter(lines)

            async def worker() -> None:  # ``concurrency`` of these: no task per line of a large file
                for line in queue:
                    await one(line)

            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(lines)) or 1)))
    return counts


def run_batch(app, model_name: str, input_path: str, output_path: str, concurrency: int = 256,
              show_progress: bool = True) -> dict:
    """Run ``input_path``'s requests through ``app`` (``zipage.server.app.create_app``) and append
    their results to ``output_path``, skipping those it already holds. Returns counts: ``ok``,
    ``refused`` (4xx/5xx answers), ``invalid`` (lines that are not requests), ``skipped``."""
    from tqdm import tqdm

    from zipage.server.background import ServerThread

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    lines = read_requests(input_path)
    done = finished_ids(output_path)
    todo = [line for line in lines if line.custom_id not in done]
    with ServerThread(app) as server, tqdm(total=len(todo), desc="requests", unit="req",
                                           disable=not show_progress) as progress:
        counts = asyncio.run(_run(server.url, model_name, todo, output_path, concurrency, progress))
    counts["skipped"] = len(lines) - len(todo)
    return counts


def add_batch_parser(sub) -> None:
    p = sub.add_parser("run-batch", help="run a file of OpenAI Batch requests, write their results (resumable)")
    p.add_argument("model", metavar="MODEL_DIR", help="local HuggingFace checkpoint directory")
    p.add_argument("-i", "--input", required=True, help="requests, one OpenAI Batch line each (JSONL)")
    p.add_argument("-o", "--output", required=True,
                   help="results (JSONL); lines already there are kept and their requests not run again")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight at once (default: twice --max-num-seqs)")
    p.add_argument("--served-model-name", default=None, help="the model name the bodies may give")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas on Ray actors (needs the ray extra); 1: this process alone")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. ray://host:10001 or auto) instead of starting a local one")
    from zipage.cli import add_engine_args
    from zipage.server.reasoning import PARSERS
    from zipage.server.tools import PARSERS as TOOL_PARSERS
    p.add_argument("--reasoning-parser", default=None, choices=sorted(PARSERS), help="as for zipage serve")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS), help="as for zipage serve")
    p.add_argument("--enable-auto-tool-choice", action="store_true", help="as for zipage serve")
    add_engine_args(p)
    p.set_defaults(func=_run_batch_command)


def _run_batch_command(args: argparse.Namespace) -> int:
    lines = read_requests(args.input)  # a bad file fails before the model loads
    del lines
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    server = dict(reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                  enable_auto_tool_choice=args.enable_auto_tool_choice)
    if args.data_parallel_size > 1 or args.ray_address:
        counts = _run_on_ray(args, server)
    else:
        counts = _run_here(args, server)
    print(f"{counts['ok']} answered, {counts['refused']} refused by the API, {counts['invalid']} not requests, "
          f"{counts['skipped']} already in {args.output}")
    return 0


def _run_on_ray(args: argparse.Namespace, server: dict) -> dict:
    import torch

    from zipage.cli import engine_kwargs
    try:
        from zipage.ray_batch import run_batch_ray
        import ray  # noqa: F401
    except ImportError:
        raise ValueError('--data-parallel-size and --ray-address run on Ray: pip install "zipage[ray]"') from None
    engine = engine_kwargs(args)
    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    return run_batch_ray(args.model, args.input, args.output, args.data_parallel_size, engine,
                         args.served_model_name, server, args.ray_address,
                         gpus_per_replica=args.tensor_parallel_size if on_gpu else 0)


def _run_here(args: argparse.Namespace, server: dict) -> dict:
    from zipage import LLM
    from zipage.cli import engine_kwargs
    from zipage.server.app import create_app

    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    llm = LLM(args.model, **engine_kwargs(args))
    concurrency = args.concurrency or 2 * llm.engine.config.scheduler.max_num_seqs
    app = create_app(llm.engine, name, max_queued_requests=max(1024, concurrency), **server)
    return run_batch(app, name, args.input, args.output, concurrency)
