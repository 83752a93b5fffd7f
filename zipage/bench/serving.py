"""``zipage bench serve``: online serving at several request rates, through the HTTP API.

Requests arrive as a Poisson process at each rate (``inf``: all at once) and stream
their tokens back; per rate we report completed requests/s, output tokens/s, and
percentiles of time to first token (TTFT), inter-token latency (ITL) and request
latency. The server is either one already running (``--url``) or one started in
this process on a free loopback port (``--model DIR`` or ``--shape``, random weights).

Each request asks for ``continuous_usage_stats``, so every chunk carries the token
count so far: a chunk of k tokens after a gap g counts as k inter-token gaps of g / k
(the server sends a stream's tokens at most every ``--stream-interval`` seconds).
The clients keep two numbers per chunk (its gap and token count, in arrays), so a
long stream's client memory is 12 bytes a chunk.

The clients run in a child process: parsing every chunk of 48 streams in the server's
process took that much of the interpreter from the engine thread (they share the GIL)
that the engine stepped at half its pace. With the server here, each rate also reports
the engine's steps per second, to compare with its offline step time.

``--workload reasoning-8k`` (or ``reasoning-16k``; ``--scale``, ``--modes``,
``--num-requests``, ``--kv-cache-tokens`` as for ``bench throughput``) sends the seeded
requests of ``zipage bench throughput`` with the same engine settings and KV cache, each
with its own ``max_tokens`` and seed, EOS ignored, at one rate (default ``inf``). Per mode
it also runs the same requests through the engine offline (stepped in a loop, as
``LLM.generate`` does), each run on a fresh engine warmed up as throughput's, and reports
online and offline tokens/s side by side: the server's cost is their ratio. With ``inf``
the requests are all sent at once and reach the engine in the order the connections are
accepted, close to but not always the offline order.

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
import os
import time
from array import array
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

import numpy as np

from zipage.bench.common import model_dir_for, print_table, write_json
from zipage.bench.workloads import WORKLOADS

BENCH_MODEL = "bench"  # the model name of a server started here
RANDOM_DEFAULTS = dict(num_requests=64, input_len=128, output_len=128, rates="1,4,16,inf", temperature=0.0,
                       block_size=256, compression_window=16)


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
    target.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="the server started here runs its engine in a process of its own, as zipage serve "
                             "does (default: on; --no-engine-process: on a thread of the server's process)")
    target.add_argument("--simulated-step", action="store_true",
                        help="no model: each engine step sleeps for --step-model's time (GIL released, as "
                             "a GPU step waits for the device)")
    target.add_argument("--step-model", default=None,
                        help="with --simulated-step: a,b,c,p0,p1 in ms as for bench replay (default: the "
                             "H200 Qwen3-8B fit)")
    w = p.add_argument_group("workload")
    w.add_argument("--rates", default=None, help="requests per second, comma-separated (inf: burst; default "
                   "1,4,16,inf, with --workload one rate, default inf)")
    w.add_argument("--num-requests", type=int, default=None, help="per rate (default 64; with --workload: "
                   "enough that peak KV demand is twice the cache, as bench throughput)")
    w.add_argument("--input-len", type=int, default=None, help="prompt tokens (random ids; default 128)")
    w.add_argument("--output-len", type=int, default=None, help="output tokens (EOS ignored; default 128)")
    w.add_argument("--vocab-size", type=int, default=None, help="prompt ids below this (default: the model's, "
                   "or 256 with --url)")
    w.add_argument("--temperature", type=float, default=None,
                   help="default 0 (with --workload: bench throughput's, 0.6)")
    w.add_argument("--workload-seed", type=int, default=0, help="seed of the random prompts and arrivals")
    w.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    standard = p.add_argument_group("a standard workload, online against offline (--workload)")
    standard.add_argument("--workload", default=None, choices=sorted(WORKLOADS),
                          help="the seeded requests of bench throughput --workload (seeded by --seed), "
                               "served here and run offline with the same engine settings")
    standard.add_argument("--scale", default="1", help="as bench throughput: a factor, or 'small' / 'medium'")
    standard.add_argument("--modes", default=None, help="as bench throughput (default full,zipage); "
                          "--kv-budget-tokens, --compression-window and --block-size override the scale's")
    standard.add_argument("--kv-cache-tokens", type=int, default=None, help="as bench throughput")
    standard.add_argument("--whole-gpu", action="store_true", help="as bench throughput")
    standard.add_argument("--samples-per-prompt", type=int, default=1)
    standard.add_argument("--sides", default="online,offline",
                          help=f"which runs of each mode, comma-separated from {','.join(SIDES)} (offline-streamed: "
                               "offline with every request streamed, so that the engine detokenizes and emits "
                               "every step's tokens as the server's does)")
    mixed = p.add_argument_group("long prompts arriving while streams decode (--background)")
    mixed.add_argument("--background", type=int, default=0,
                       help="streams of --input-len / --output-len tokens sent at once; once they decode, the "
                            "--long-prompts arrive. Reports the streams' inter-token latency while the long "
                            "prompts are prefilled, and the long prompts' time to first token")
    mixed.add_argument("--long-prompts", default="8192,16384,32768", help="prompt lengths, comma-separated")
    mixed.add_argument("--long-repeats", type=int, default=2, help="requests of each long prompt length")
    mixed.add_argument("--long-start", type=float, default=3.0,
                       help="seconds after the streams start when the first long prompt arrives")
    mixed.add_argument("--long-rate", type=float, default=0.5, help="long prompts a second (Poisson)")
    mixed.add_argument("--long-output-len", type=int, default=16)
    mixed.add_argument("--control", action="store_true",
                       help="then send the same streams again without long prompts, and report their median "
                            "inter-token gap in the same window (the decode step at the same context lengths) "
                            "and the window's p99 over it")
    mixed.add_argument("--profile-window", type=float, default=0.0,
                       help="with the server started here: record the engine's kernels (torch.profiler) for this "
                            "many seconds from the first long prompt's arrival, and report them by kind per "
                            "step (default 0: off)")
    p.add_argument("--out", default=None, help="directory for serving.json")
    add_engine_args(p)
    # Their defaults depend on --workload (RANDOM_DEFAULTS without it, the scale's with it).
    p.set_defaults(func=run_serving_bench, block_size=None, compression_window=None)


def _rates(text: str) -> list[float]:
    try:
        rates = [math.inf if r.strip() == "inf" else float(r) for r in text.split(",")]
    except ValueError:
        raise ValueError(f"--rates must be positive numbers or 'inf', got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--rates must be positive numbers or 'inf', got {text!r}")
    return rates


def percentiles(values) -> dict:
    a = np.asarray(values, dtype=float)
    if not a.size:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


async def _one_request(client, url: str, body: dict, start_at: float, t0: float, timeout: float) -> dict:
    """Send one streamed request; keep per chunk only its gap and token count (kept small: a 16K-token
    stream has thousands of chunks, and the clients of many streams share one interpreter)."""
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    sent = time.perf_counter()
    result = {"ttft": None, "gaps": array("d"), "counts": array("l"), "times": array("d"), "latency": None,
              "prompt_tokens": None, "output_tokens": 0, "error": None, "sent": sent - t0}
    gaps, counts, times = result["gaps"], result["counts"], result["times"]
    last, tokens = sent, 0
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as response:
            if response.status_code != 200:
                result["error"] = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for chunk in sse_chunks(response):
                if "error" in chunk:
                    result["error"] = chunk["error"]["message"]
                    return result
                usage = chunk.get("usage") or {}
                now, new = time.perf_counter(), usage.get("completion_tokens", tokens) - tokens
                if new > 0:
                    if result["ttft"] is None:
                        result["ttft"], result["prompt_tokens"] = now - sent, usage["prompt_tokens"]
                    else:
                        gaps.append((now - last) / new)
                        counts.append(new)
                        times.append(now - t0)  # when the chunk came, from the run's start
                    tokens, last = usage["completion_tokens"], now
    except Exception as error:  # noqa: BLE001 - a failed request is counted, the run goes on
        result["error"] = f"{type(error).__name__}: {error}"
        return result
    result["latency"], result["output_tokens"] = time.perf_counter() - sent, tokens
    return result


async def sse_chunks(response):
    """The JSON chunks of a server-sent event stream, up to ``[DONE]``. Events are split on blank lines
    in the bytes: httpx's ``aiter_lines`` also splits at U+2028 and U+0085, which JSON leaves unescaped
    in random text."""
    pending = b""
    async for data in response.aiter_bytes():
        *events, pending = (pending + data).split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: "):
                continue
            if event == b"data: [DONE]":
                return
            yield json.loads(event[6:])


async def send_all(base_url: str, bodies: list[dict], arrivals, timeout: float, headers: dict) -> tuple:
    """Send ``bodies`` (streamed completions) at ``arrivals`` (seconds from the start); (each request's
    result, seconds from the first send to the last answer, client CPU seconds, the start's
    ``time.perf_counter()``: a system-wide monotonic clock, so a server's own times can be placed
    on the clients')."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, limits=limits) as client:
        t0, cpu = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(_one_request(client, url, body, float(arrival), t0, timeout)
                                         for body, arrival in zip(bodies, arrivals)))
        return results, time.perf_counter() - t0, time.process_time() - cpu, t0


