"""``zipage bench host``: the server's host CPU per engine step, against the streams' output length.

Each output length gets a fresh server (in this process, on a free loopback port) whose
engine runs no model: a step takes the H200 Qwen3-8B step model's time with the GIL
released, as a GPU step does (``bench serve --simulated-step``). ``--streams`` streamed
completions of that length start at once, with stop strings on, sampling random ids that
the tokenizer turns into text, so that every token goes through incremental detokenization
and the stop-string search. The process's CPU time (``time.process_time``: engine thread,
event loop, HTTP; the clients run in a child process) over a window of decode steps is
host work, since the simulated device sleeps; so is the engine's own ``StepStats.host_s``
(wall time, so it also counts waits for the GIL). Host work per step that grew with the
output would show as more CPU per step at a longer length. Garbage collection is timed
apart: a full collection walks every live object, the streams' tokens among them.

The window sits just before the streams end (``--window-steps`` decode steps, then
``TAIL_STEPS`` more), where the streams are longest. The steps before it fast-forward: no
device time and a stream interval of ``FAST_FORWARD_INTERVAL_S``. They build up the streams'
state as the engine alone takes them, instead of 32K modelled steps with a chunk per stream
each (a stream's chunks still grow in number with its length, so state kept per chunk would
still show). ``SETTLE_STEPS`` steps at the modelled pace and stream interval come before the
window, for the event loop and the clients to catch up. A step's device time is the step
model's at a fixed context per stream (``--context``), the same at every length: a longer
step would change how many chunks a step sends (a stream's go out at most every stream
interval).

Sizing: the fast-forward takes what the server's host work per token takes (on a 2-core CPU,
about 100 us of CPU per token at 256 streams), so 256 streams of 1K, 4K, 16K and 32K tokens
took 24 minutes there, half of it garbage collection at 32K; the default of 64 streams takes
about 4.5 minutes. ``--streams 256`` is for a larger host.

A command of its own rather than an option of ``bench serve``: its workload (equal streams,
one run per length, a measured window) and its numbers (CPU per step and per token, not
latencies per rate) share nothing with serve's but the server and the clients, which it
takes from ``serving.py``.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import numpy as np

from zipage.bench.common import model_dir_for, print_table, write_json

# A stop string random text never completes, and a short one (searched for at every step all the same).
STOP_STRINGS = ["never appears in random text", "\u2603\u2603"]
TAIL_STEPS = 16  # decode steps after the window: the streams' ends are not steady
SETTLE_STEPS = 32  # modelled steps before the window, after the fast-forward
BLOCK_SIZE = 256
FAST_FORWARD_INTERVAL_S = 0.5  # the server's stream interval before the window
COLUMNS = ["output_len", "streams", "window_steps", "cpu_ms_per_step", "cpu_us_per_token", "host_ms_p50",
           "gc_ms_per_step", "full_collections", "wall_ms_per_step", "client_itl_p50_ms", "min_running", "run_s", "run_cpu_s", "run_gc_s", "run_full_collections"]


def add_host_parser(sub) -> None:
    p = sub.add_parser("host", help="the server's host CPU per engine step against the output length "
                                    "(simulated GPU step; CPU)")
    p.add_argument("--output-lens", default="1024,4096,16384,32768", help="output tokens per stream, comma-separated")
    p.add_argument("--streams", type=int, default=64, help="concurrent streamed requests (256: a larger host's)")
    p.add_argument("--window-steps", type=int, default=256, help="decode steps measured per length")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (random ids)")
    p.add_argument("--context", type=int, default=2048,
                   help="cached tokens per stream the modelled step reads (default: Zipage's standard budget)")
    p.add_argument("--step-model", default=None,
                   help="a,b,c,p0,p1 in ms as for bench replay (default: the H200 Qwen3-8B fit)")
    p.add_argument("--kv-budget-tokens", type=int, default=None, help="compress at this budget (default: full KV)")
    p.add_argument("--stream-interval", type=float, default=None,
                   help="the server's seconds between a stream's chunks (default: zipage serve's)")
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--out", default=None, help="directory for host.json")
    p.set_defaults(func=run_host_bench)


def _lengths(text: str, minimum: int) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--output-lens must be comma-separated integers, got {text!r}") from None
    if not lengths or min(lengths) < minimum:
        raise ValueError(f"--output-lens must each be >= {minimum} (--window-steps + {SETTLE_STEPS + TAIL_STEPS + 2}), "
                         f"got {text!r}")
    return lengths


def fixed_step_model(step_model: dict, streams: int, context: int) -> dict:
    """The step model with its KV term taken at ``context`` tokens per stream, whatever the streams hold."""
    return dict(step_model, a=step_model["a"] + step_model["c"] * streams * context / 1000, c=0.0)


class GcClock:
    """Time spent in garbage collection, and full collections, while installed (``gc.callbacks``):
    a full collection walks every live object, the streams' tokens among them."""

    def __init__(self):
        self.seconds, self.full_collections, self._start = 0.0, 0, None
        gc.callbacks.append(self._hook)

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.full_collections += info["generation"] == 2

    def read(self) -> tuple[float, int]:
        return self.seconds, self.full_collections

    def remove(self) -> None:
        gc.callbacks.remove(self._hook)


