"""``zipage bench replay``: the throughput workload through the real scheduler, timed by a model.

The engine runs unchanged (scheduler, block manager, compression planning, preemption,
prefix cache) but its runner does no arithmetic: it returns a fixed token and adds the
modelled time of the step to a clock. A decode step costs
``a + b * running requests + c * cached tokens read`` and a prefill step
``p0 + p1 * prompt tokens``. A compression batch costs ``f + g * tokens compressed``
(thousands), charged to the decode step it overlaps (asynchronous) or added to the clock
(synchronous); the default coefficients take it as hidden (f = g = 0). The default coefficients were fitted to the 23,699 decode steps of
a full-KV reasoning-8k run on an H200 (Qwen3-8B shape, bf16), whose step count,
prefill tokens and preemptions a replay reproduces exactly and whose wall time it
matches within 0.1%; see docs/benchmarks.md.

It answers in seconds on a CPU what a GPU run would take minutes for: how long a
run will be (to size a device call), and how scheduling choices (hybrid scheduling,
budget, block size) change the step count and batch sizes. It measures nothing on a GPU:
its tokens/s are predictions that hold only as far as the step model does.

With ``--replicas`` it runs the workload on N such engines behind the router of the
data-parallel server (``zipage.bench.replicas``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass

import torch

from zipage.bench.common import print_table

# ms: decode = a + b * requests + c * (cached tokens / 1000); prefill = p0 + p1 * tokens;
# a compression batch: f + g * (tokens compressed / 1000)
H200_QWEN3_8B = dict(a=6.47, b=0.0164, c=0.0348, p0=2.0, p1=0.0354, f=0.0, g=0.0)
STEP_MODEL_KEYS = ("a", "b", "c", "p0", "p1", "f", "g")
# Torch calls of a GPU decode step, each of which lets go of the GIL for a moment: the input
# copies, the graph's buffer copies and replay, the sampler's kernels.
LAUNCHES_PER_STEP = 24


@dataclass
class SimulatedStep:
    """A launched step of ``SimulatedRunner``: its tokens, ready at ``ready_at`` (perf_counter seconds)."""

    seqs: list
    token_ids: list[int]
    ready_at: float


class SimulatedRunner:
    """The runner interface of ``LLMEngine`` with a clock instead of a GPU.

    With ``sleep`` a step also takes its modelled time, as a GPU step does to a Python
    thread: ``LAUNCHES_PER_STEP`` brief releases of the GIL (kernel launches and copies),
    then the device computes while the thread goes on; reading the tokens waits, with the
    GIL released, until the step is done. The device runs one step at a time, so a step
    launched before the previous one is done starts when it ends. Its tokens are random
    ids, as a model with random weights samples (ids below ``token_range``: by default
    the whole vocabulary). ``time_scale`` multiplies the time slept (not the clock); at 0 a
    step has no launches either, as if the device were infinitely fast. That reproduces on
    a CPU how a GPU engine shares the interpreter with other threads (the server's event
    loop), with or without asynchronous scheduling.
    """

    trace = None
    supports_async_scheduling = True  # ``launch`` / ``collect``, as the model runner

    def __init__(self, config, spec, step_model: dict, sleep: bool = False, token_range: int | None = None):
        from zipage.runner.kv_cache import plan_cache

        sched, cache = config.scheduler, config.cache
        max_blocks_per_seq = -(-sched.max_model_len // cache.block_size)
        # As a GPU engine sizes its cache (bf16): "meta" is neither the CPU nor a GPU.
        self.num_blocks, self.num_query_slots = plan_cache(
            spec, cache, config.compression, torch.bfloat16, torch.device("meta"), sched.max_num_seqs,
            max_blocks_per_seq)
        self.vocab_size = spec.vocab_size
        if token_range is not None and not 1 <= token_range <= self.vocab_size:
            raise ValueError(f"token_range must be in [1, {self.vocab_size}], got {token_range}")
        self.token_range = token_range or self.vocab_size
        self.model = step_model
        self.sleep = sleep
        self.time_scale = 1.0
        self._rng = random.Random(0)
        self._device_free_at = 0.0  # perf_counter time the last launched step ends
        self.decode_ms = self.prefill_ms = self.compression_ms = 0.0  # the clock, by kind of work
        self.pending_compression_ms = 0.0  # asynchronous compressions' cost, charged to the next decode step
        self.compression_cost_ms = 0.0  # every compression's cost, however charged
        self.last_prepare_s = 0.0

    def execute(self, seqs, is_prefill: bool, eos_token_ids, async_callback=None) -> list[int]:
        step = self.launch(seqs, is_prefill, eos_token_ids)
        if async_callback is not None:
            async_callback()  # while the "device" runs the step
        return self.collect(step)

    def launch(self, seqs, is_prefill: bool, eos_token_ids, previous: SimulatedStep | None = None) -> SimulatedStep:
        """Start a step: charge its time to the clock and, with ``sleep``, to the device's queue
        (which orders it after ``previous``, the step in flight)."""
        seconds = self._charge(seqs, is_prefill) / 1000 * self.time_scale
        ready_at = 0.0
        if self.sleep and seconds:
            start = _launch_like_a_device()
            ready_at = self._device_free_at = max(start, self._device_free_at) + seconds
        sampled = [seq for seq in seqs if seq.samples]  # an earlier chunk of a prompt yields no token
        return SimulatedStep(sampled, self._tokens(len(sampled), eos_token_ids), ready_at)

    def collect(self, step: SimulatedStep) -> list[int]:
        """The step's tokens, once the device has made them (the wait releases the GIL, as ``.tolist()``)."""
        if self.sleep:
            time.sleep(max(0.0, step.ready_at - time.perf_counter()))
        return step.token_ids

    def forget(self, seqs) -> None:
        pass  # no per-request state

    def _charge(self, seqs, is_prefill: bool) -> float:
        """The step's modelled milliseconds, added to the clock."""
        m = self.model
        decodes = [seq for seq in seqs if seq.chunk is None]
        step = 0.0
        if is_prefill:  # prompt chunks (beside the decodes, with chunked prefill)
            prefill = m["p1"] * sum(seq.chunk[1] for seq in seqs if seq.chunk is not None)
            prefill += 0.0 if decodes else m["p0"]
            self.prefill_ms += prefill
            step += prefill
        if decodes:
            cached = sum(seq.kv_len + 1 for seq in decodes)
            decode = m["a"] + m["b"] * len(decodes) + m["c"] * cached / 1000 + self.pending_compression_ms
            self.pending_compression_ms = 0.0
            self.decode_ms += decode
            step += decode
        return step

    def _tokens(self, count: int, eos_token_ids) -> list[int]:
        if not self.sleep:  # a replay: any token but EOS (its requests ignore EOS anyway)
            return [1 if 1 not in eos_token_ids else 2] * count
        # Random weights' tokens, none an EOS (a named shape's small tokenizer knows few of the ids).
        return [t if t not in eos_token_ids else 2 for t in
                (self._rng.randrange(self.token_range) for _ in range(count))]

    def _compression_cost_ms(self, tasks) -> float:
        cost = self.model["f"] + self.model["g"] * sum(t.num_tokens for t in tasks) / 1000
        self.compression_cost_ms += cost
        return cost

    def compress(self, tasks) -> None:
        self.compression_ms += self._compression_cost_ms(tasks)

    def start_compression(self, tasks):
        self.pending_compression_ms += self._compression_cost_ms(tasks)
        return tasks

    @staticmethod
    def compression_done(handle, wait: bool = False) -> bool:
        return True  # done by the next step: compression hides under decode steps on the GPU

    def close(self) -> None:
        pass