def send_all_sync(base_url: str, bodies: list[dict], arrivals, timeout: float, headers: dict) -> tuple:
    return asyncio.run(send_all(base_url, bodies, arrivals, timeout, headers))


def itl_values(results: list[dict]) -> np.ndarray:
    """Inter-token gaps of ``results``: each chunk's gap once per token it brought."""
    return np.repeat(np.concatenate([r["gaps"] for r in results] or [[]]),
                     np.concatenate([r["counts"] for r in results] or [[]]).astype(int))


async def run_rate(base_url: str, bodies: list[dict], arrivals, timeout: float, headers: dict) -> dict:
    """Send ``bodies`` (streamed completions) at ``arrivals`` (seconds from the start); their numbers."""
    results, duration, cpu, _ = await send_all(base_url, bodies, arrivals, timeout, headers)
    n = len(bodies)
    done = [r for r in results if r["error"] is None]
    output_tokens = sum(r["output_tokens"] for r in done)
    itl = itl_values(done)
    return {"num_requests": n, "completed": len(done), "failed": n - len(done),
            "errors": sorted({str(r["error"]) for r in results if r["error"]})[:5],
            "duration_s": duration, "requests_per_s": len(done) / duration,
            "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / duration,
            "ttft_s": percentiles([r["ttft"] for r in done if r["ttft"] is not None]),
            "itl_s": percentiles(itl), "latency_s": percentiles([r["latency"] for r in done]),
            "client_cpu_s": cpu, "chunks": sum(len(r["gaps"]) + (r["ttft"] is not None) for r in results),
            "request_lengths": [[r["prompt_tokens"], r["output_tokens"]] for r in results]}