class StepMeter:
    """Wraps an engine's ``step`` (called on the engine thread): fast-forwards (no device time, few
    chunks) but for a window of decode steps, and reads the process's CPU clock around that window."""

    def __init__(self, engine, server, first: int, last: int):
        self.engine, self.server, self.step = engine, server, engine.step
        self.first, self.last = first, last  # the window: decode steps first + 1 .. last
        self.stream_interval = server.stream_interval
        self.decode_steps = 0
        self.host_s = np.zeros(last - first)
        self.running = np.zeros(last - first, dtype=int)
        self.cpu, self.wall, self.gc = [], [], []  # at the window's start and end
        self.gc_clock = GcClock()
        self._pace(modelled=False)
        engine.step = self

    def _pace(self, modelled: bool) -> None:
        """The modelled step time and the server's stream interval, or no device time and few chunks."""
        self.engine.runner.time_scale = 1.0 if modelled else 0.0
        self.server.stream_interval = self.stream_interval if modelled else FAST_FORWARD_INTERVAL_S

    def __call__(self, *args, **kwargs):
        outputs, stats = self.step(*args, **kwargs)
        if stats is None or stats.is_prefill:
            return outputs, stats
        self.decode_steps += 1
        k = self.decode_steps
        if k == self.first - SETTLE_STEPS:
            self._pace(modelled=True)
        elif self.first < k <= self.last:
            self.host_s[k - self.first - 1] = stats.host_s
            self.running[k - self.first - 1] = stats.num_seqs
        if k in (self.first, self.last):
            self.cpu.append(time.process_time())
            self.wall.append(time.perf_counter())
            self.gc.append(self.gc_clock.read())
        if k == self.last:
            self._pace(modelled=False)  # the tail
        return outputs, stats

    def result(self) -> dict:
        """The window's numbers, and the whole run's garbage collection."""
        self.gc_clock.remove()
        if len(self.cpu) < 2:
            raise RuntimeError(f"the window (decode steps {self.first + 1}-{self.last}) was not reached: "
                               f"{self.decode_steps} decode steps ran")
        steps = self.last - self.first
        cpu, wall = self.cpu[1] - self.cpu[0], self.wall[1] - self.wall[0]
        (gc_start, full_start), (gc_end, full_end) = self.gc
        return dict(window_steps=steps, cpu_ms_per_step=1000 * cpu / steps, wall_ms_per_step=1000 * wall / steps,
                    cpu_us_per_token=1e6 * cpu / int(self.running.sum()),
                    gc_ms_per_step=1000 * (gc_end - gc_start) / steps, full_collections=full_end - full_start,
                    host_ms_p50=1000 * float(np.median(self.host_s)), min_running=int(self.running.min()),
                    run_gc_s=self.gc_clock.seconds, run_full_collections=self.gc_clock.full_collections)