def _launch_like_a_device() -> float:
    """A GPU step's launches as its Python thread lives them (each lets go of the GIL for a
    moment, as ``time.sleep`` does even for 0 s); return when the forward starts."""
    half = LAUNCHES_PER_STEP // 2
    for _ in range(half):  # the input copies
        time.sleep(0)
    start = time.perf_counter()  # the forward is queued
    for _ in range(LAUNCHES_PER_STEP - half):  # the sampler's kernels, queued behind it
        time.sleep(0)
    return start


def build_replay_engine(mode: str, args, settings: dict, model_dir: str, requests, cache_tokens: int,
                        step_model: dict, runner_class=None):
    """An engine of ``mode`` driving a simulated runner (``runner_class``, default ``SimulatedRunner``)
    whose KV cache holds ``cache_tokens``; returns (engine, runner, the mode's options)."""
    from zipage.bench.throughput import engine_kwargs, rank_spec
    from zipage.config import EngineConfig
    from zipage.engine.llm_engine import LLMEngine

    kwargs, opts = engine_kwargs(mode, args, settings, model_dir, requests, cache_tokens, torch.bfloat16)
    config = EngineConfig.from_kwargs(model_dir, **dict(kwargs, device="cpu", load_format="auto"))
    spec = rank_spec(model_dir, args.tensor_parallel_size)
    runner = (runner_class or SimulatedRunner)(config, spec, step_model)
    return LLMEngine(config, runner=runner), runner, opts