def run_rate_sync(base_url: str, bodies: list[dict], arrivals, timeout: float, headers: dict) -> dict:
    return asyncio.run(run_rate(base_url, bodies, arrivals, timeout, headers))


def arrivals(rate: float, count: int, rng: np.random.Generator) -> np.ndarray:
    """Poisson arrival times (seconds from the first), or all at 0 for rate ``inf``."""
    gaps = np.zeros(count) if math.isinf(rate) else rng.exponential(1.0 / rate, count)
    return np.cumsum(gaps) - gaps[0]


def stream_body(model: str, prompt, params) -> dict:
    """A streamed completion request of ``params`` (a ``SamplingParams``), with the usage in every chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": params.max_tokens, "temperature": params.temperature,
            "ignore_eos": params.ignore_eos, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    for field in ("seed", "stop"):
        if getattr(params, field):
            body[field] = getattr(params, field)
    return body


def client_pool() -> ProcessPoolExecutor:
    return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))


def _warm_clients(clients, base_url: str, model: str, headers: dict) -> None:
    """One short request first: the child's imports and the connection are not timed."""
    from zipage import SamplingParams
    body = stream_body(model, [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    clients.submit(run_rate_sync, base_url, [body], [0.0], 600.0, headers).result()


def _server_model(base_url: str, headers: dict) -> str:
    import httpx
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


@contextmanager
def serving_target(args: argparse.Namespace, headers: dict, settings: dict):
    """The server to measure (``--url``, or one started in this process) and the clients' child
    process, warmed up: yields (base URL, prompt vocabulary size, model name, clients, the server
    started here or None); stops what it started. ``settings["server"]`` says which."""
    server = clients = None
    try:
        if args.url:
            base_url, vocab_size = args.url, args.vocab_size or 256
            settings["server"] = args.url
        else:
            server, vocab_size, settings["server"] = _start_server(args)
            base_url = server.url
        model = _server_model(base_url, headers)
        clients = client_pool()
        _warm_clients(clients, base_url, model, headers)
        yield base_url, vocab_size, model, clients, server
    finally:
        if clients is not None:
            clients.shutdown()
        if server is not None:
            server.stop()


def run_serving_bench(args: argparse.Namespace) -> int:
    if args.simulated_step and args.url:
        raise ValueError("--simulated-step is for a server started here, not --url")
    if args.step_model is not None and not args.simulated_step:
        raise ValueError("--step-model needs --simulated-step")
    if args.workload:
        return run_workload_bench(args)
    if args.background:
        from zipage.bench.interference import run_interference_bench
        vars(args).update({k: v for k, v in RANDOM_DEFAULTS.items() if getattr(args, k) is None})
        return run_interference_bench(args)
    for name in ("modes", "kv_cache_tokens"):
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} needs --workload")
    vars(args).update({k: v for k, v in RANDOM_DEFAULTS.items() if getattr(args, k) is None})
    return run_random_bench(args)


def run_random_bench(args: argparse.Namespace) -> int:
    """Random prompts of ``--input-len`` tokens, ``--output-len`` tokens each, at every rate."""
    rates = _rates(args.rates)
    for name in ("num_requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.url and args.switch_interval is not None:
        raise ValueError("--switch-interval is for a server started here, not --url")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    settings = {k: getattr(args, k) for k in ("num_requests", "input_len", "output_len", "temperature",
                                              "workload_seed")}
    with serving_target(args, headers, settings) as (base_url, vocab_size, model, clients, server):
        rows = []
        for rate in rates:
            rng = np.random.default_rng(args.workload_seed)
            at = arrivals(rate, args.num_requests, rng)
            prompts = rng.integers(0, vocab_size, (args.num_requests, args.input_len)).tolist()
            bodies = [dict(model=model, prompt=prompt, max_tokens=args.output_len, temperature=args.temperature,
                           ignore_eos=True, stream=True, stream_options={"continuous_usage_stats": True})
                      for prompt in prompts]
            steps, _, modelled = server.call_engine(_step_counters) if server is not None else (None, None, None)
            row = dict(rate="inf" if math.isinf(rate) else rate,
                       **clients.submit(run_rate_sync, base_url, bodies, at, args.timeout, headers).result())
            del row["request_lengths"]  # all the same here
            if server is not None:
                steps_now, _, modelled_now = server.call_engine(_step_counters)
                row["engine_steps"] = steps_now - steps
                row["engine_steps_per_s"] = row["engine_steps"] / row["duration_s"]
                if modelled is not None:
                    row["modelled_ms_per_step"] = (modelled_now - modelled) / max(row["engine_steps"], 1)
            rows.append(row)
            print(f"rate {row['rate']}: {row['completed']}/{row['num_requests']} done, "
                  f"{row['requests_per_s']:.2f} req/s, TTFT p50 {_ms(row['ttft_s']['p50'])}, "
                  f"ITL p50 {_ms(row['itl_s']['p50'])}", flush=True)
    result = {"benchmark": "serving", "model": model, "settings": settings, "rates": rows}
    print_table([{"rate": r["rate"], "req/s": r["requests_per_s"], "tok/s": r["output_tokens_per_s"],
                  "ttft_p50_ms": _ms_value(r["ttft_s"]["p50"]), "ttft_p99_ms": _ms_value(r["ttft_s"]["p99"]),
                  "itl_p50_ms": _ms_value(r["itl_s"]["p50"]), "itl_p99_ms": _ms_value(r["itl_s"]["p99"]),
                  "steps/s": r.get("engine_steps_per_s"), "model_ms/step": r.get("modelled_ms_per_step"),
                  "failed": r["failed"]} for r in rows],
                ["rate", "req/s", "tok/s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "steps/s",
                 "model_ms/step", "failed"])
    if args.out:
        write_json(os.path.join(args.out, "serving.json"), result)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


# -- a standard workload, online against offline ------------------------------------------------
SIDES = ("online", "offline", "offline-streamed")


def _sides(text: str) -> list[str]:
    sides = [side.strip() for side in text.split(",") if side.strip()]
    bad = [side for side in sides if side not in SIDES]
    if bad or not sides:
        raise ValueError(f"--sides {text!r}: each must be one of {', '.join(SIDES)}")
    return list(dict.fromkeys(sides))


def _workload_args(args: argparse.Namespace) -> argparse.Namespace:
    """``bench throughput``'s options for this run: its defaults, with what this command was given."""
    from zipage.bench.throughput import workload_defaults

    wargs = workload_defaults()
    shared = ("model", "shape", "arch", "workload", "scale", "num_requests", "samples_per_prompt", "kv_cache_tokens",
              "whole_gpu", "block_size", "redundancy", "no_prefix_caching", "enforce_eager", "piecewise_graph_tokens",
              "max_num_seqs", "tensor_parallel_size", "device", "seed", "trust_remote_code")
    vars(wargs).update({k: getattr(args, k) for k in shared})
    vars(wargs).update({k: v for k, v in (("modes", args.modes), ("temperature", args.temperature),
                                          ("budget", args.kv_budget_tokens), ("window", args.compression_window))
                        if v is not None})
    return wargs


def _check_workload_options(args: argparse.Namespace, rates: list[float]) -> None:
    given = [f"--{name}" for name, value in (
        ("url", args.url), ("input-len", args.input_len), ("output-len", args.output_len),
        ("vocab-size", args.vocab_size), ("kv-cache-memory-bytes", args.kv_cache_memory_bytes),
        ("max-model-len", args.max_model_len), ("no-async-scheduling", args.no_async_scheduling or None))
        if value is not None]
    if given:
        raise ValueError(f"--workload sets the requests, cache and context itself and serves here; drop {given} "
                         "(for the cache: --kv-cache-tokens; for synchronous scheduling: the mode modifier +step-sync)")
    if len(rates) != 1:
        raise ValueError(f"--workload runs one rate (each run needs a fresh engine, as the prefix cache keeps "
                         f"the prompts of the last), got --rates {args.rates}")


def run_workload_bench(args: argparse.Namespace) -> int:
    from zipage.bench.replay import parse_step_model
    from zipage.bench.throughput import prepare_workload
    from zipage.bench.workloads import peak_kv_demand

    rates = _rates(args.rates or "inf")
    _check_workload_options(args, rates)
    sides = _sides(args.sides)
    wargs = _workload_args(args)
    settings, model_dir, load_format, requests, cache_tokens, modes = prepare_workload(wargs)
    step_model = parse_step_model(args.step_model) if args.simulated_step else None
    run = _WorkloadRun(args, wargs, settings, model_dir, load_format, requests, cache_tokens, step_model, rates[0])
    results = {}
    with client_pool() as clients:
        for mode in modes:
            results[mode] = run.mode(mode, clients, sides)
    _print_workload_table(results, sides)
    ratios = _mode_ratios(results)
    if ratios:
        print("ratios:", {k: round(v, 2) for k, v in ratios.items()})
    lengths = [r.max_tokens for r in requests]
    result = {"benchmark": "serving", "model": args.model or args.shape, "settings": run.settings(),
              "workload": dict(name=args.workload, seed=wargs.seed, scale=settings["scale"], requests=len(requests),
                               samples_per_prompt=wargs.samples_per_prompt, cache_tokens=cache_tokens,
                               peak_kv_demand=peak_kv_demand(requests), output_tokens=sum(lengths),
                               mean_prompt=sum(len(r.prompt) for r in requests) / len(requests),
                               request_lengths=[[len(r.prompt), r.max_tokens] for r in requests]),
              "modes": results, "ratios": ratios}
    if args.out:
        write_json(os.path.join(args.out, "serving.json"), result)
    return 0 if all(r[side]["failed"] == 0 for r in results.values() for side in sides) else 1


def _mode_ratios(results: dict) -> dict:
    """Each Zipage mode's tokens/s over the first full-KV mode's, online and offline."""
    full = next((m for m in results if m.split("+")[0] == "full"), None)
    return {f"{m}_over_{full}_{side}": results[m][side]["output_tokens_per_s"] / results[full][side][
            "output_tokens_per_s"] for m in results if full and m.split("+")[0] == "zipage"
            for side in SIDES if side in results[m]}


class _WorkloadRun:
    """One workload's runs: per mode, through the server and offline, each on a fresh engine."""

    def __init__(self, args, wargs, settings, model_dir, load_format, requests, cache_tokens, step_model, rate):
        from zipage.bench.throughput import request_params

        self.args, self.wargs, self.step_model, self.rate = args, wargs, step_model, rate
        self.build = (settings, model_dir, load_format, requests, cache_tokens)
        self.requests = requests
        self.params = [request_params(wargs, i, r) for i, r in enumerate(requests)]
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def settings(self) -> dict:
        return dict(rate="inf" if math.isinf(self.rate) else self.rate, temperature=self.wargs.temperature,
                    simulated_step=self.step_model, timeout=self.args.timeout,
                    **{k: getattr(self.args, k) for k in ("stream_interval", "switch_interval")})

    def mode(self, mode: str, clients, sides=("online", "offline")) -> dict:
        """``mode``'s runs, each on a fresh engine: ``online`` through the server, ``offline`` as
        ``LLM.generate`` steps it, ``offline-streamed`` offline with every request streamed."""
        from zipage.bench.throughput import free_device_memory

        result = {}
        for side in sides:
            print(f"  {mode}: {'through the server' if side == 'online' else side} ...", flush=True)
            if side == "online":
                result[side], result["options"] = self._online(mode, clients)
            else:
                result[side], result["options"] = self._offline(mode, stream=side == "offline-streamed")
            free_device_memory()
            print(f"  {mode}: {result[side]['output_tokens_per_s']:,.0f} tokens/s {side}", flush=True)
        if "online" in result and "offline" in result:
            result["online_over_offline"] = (result["online"]["output_tokens_per_s"]
                                             / result["offline"]["output_tokens_per_s"])
        return result

    def _engine(self, mode: str, in_process: bool = False):
        """A fresh engine of ``mode``, warmed up as bench throughput's (``in_process``: built and
        warmed up in an ``EngineProcess``), and its options."""
        import torch

        from zipage.bench.throughput import engine_kwargs, kv_dtype
        from zipage.server.engine_process import EngineProcess

        settings, model_dir, load_format, requests, cache_tokens = self.build
        dtype = torch.bfloat16 if self.step_model else kv_dtype(self.wargs)  # a simulated step is a GPU's
        kwargs, opts = engine_kwargs(mode, self.wargs, settings, model_dir, requests, cache_tokens, dtype)
        build = (model_dir, kwargs, load_format, self.step_model, self.wargs.tensor_parallel_size, opts, requests)
        if in_process:
            return EngineProcess(_warmed_engine, build), opts
        return _off_main_thread(_warmed_engine, *build), opts

    def _online(self, mode: str, clients) -> tuple[dict, dict]:
        from zipage.server.background import ServerThread

        engine, opts = self._engine(mode, in_process=self.args.engine_process)
        try:
            app = _app(engine, self.args)
            with ServerThread(app) as server:
                call = app.state.engine.call_engine_threadsafe
                _warm_clients(clients, server.url, BENCH_MODEL, self.headers)
                bodies = [stream_body(BENCH_MODEL, r.prompt, p) for r, p in zip(self.requests, self.params)]
                at = arrivals(self.rate, len(bodies), np.random.default_rng(self.wargs.seed))
                steps, host_s, modelled = call(_step_counters)
                row = clients.submit(run_rate_sync, server.url, bodies, at, self.args.timeout,
                                     self.headers).result()
                steps_now, host_now, modelled_now = call(_step_counters)
                row["engine_steps"] = steps_now - steps
                row["engine_steps_per_s"] = row["engine_steps"] / row["duration_s"]
                row["host_ms_per_step"] = 1000 * (host_now - host_s) / max(row["engine_steps"], 1)
                row["step_gaps"] = call(step_gaps, row["engine_steps"])
                if modelled is not None:
                    row["modelled_ms_per_step"] = (modelled_now - modelled) / max(row["engine_steps"], 1)
        finally:
            engine.close()
        return row, opts

    def _offline(self, mode: str, stream: bool = False) -> tuple[dict, dict]:
        engine, opts = self._engine(mode)
        try:
            return _off_main_thread(offline_run, engine, self.requests, self.params, stream), opts
        finally:
            engine.close()


def _warmed_engine(model_dir: str, kwargs: dict, load_format: str, step_model: dict | None,
                   tensor_parallel_size: int, opts: dict, requests):
    """An engine for a workload run (simulated with ``step_model``), warmed up as bench throughput's."""
    from zipage.bench.throughput import warm_up

    if step_model is not None:
        engine = simulated_engine(model_dir, kwargs, step_model, tensor_parallel_size)
    else:
        engine = _engine(model_dir, dict(kwargs, load_format=load_format))
    warm_up(engine, engine.runner, opts, requests)
    return engine


def _step_counters(engine) -> tuple[int, float, float | None]:
    """The engine's steps and host seconds so far, and the simulated runner's clock if any."""
    return engine.stats.num_steps, engine.stats.host_s, _runner_clock_ms(engine)


def _off_main_thread(fn, *args):
    """``fn(*args)`` on a thread of its own, as the server steps its engine: on a 2-core CPU, torch
    ran the tiny model's steps several times slower on the main thread than on another one."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(fn, *args).result()


def offline_run(engine, requests, params, stream: bool = False) -> dict:
    """Step the engine in a loop over ``requests`` (as ``LLM.generate``, or with every request
    streamed); tokens/s and each request's lengths."""
    index = {engine.add_request(r.prompt, p, stream=stream): i for i, (r, p) in enumerate(zip(requests, params))}
    lengths: list = [[len(r.prompt), 0] for r in requests]
    failed, steps, host_s = 0, engine.stats.num_steps, engine.stats.host_s
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step()[0]:
            lengths[index[output.request_id]][1] += len(output.outputs[0].token_ids) if stream else 0
            if output.finished:
                if not stream:
                    lengths[index[output.request_id]][1] = len(output.outputs[0].token_ids)
                failed += output.outputs[0].finish_reason == "error"
    duration = time.perf_counter() - start
    tokens = sum(n for _, n in lengths)
    steps = engine.stats.num_steps - steps
    return dict(num_requests=len(requests), completed=len(requests) - failed, failed=failed, duration_s=duration,
                requests_per_s=(len(requests) - failed) / duration, output_tokens=tokens,
                output_tokens_per_s=tokens / duration, engine_steps=steps, engine_steps_per_s=steps / duration,
                host_ms_per_step=1000 * (engine.stats.host_s - host_s) / max(steps, 1),
                step_gaps=step_gaps(engine, steps), request_lengths=lengths)


def step_gaps(engine, num_steps: int) -> dict:
    """The times between the last ``num_steps`` steps' ends (ms): median, p99, max, and the seconds
    by which gaps longer than twice the median exceeded it (stalls)."""
    steps = list(engine.stats.occupancy)[-num_steps:]
    times = np.array([t for t, _, _ in steps])
    gaps = np.diff(times) * 1000
    if len(gaps) == 0:
        return {}
    median = float(np.median(gaps))
    long = gaps[gaps > 2 * median]
    return dict(p50_ms=median, p99_ms=float(np.percentile(gaps, 99)), max_ms=float(gaps.max()),
                num_steps=len(gaps) + 1, stall_s=float((long - median).sum()) / 1000, num_stalls=int(len(long)),
                timeline=[[round(t - times[0], 4), running] for t, _, running in steps])


def _print_workload_table(results: dict, sides=("online", "offline")) -> None:
    rows = []
    for mode, r in results.items():
        row = {"mode": mode}
        for side in sides:
            row[f"{side}_tok/s"] = r[side]["output_tokens_per_s"]
        if "online_over_offline" in r:
            row["online/offline"] = r["online_over_offline"]
        if "online" in sides:
            row.update({f"{name}_{q}_ms": _ms_value(r["online"][f"{name}_s"][q])
                        for name in ("ttft", "itl") for q in ("p50", "p99")})
        for side in sides:
            row[f"steps/s_{side}"] = r[side]["engine_steps_per_s"]
            row[f"host_ms/step_{side}"] = r[side]["host_ms_per_step"]
        row["failed"] = sum(r[side]["failed"] for side in sides)
        rows.append(row)
    print()
    print_table(rows, list(rows[0]) if rows else [])


# -- servers and engines -----------------------------------------------------------------------
def _app(engine, args):
    from zipage.server.app import create_app

    options = {k: getattr(args, k) for k in ("stream_interval", "switch_interval") if getattr(args, k) is not None}
    return create_app(engine, BENCH_MODEL, api_key=args.api_key, max_queued_requests=10**6, **options)


def _start_server(args):
    """Build the engine (in a process of its own with ``--engine-process``) and serve it on a free
    loopback port of this process. The server returned has ``call_engine(fn, *args)``: ``fn(engine,
    *args)`` run between the engine's steps (``fn`` module-level, for an engine process)."""
    from zipage.bench.replay import parse_step_model
    from zipage.cli import engine_kwargs
    from zipage.server.background import ServerThread
    from zipage.server.engine_process import EngineProcess

    model_dir, load_format = model_dir_for(args.model, args.shape, args.arch)
    kwargs = engine_kwargs(args)
    if load_format == "dummy":
        kwargs["load_format"] = "dummy"
    if args.simulated_step:
        factory, factory_args = simulated_engine, (model_dir, kwargs, parse_step_model(args.step_model),
                                                   args.tensor_parallel_size)
    else:
        factory, factory_args = _engine, (model_dir, kwargs)
    engine = EngineProcess(factory, factory_args) if args.engine_process else factory(*factory_args)
    try:
        app = _app(engine, args)
        server = ServerThread(app)
    except BaseException:
        if args.engine_process:
            engine.close()
        raise
    vocab_size = args.vocab_size or engine.vocab_size
    described = {k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v) for k, v in kwargs.items()}
    server.call_engine = app.state.engine.call_engine_threadsafe
    described_server = {"in_process": args.model or args.shape, "engine_process": args.engine_process,
                        "device": str(engine.config.device), "engine": described,
                        "stream_interval": app.state.engine.stream_interval,
                        "switch_interval": app.state.engine.switch_interval}
    if args.simulated_step:
        described_server["simulated_step"] = server.call_engine(_step_model)
    return server, vocab_size, described_server


def _engine(model_dir: str, kwargs: dict):
    from zipage import LLM
    return LLM(model_dir, **kwargs).engine


def simulated_engine(model_dir: str, kwargs: dict, step_model: dict, tensor_parallel_size: int = 1,
                     token_range: int | None = None):
    """An engine whose runner sleeps for a step model's time instead of running the model
    (``token_range``: its random tokens are ids below this; default: the whole vocabulary)."""
    from zipage.bench.replay import SimulatedRunner
    from zipage.bench.throughput import rank_spec
    from zipage.config import EngineConfig
    from zipage.engine.llm_engine import LLMEngine

    config = EngineConfig.from_kwargs(model_dir, **dict(kwargs, device="cpu", load_format="auto"))
    spec = rank_spec(model_dir, tensor_parallel_size)
    # The defaults the engine fills from the model (max_model_len): the runner sizes its cache by them.
    config.resolve(spec.max_position)
    runner = SimulatedRunner(config, spec, step_model, sleep=True, token_range=token_range)
    return LLMEngine(config, runner=runner)


def _step_model(engine) -> dict:
    return engine.runner.model


def _runner_clock_ms(engine) -> float | None:
    """The simulated runner's clock, if the engine has one."""
    runner = getattr(engine, "runner", None)
    if getattr(runner, "sleep", False):
        return runner.decode_ms + runner.prefill_ms
    return None


def _ms_value(seconds):
    return None if seconds is None else 1000 * seconds


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"