def run_length(length: int, args, model_dir: str, step_model: dict, clients) -> dict:
    """Serve ``args.streams`` streams of ``length`` tokens; the window's numbers."""
    import torch

    from zipage import SamplingParams
    from zipage.bench.serving import run_rate_sync, simulated_engine, stream_body
    from zipage.bench.throughput import kv_bytes_per_token, rank_spec
    from zipage.server.app import create_app
    from zipage.server.background import ServerThread

    max_len = args.prompt_len + length + 1
    # Every stream at full length, and a block each to spare (the simulated device sizes no memory).
    cache_bytes = args.streams * (-(-max_len // BLOCK_SIZE) + 1) * BLOCK_SIZE * kv_bytes_per_token(
        rank_spec(model_dir, 1), torch.bfloat16)
    kwargs = dict(max_num_seqs=args.streams, max_model_len=max_len, block_size=BLOCK_SIZE,
                  kv_cache_memory_bytes=cache_bytes,
                  compression=None if args.kv_budget_tokens is None else {"kv_budget_tokens": args.kv_budget_tokens})
    engine = simulated_engine(model_dir, kwargs, step_model, token_range=len(_tokenizer(model_dir)))
    last = length - 1 - TAIL_STEPS  # decode steps: the prefill makes each stream's first token
    options = {} if args.stream_interval is None else {"stream_interval": args.stream_interval}
    app = create_app(engine, "host", max_queued_requests=10**6, **options)
    meter = StepMeter(engine, app.state.engine, last - args.window_steps, last)
    rng = np.random.default_rng(length)
    params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True, stop=STOP_STRINGS)
    bodies = [stream_body("host", prompt, params)
              for prompt in rng.integers(0, engine.vocab_size, (args.streams, args.prompt_len)).tolist()]
    start, start_cpu = time.perf_counter(), time.process_time()
    with ServerThread(app) as server:
        clients_row = clients.submit(run_rate_sync, server.url, bodies, np.zeros(len(bodies)), 3600.0, {}).result()
    row = dict(output_len=length, streams=args.streams, run_s=time.perf_counter() - start,
               run_cpu_s=time.process_time() - start_cpu, **meter.result())
    expected = args.streams * length
    if clients_row["failed"] or clients_row["output_tokens"] != expected:
        raise RuntimeError(f"output length {length}: {clients_row['failed']} streams failed "
                           f"({clients_row['errors']}), {clients_row['output_tokens']} of {expected} tokens")
    row["client_itl_p50_ms"] = 1000 * clients_row["itl_s"]["p50"]
    return row


def _tokenizer(model_dir: str):
    from zipage.utils.loader import load_tokenizer
    return load_tokenizer(model_dir)


def run_host_bench(args: argparse.Namespace) -> int:
    from zipage.bench.replay import parse_step_model
    from zipage.bench.serving import client_pool
    from zipage.bench.throughput import free_device_memory

    for name in ("streams", "window_steps", "prompt_len", "context"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    lengths = _lengths(args.output_lens, args.window_steps + SETTLE_STEPS + TAIL_STEPS + 2)
    step_model = fixed_step_model(parse_step_model(args.step_model), args.streams, args.context)
    model_dir, _ = model_dir_for(None, args.shape, args.arch)
    rows = []
    with client_pool() as clients:
        for length in lengths:
            rows.append(run_length(length, args, model_dir, step_model, clients))
            free_device_memory()  # the last run's streams, before the next builds its own
            r = rows[-1]
            print(f"  {length} tokens: {r['cpu_ms_per_step']:.2f} ms CPU per step, "
                  f"{r['cpu_us_per_token']:.1f} us per token, engine host {r['host_ms_p50']:.2f} ms "
                  f"({r['run_s']:.0f} s)", flush=True)
    print()
    print_table(rows, COLUMNS)
    step_ms = step_model["a"] + step_model["b"] * args.streams
    print(f"modelled decode step: {step_ms:.1f} ms ({args.streams} streams at {args.context} cached tokens each)")
    if args.out:
        write_json(os.path.join(args.out, "host.json"), dict(
            benchmark="host", shape=args.shape, step_model=step_model, modelled_step_ms=step_ms,
            settings={k: getattr(args, k) for k in ("streams", "window_steps", "prompt_len", "context",
                                                    "kv_budget_tokens", "stream_interval")},
            stop=STOP_STRINGS, lengths=rows))
    return 0