def replay_params(index: int, request):
    """The sampling parameters of a replay's ``index``-th request (EOS ignored, seeded by its index)."""
    from zipage.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True, seed=index)


def busy_seconds(runner: SimulatedRunner) -> float:
    """The modelled seconds a runner's steps took (its clock)."""
    return (runner.decode_ms + runner.prefill_ms + runner.compression_ms) / 1000


def finish_replay(mode: str, engine, runner: SimulatedRunner) -> None:
    """Check that every KV block came back, and charge a last compression no decode step overlapped."""
    bm = engine.block_manager
    if bm.num_free_blocks != bm.num_blocks:
        raise RuntimeError(f"{mode}: {bm.num_blocks - bm.num_free_blocks} KV blocks were not returned")
    runner.compression_ms += runner.pending_compression_ms
    runner.pending_compression_ms = 0.0


def replay_mode(mode: str, args, settings: dict, model_dir: str, requests, cache_tokens: int,
                step_model: dict) -> dict:
    from zipage.bench.throughput import abort_unfinished

    engine, runner, opts = build_replay_engine(mode, args, settings, model_dir, requests, cache_tokens, step_model)
    request_ids = [engine.add_request(r.prompt, replay_params(i, r)) for i, r in enumerate(requests)]
    steps = batch_sum = outputs = preempted = 0
    truncated_at = None
    while engine.has_unfinished_requests():
        finished, stats = engine.step()
        outputs += sum(len(o.outputs[0].token_ids) for o in finished)
        clock = busy_seconds(runner)
        if args.max_seconds is not None and truncated_at is None and clock >= args.max_seconds:
            truncated_at = clock
            outputs += abort_unfinished(engine, request_ids)
        if stats is None:  # nothing launched: the step in flight was collected
            continue
        preempted += stats.num_preempted
        if not stats.is_prefill:
            steps += 1
            batch_sum += stats.num_seqs
    finish_replay(mode, engine, runner)
    seconds = busy_seconds(runner)
    return dict(mode=mode, options=opts, requests=len(requests), output_tokens=outputs, model_s=seconds,
                truncated_at_s=truncated_at,
                tokens_per_s=outputs / seconds, decode_steps=steps, mean_batch=batch_sum / max(steps, 1),
                prefill_s=runner.prefill_ms / 1000, compression_s=runner.compression_cost_ms / 1000,
                num_preemptions=preempted,
                num_compressions=engine.stats.num_compressions, num_blocks=runner.num_blocks,
                query_slots=runner.num_query_slots)


