"""``zipage bench serve``: online serving at several request rates, through the HTTP API.

Requests arrive as a Poisson process at each rate (``inf``: all at once) and stream
their tokens back; per rate we report completed requests/s, output tokens/s, and
percentiles of time to first token (TTFT), inter-token latency (ITL) and request
latency. The server is either one already running (``--url``) or one started in
this process on a free loopback port (``--model DIR`` or ``--shape``, random weights).

Each request asks for ``continuous_usage_stats``, so every chunk carries the token
count so far: a chunk of k tokens after a gap g counts as k inter-token gaps of g / k
(the server sends a stream's tokens at most every ``--stream-interval`` seconds).

The clients run in a child process: parsing every chunk of 48 streams in the server's
process took that much of the interpreter from the engine thread (they share the GIL)
that the engine stepped at half its pace. With the server here, each rate also reports
the engine's steps per second, to compare with its offline step time.

``--simulated-step`` serves no model: each engine step takes the time of a step model
(``--step-model``, by default the H200 Qwen3-8B fit of ``bench replay``) the way a GPU
step does, mostly with the GIL released. It shows on a CPU what the server costs a GPU
engine; each rate then also reports the modelled milliseconds per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from zipage.bench.common import model_dir_for, print_table, write_json


def add_serving_parser(sub) -> None:
    from zipage.cli import add_engine_args

    p = sub.add_parser("serve", help="online serving: Poisson arrivals at several rates, TTFT and ITL")
    target = p.add_argument_group("server (a running one, or one started here)")
    target.add_argument("--url", default=None, help="base URL of a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--api-key", default=None)
    target.add_argument("--model", default=None, help="checkpoint directory to serve here")
    target.add_argument("--shape", default="tiny", help="with neither --url nor --model: random weights")
    target.add_argument("--arch", default="qwen3")
    target.add_argument("--stream-interval", type=float, default=None,
                        help="the server's seconds between a stream's chunks (default: zipage serve's)")
    target.add_argument("--switch-interval", type=float, default=None,
                        help="the server's Python switch interval in seconds (default: zipage serve's)")
    target.add_argument("--simulated-step", action="store_true",
                        help="no model: each engine step sleeps for --step-model's time (GIL released, as "
                             "a GPU step waits for the device)")
    target.add_argument("--step-model", default=None,
                        help="with --simulated-step: a,b,c,p0,p1 in ms as for bench replay (default: the "
                             "H200 Qwen3-8B fit)")
    w = p.add_argument_group("workload")
    w.add_argument("--rates", default="1,4,16,inf", help="requests per second, comma-separated (inf: burst)")
    w.add_argument("--num-requests", type=int, default=64, help="per rate")
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens (random ids)")
    w.add_argument("--output-len", type=int, default=128, help="output tokens (EOS ignored)")
    w.add_argument("--vocab-size", type=int, default=None, help="prompt ids below this (default: the model's, "
                   "or 256 with --url)")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--workload-seed", type=int, default=0)
    w.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--out", default=None, help="directory for serving.json")
    add_engine_args(p)
    p.set_defaults(func=run_serving_bench)


def _rates(text: str) -> list[float]:
    rates = [math.inf if r.strip() == "inf" else float(r) for r in text.split(",")]
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--rates must be positive numbers or 'inf', got {text!r}")
    return rates


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


async def _one_request(client, url: str, body: dict, start_at: float, t0: float, timeout: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    sent = time.perf_counter()
    result = {"ttft": None, "itl": [], "latency": None, "output_tokens": 0, "error": None}
    last, tokens = sent, 0
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as response:
            if response.status_code != 200:
                result["error"] = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result["error"] = chunk["error"]["message"]
                    return result
                usage = chunk.get("usage") or {}
                now, new = time.perf_counter(), usage.get("completion_tokens", tokens) - tokens
                if new > 0:
                    if result["ttft"] is None:
                        result["ttft"] = now - sent
                    else:
                        result["itl"] += [(now - last) / new] * new
                    tokens, last = usage["completion_tokens"], now
    except Exception as error:  # noqa: BLE001 - a failed request is counted, the run goes on
        result["error"] = f"{type(error).__name__}: {error}"
        return result
    result["latency"], result["output_tokens"] = time.perf_counter() - sent, tokens
    return result


async def run_rate(base_url: str, model: str, rate: float, args, vocab_size: int, headers: dict) -> dict:
    import httpx

    rng = np.random.default_rng(args.workload_seed)
    n = args.num_requests
    gaps = np.zeros(n) if math.isinf(rate) else rng.exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    prompts = rng.integers(0, vocab_size, (n, args.input_len)).tolist()
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            _one_request(client, url, {
                "model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": args.temperature,
                "ignore_eos": True, "stream": True, "stream_options": {"continuous_usage_stats": True}},
                float(arrival), t0, args.timeout)
            for prompt, arrival in zip(prompts, arrivals)))
        duration = time.perf_counter() - t0
    done = [r for r in results if r["error"] is None]
    output_tokens = sum(r["output_tokens"] for r in done)
    return {"rate": "inf" if math.isinf(rate) else rate, "num_requests": n, "completed": len(done),
            "failed": n - len(done), "errors": sorted({str(r["error"]) for r in results if r["error"]})[:5],
            "duration_s": duration, "requests_per_s": len(done) / duration,
            "output_tokens_per_s": output_tokens / duration,
            "ttft_s": percentiles([r["ttft"] for r in done if r["ttft"] is not None]),
            "itl_s": percentiles([x for r in done for x in r["itl"]]),
            "latency_s": percentiles([r["latency"] for r in done])}


def _run_rate_sync(base_url: str, model: str, rate: float, args, vocab_size: int, headers: dict) -> dict:
    return asyncio.run(run_rate(base_url, model, rate, args, vocab_size, headers))


def _server_model(base_url: str, headers: dict) -> str:
    import httpx
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def run_serving_bench(args: argparse.Namespace) -> int:
    rates = _rates(args.rates)
    if args.num_requests < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-requests, --input-len and --output-len must be >= 1")
    if args.url and (args.simulated_step or args.switch_interval is not None):
        raise ValueError("--simulated-step and --switch-interval are for a server started here, not --url")
    if args.step_model is not None and not args.simulated_step:
        raise ValueError("--step-model needs --simulated-step")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server = clients = None
    settings = {k: getattr(args, k) for k in ("num_requests", "input_len", "output_len", "temperature",
                                              "workload_seed")}
    try:
        if args.url:
            base_url, vocab_size = args.url, args.vocab_size or 256
            settings["server"] = args.url
        else:
            server, vocab_size, settings["server"] = _start_server(args)
            base_url = server.url
        model = _server_model(base_url, headers)
        workload = argparse.Namespace(**{k: getattr(args, k) for k in (
            "num_requests", "input_len", "output_len", "temperature", "workload_seed", "timeout")})
        warmup = argparse.Namespace(**dict(vars(workload), num_requests=1, output_len=2))
        clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        clients.submit(_run_rate_sync, base_url, model, math.inf, warmup, vocab_size, headers).result()
        rows = []
        for rate in rates:
            steps = server.engine.stats.num_steps if server is not None else None
            modelled = _modelled_ms(server)
            row = clients.submit(_run_rate_sync, base_url, model, rate, workload, vocab_size, headers).result()
            if server is not None:
                row["engine_steps"] = server.engine.stats.num_steps - steps
                row["engine_steps_per_s"] = row["engine_steps"] / row["duration_s"]
            if modelled is not None:
                row["modelled_ms_per_step"] = (_modelled_ms(server) - modelled) / max(row["engine_steps"], 1)
            rows.append(row)
            print(f"rate {row['rate']}: {row['completed']}/{row['num_requests']} done, "
                  f"{row['requests_per_s']:.2f} req/s, TTFT p50 {_ms(row['ttft_s']['p50'])}, "
                  f"ITL p50 {_ms(row['itl_s']['p50'])}", flush=True)
    finally:
        if clients is not None:
            clients.shutdown()
        if server is not None:
            server.stop()
    result = {"benchmark": "serving", "model": model, "settings": settings, "rates": rows}
    print_table([{"rate": r["rate"], "req/s": r["requests_per_s"], "tok/s": r["output_tokens_per_s"],
                  "ttft_p50_ms": _ms_value(r["ttft_s"]["p50"]), "ttft_p99_ms": _ms_value(r["ttft_s"]["p99"]),
                  "itl_p50_ms": _ms_value(r["itl_s"]["p50"]), "itl_p99_ms": _ms_value(r["itl_s"]["p99"]),
                  "steps/s": r.get("engine_steps_per_s"), "model_ms/step": r.get("modelled_ms_per_step"),
                  "failed": r["failed"]} for r in rows],
                ["rate", "req/s", "tok/s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "steps/s",
                 "model_ms/step", "failed"])
    if args.out:
        import os
        write_json(os.path.join(args.out, "serving.json"), result)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _start_server(args):
    """Build the engine and serve it on a free loopback port of this process."""
    from zipage.cli import engine_kwargs
    from zipage.server.app import create_app
    from zipage.server.background import ServerThread

    model_dir, load_format = model_dir_for(args.model, args.shape, args.arch)
    kwargs = engine_kwargs(args)
    if load_format == "dummy":
        kwargs["load_format"] = "dummy"
    engine = _simulated_engine(model_dir, kwargs, args) if args.simulated_step else _engine(model_dir, kwargs)
    options = {k: getattr(args, k) for k in ("stream_interval", "switch_interval") if getattr(args, k) is not None}
    app = create_app(engine, "bench", api_key=args.api_key, max_queued_requests=10**6, **options)
    vocab_size = args.vocab_size or engine.vocab_size
    described = {k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v) for k, v in kwargs.items()}
    server = ServerThread(app)
    server.engine = engine
    described_server = {"in_process": args.model or args.shape, "device": str(engine.config.device),
                        "engine": described, "stream_interval": app.state.engine.stream_interval,
                        "switch_interval": app.state.engine.switch_interval}
    if args.simulated_step:
        described_server["simulated_step"] = engine.runner.model
    return server, vocab_size, described_server


def _engine(model_dir: str, kwargs: dict):
    from zipage import LLM
    return LLM(model_dir, **kwargs).engine


def _simulated_engine(model_dir: str, kwargs: dict, args):
    """An engine whose runner sleeps for a step model's time instead of running the model."""
    from zipage.bench.replay import SimulatedRunner, parse_step_model
    from zipage.bench.throughput import rank_spec
    from zipage.config import EngineConfig
    from zipage.engine.llm_engine import LLMEngine

    config = EngineConfig.from_kwargs(model_dir, **dict(kwargs, device="cpu", load_format="auto"))
    runner = SimulatedRunner(config, rank_spec(model_dir, args.tensor_parallel_size),
                             parse_step_model(args.step_model), sleep=True)
    return LLMEngine(config, runner=runner)


def _modelled_ms(server) -> float | None:
    """The simulated runner's clock, if the server here has one."""
    runner = getattr(getattr(server, "engine", None), "runner", None)
    if getattr(runner, "sleep", False):
        return runner.decode_ms + runner.prefill_ms
    return None


def _ms_value(seconds):
    return None if seconds is None else 1000 * seconds


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"