def add_replay_parser(sub) -> None:
    from zipage.bench.throughput import add_workload_args

    p = sub.add_parser("replay", help="the throughput workload through the real scheduler, timed by a step "
                                      "model (CPU, seconds)")
    add_workload_args(p)
    p.add_argument("--step-model", default=None,
                   help="a,b,c,p0,p1[,f,g] in ms (decode a + b*requests + c*cached/1000; prefill p0 + "
                        "p1*tokens; a compression batch f + g*tokens/1000, default 0: hidden); default: fitted on "
                        "an H200 with the Qwen3-8B shape")
    p.add_argument("--out", default=None, help="directory for replay.json (with --replicas: replicas.json and "
                                                "replicas.png)")
    g = p.add_argument_group("data-parallel replicas", "the workload served by N replicas (one GPU each, the same "
                             "KV cache cap each) behind a router; per mode, count and policy: tokens/s, latency, "
                             "time to first token, prefix cache hit rate, scaling efficiency against one")
    g.add_argument("--replicas", default=None, help="comma-separated replica counts, e.g. 1,2,4,8,16")
    g.add_argument("--routing", default="prefix,load",
                   help="comma-separated routing policies of zipage.routing: prefix, load, round_robin")
    g.add_argument("--arrival-rate", type=float, default=None,
                   help="requests a second, arriving as a Poisson process (each prompt's samples together); "
                        "default: all at t = 0")
    g.add_argument("--weak-scaling", action="store_true",
                   help="N replicas serve N times the workload (and N times --arrival-rate); default: the same "
                        "workload for every N")
    p.set_defaults(func=run_replay_bench)


def parse_step_model(text: str | None) -> dict:
    if text is None:
        return dict(H200_QWEN3_8B)
    values = text.split(",")
    if len(values) not in (5, 7):
        raise ValueError(f"--step-model needs 5 or 7 comma-separated numbers a,b,c,p0,p1[,f,g], got {text!r}")
    try:
        numbers = [float(v) for v in values]
    except ValueError:
        raise ValueError(f"--step-model needs numbers, got {text!r}") from None
    if any(v < 0 for v in numbers):
        raise ValueError(f"--step-model coefficients must be >= 0, got {text!r}")
    return dict(zip(STEP_MODEL_KEYS, numbers + [0.0] * (7 - len(numbers))))


def run_replay_bench(args: argparse.Namespace) -> int:
    from zipage.bench.throughput import prepare_workload

    step_model = parse_step_model(args.step_model)
    if args.whole_gpu:
        raise ValueError("bench replay has no GPU to size the cache from: give --kv-cache-tokens instead of "
                         "--whole-gpu")
    settings, model_dir, _, requests, cache_tokens, modes = prepare_workload(args)
    if args.replicas is not None or args.arrival_rate is not None:
        from zipage.bench.replicas import run_replicas_bench
        if args.max_seconds is not None:
            raise ValueError("--max-seconds does not apply to a replica replay, which runs every request")
        return run_replicas_bench(args, settings, model_dir, requests, cache_tokens, modes, step_model)
    rows = [replay_mode(mode, args, settings, model_dir, requests, cache_tokens, step_model) for mode in modes]
    print()
    print_table(rows, ["mode", "tokens_per_s", "model_s", "decode_steps", "mean_batch", "prefill_s",
                       "num_preemptions", "num_compressions", "num_blocks", "query_slots"])
    full = next((r for r in rows if r["mode"].split("+")[0] == "full"), None)
    ratios = {f"{r['mode']}_over_{full['mode']}": r["tokens_per_s"] / full["tokens_per_s"]
              for r in rows if full and r["mode"].split("+")[0] == "zipage"}
    if ratios:
        print("predicted ratios:", {k: round(v, 2) for k, v in ratios.items()})
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "replay.json"), "w") as f:
            json.dump(dict(benchmark="replay", workload=args.workload, settings=settings, step_model=step_model,
                           modes={r["mode"]: r for r in rows}, ratios=ratios), f, indent=1)
    return 0

