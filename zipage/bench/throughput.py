"""``zipage bench throughput``: a long-reasoning workload through full KV and Zipage.

The same seeded workload runs through the engine in each mode (and a few of its
requests through HuggingFace ``generate``), with the same KV cache size. Per step
the engine reports what it did; from that come tokens/s, running requests,
block occupancy, compression share, host time, and a roofline: each decode step
must at least move the weights once and every running request's KV, at the
device's copy bandwidth (the measured H200 figure on an H200, else a copy timed at
the start of the run; on a CPU that is a CPU copy, and the output says so).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import time
from dataclasses import replace

import torch

from zipage.bench.common import (check_one_engine_a_process, copy_bandwidth, device_name, model_dir_for, print_table,
                                 run_device, write_json)
from zipage.bench.workloads import WORKLOADS, make_workload, peak_kv_demand, requests_for_demand
from zipage.runner.kv_cache import bytes_per_block

# The KV cache of the standard run: 48 GB of Qwen3-8B KV (144 KiB per token), an 80 GB-class
# card holding an 8B model, as in the paper. Scaled runs scale it with the lengths.
STANDARD_CACHE_TOKENS = 48 * 10**9 // (144 * 1024)

PRESETS = {  # --scale name -> settings for a run that fits a CPU or one short device call
    "small": dict(scale=1 / 64, block_size=16, budget=64, window=8, hf_max_tokens=32),
    "medium": dict(scale=1 / 8, block_size=64, budget=512, window=16, hf_max_tokens=128),
}


def add_throughput_parser(sub) -> None:
    p = sub.add_parser("throughput", help="long-reasoning throughput: full KV against Zipage")
    add_workload_args(p)
    p.add_argument("--hf-requests", type=int, default=4, help="requests run through transformers (0: none)")
    p.add_argument("--hf-max-tokens", type=int, default=None, help="their output cap (default 256)")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="requests per generate call (default: all at once; 1: one request at a time, "
                        "as a script calling generate per prompt does)")
    p.add_argument("--out", default=None, help="directory for throughput.json and throughput.png")
    p.add_argument("--progress-every", type=float, default=30.0, help="seconds between progress lines (0: none)")
    p.set_defaults(func=run_throughput_bench)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload, cache and engine options (shared with ``bench replay``)."""
    from zipage.cli import add_trust_remote_code_arg

    p.add_argument("--model", default=None, help="checkpoint directory (default: --shape with random weights)")
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--workload", default="reasoning-8k", choices=sorted(WORKLOADS))
    p.add_argument("--scale", default="1", help="shrink lengths and cache: a factor, or 'small' / 'medium'")
    p.add_argument("--num-requests", type=int, default=None,
                   help="default: enough that peak KV demand is twice the cache")
    p.add_argument("--samples-per-prompt", type=int, default=1)
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help=f"KV cache size in tokens (default {STANDARD_CACHE_TOKENS} x scale)")
    p.add_argument("--whole-gpu", action="store_true", help="no cache cap: use gpu_memory_utilization")
    p.add_argument("--modes", default="full,zipage",
                   help=f"comma-separated: full or zipage, each with optional +modifiers ({MODIFIERS})")
    p.add_argument("--budget", type=int, default=None, help="Zipage kv_budget_tokens (default 2048)")
    p.add_argument("--block-size", type=int, default=None, help="default 256")
    p.add_argument("--window", type=int, default=None, help="default 16")
    p.add_argument("--redundancy", default="lightning", choices=["lightning", "raw", "off"])
    p.add_argument("--asynchronous", action=argparse.BooleanOptionalAction, default=None,
                   help="compress on a side CUDA stream (default: CompressionConfig's, on)")
    p.add_argument("--no-hybrid", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--piecewise-graph-tokens", type=int, default=None, metavar="N",
                   help="steps with prompt tokens of at most N tokens replay their layers' non-attention parts as "
                        "CUDA graphs (0: eagerly; default: the engine's, 2048 on one GPU; per mode: +pieces=N)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: the same cache bytes hold about twice the tokens")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="fp8 weights, quantized at load")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs per model; the KV cache cap stays the same number of tokens")
    p.add_argument("--all-reduce", default="nccl", choices=["nccl", "one-shot"],
                   help="how tensor-parallel GPUs sum partial outputs (EngineConfig.all_reduce)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    add_trust_remote_code_arg(p)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop each mode after this many seconds of its run (modelled seconds in a replay): "
                        "unfinished requests are aborted, their tokens so far counted, and the result is "
                        "marked truncated (for a run longer than the time one has)")


def workload_defaults() -> argparse.Namespace:
    """The workload, cache and engine options at their defaults (for a benchmark with other options)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_workload_args(parser)
    return parser.parse_args([])


def _settings(args) -> dict:
    preset = PRESETS.get(args.scale, {})
    scale = preset.get("scale") or float(args.scale)
    pick = {k: getattr(args, k, None) for k in ("block_size", "budget", "window", "hf_max_tokens")}
    defaults = dict(block_size=256, budget=2048, window=16, hf_max_tokens=256)
    return dict(scale=scale, **{k: v if v is not None else preset.get(k, defaults[k]) for k, v in pick.items()})


def kv_bytes_per_token(spec, dtype) -> int:
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype.itemsize


def _weight_bytes(model) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    return total - (embed.numel() * embed.element_size() if embed is not model.lm_head.weight else 0)


MODIFIERS = ("sync, async, no-hybrid, no-prefix, raw, no-redundancy, eager, step-sync, no-chunk, budget=N, block=N, "
             "pieces=N (steps with prompt tokens up to N replayed as piecewise CUDA graphs)")


def mode_options(mode: str, args, settings: dict) -> dict:
    """The engine options of a mode: ``full`` or ``zipage``, then ``+modifier``s (an ablation or a sweep
    point), e.g. ``zipage+sync``, ``zipage+budget=1024+block=64``, ``full+eager``."""
    base, *modifiers = mode.split("+")
    if base not in ("full", "zipage"):
        raise ValueError(f"mode {mode!r}: must start with 'full' or 'zipage'")
    from zipage.config import CompressionConfig

    asynchronous = CompressionConfig.asynchronous if args.asynchronous is None else args.asynchronous
    opts = dict(compress=base == "zipage", asynchronous=asynchronous, hybrid=not args.no_hybrid,
                prefix_caching=not args.no_prefix_caching, redundancy=args.redundancy,
                enforce_eager=args.enforce_eager, budget=settings["budget"], block_size=settings["block_size"],
                async_scheduling=True, chunked_prefill=True,
                piecewise_graph_tokens=getattr(args, "piecewise_graph_tokens", None))
    flags = {"sync": ("asynchronous", False), "async": ("asynchronous", True), "no-hybrid": ("hybrid", False),
             "no-prefix": ("prefix_caching", False), "raw": ("redundancy", "raw"),
             "no-redundancy": ("redundancy", "off"), "eager": ("enforce_eager", True),
             "step-sync": ("async_scheduling", False), "no-chunk": ("chunked_prefill", False)}
    for m in modifiers:
        name, _, value = m.partition("=")
        if m in flags:
            key, val = flags[m]
            opts[key] = val
        elif name in ("budget", "block", "pieces") and value.isdigit():
            opts[{"budget": "budget", "block": "block_size", "pieces": "piecewise_graph_tokens"}[name]] = int(value)
        else:
            raise ValueError(f"mode {mode!r}: unknown modifier {m!r}; choose from {MODIFIERS}")
    return opts


def _steady_state(bound: list[float], decode: list[dict]) -> list[tuple[float, dict]]:
    """(bound, step) pairs of the decode steps at steady state: those taken while requests
    waited, i.e. while the cache or the running limit, not the workload, bounded the batch
    (this leaves out the ramp-up before the cache fills and the drain once the queue is
    empty). A workload that never waits has no such phase: then the steps with at least 80%
    of the busiest batch."""
    saturated = [(b, s) for b, s in zip(bound, decode) if s["waiting"]]
    if saturated:
        return saturated
    busiest = max((s["seqs"] for s in decode), default=0)
    return [(b, s) for b, s in zip(bound, decode) if s["seqs"] >= 0.8 * busiest]


def warm_up(engine, runner, opts: dict, requests) -> None:
    """Compile what the run will meet (prefill shapes, compression on both paths) before timing:
    otherwise the first mode of a process pays it. Random prompts, so no prefix-cache hits carry over."""
    from zipage import SamplingParams

    rng = torch.Generator().manual_seed(12345)
    block = opts["block_size"]
    # Long enough to compress a few times (a long prompt's first compression runs eagerly).
    prompt_lens = [block // 2, max(len(r.prompt) for r in requests)]
    max_tokens = (opts["budget"] // block + 3) * block if opts["compress"] else 2 * block
    for n in prompt_lens:
        prompt = torch.randint(0, runner.vocab_size, (n,), generator=rng).tolist()
        room = engine.config.scheduler.max_model_len - n
        engine.add_request(prompt, SamplingParams(max_tokens=min(max_tokens, room), ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def engine_kwargs(mode: str, args, settings: dict, model_dir: str, requests, cache_tokens: int,
                  dtype: torch.dtype) -> tuple[dict, dict]:
    """``LLM`` keyword arguments of a mode (KV cache capped at ``cache_tokens`` of ``dtype`` unless
    --whole-gpu), and the mode's options."""
    from zipage import CompressionConfig

    opts = mode_options(mode, args, settings)
    compression = None
    if opts["compress"]:
        compression = CompressionConfig(kv_budget_tokens=opts["budget"], window=settings["window"],
                                        redundancy=opts["redundancy"], asynchronous=opts["asynchronous"],
                                        hybrid=opts["hybrid"])
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    kwargs = dict(device=args.device, block_size=opts["block_size"],
                  max_num_seqs=args.max_num_seqs, max_model_len=longest + 1, compression=compression,
                  enable_prefix_caching=opts["prefix_caching"], enforce_eager=opts["enforce_eager"],
                  piecewise_graph_tokens=opts["piecewise_graph_tokens"], async_scheduling=opts["async_scheduling"],
                  enable_chunked_prefill=opts["chunked_prefill"], seed=args.seed,
                  tensor_parallel_size=args.tensor_parallel_size, all_reduce=getattr(args, "all_reduce", "nccl"),
                  trust_remote_code=_trust(args),
                  kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                  quantization=getattr(args, "quantization", None))
    if not args.whole_gpu:
        spec = rank_spec(model_dir, args.tensor_parallel_size, _trust(args))
        kwargs["kv_cache_memory_bytes"] = cache_tokens * kv_bytes_per_token(spec, dtype)
    return kwargs, opts


def rank_spec(model_dir: str, tensor_parallel_size: int, trust_remote_code: bool = False):
    """The model's shape as one rank holds it: its share of the KV heads (one when there are fewer)."""
    from zipage.models.registry import spec_from_config
    from zipage.utils.loader import load_config
    spec = spec_from_config(load_config(model_dir, trust_remote_code))
    return replace(spec, num_kv_heads=max(1, spec.num_kv_heads // tensor_parallel_size))


def _trust(args) -> bool:
    return getattr(args, "trust_remote_code", False)


def kv_dtype(args) -> torch.dtype:
    """The KV cache's dtype on the run's device (as the engine's ``dtype="auto"`` picks it for a shape)."""
    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu"
    return torch.bfloat16 if on_gpu else torch.float32


def request_params(args, index: int, request):
    """The sampling parameters of the workload's ``index``-th request (EOS ignored, seeded by its index)."""
    from zipage import SamplingParams
    return SamplingParams(temperature=args.temperature, max_tokens=request.max_tokens, ignore_eos=True,
                          seed=args.seed * 1_000_003 + index)


def free_device_memory() -> None:
    """Collect the engine just dropped and give its device memory back, before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_mode(mode: str, args, settings: dict, model_dir: str, load_format: str, requests, cache_tokens,
             bandwidth: float) -> dict:
    """Serve ``requests`` in one mode; return its metrics and per-step timeline (the roofline at
    ``bandwidth``, bytes read + written per second)."""
    from zipage import LLM

    kwargs, opts = engine_kwargs(mode, args, settings, model_dir, requests, cache_tokens, kv_dtype(args))
    kwargs["load_format"] = load_format
    setup_start = time.perf_counter()
    llm = LLM(model_dir, **kwargs)
    engine, runner = llm.engine, llm.engine.runner
    # One GPU's share, as each rank reads its own at the same time (with tensor parallelism rank 0's
    # KV heads and shards of the weights); float8: the cache's bytes with their scales
    kv_per_token = bytes_per_block(runner.model.local_spec, 1, runner.kv_dtype)
    weight_bytes = _weight_bytes(runner.model)
    warm_up(engine, runner, opts, requests)
    setup_s = time.perf_counter() - setup_start  # engine start (weights, graphs, compiles) and warm-up
    print(f"  {mode}: ready after {setup_s:.0f} s (engine start and warm-up)", flush=True)
    compressions_before = engine.stats.num_compressions
    request_ids = [engine.add_request(r.prompt, request_params(args, i, r)) for i, r in enumerate(requests)]
    trace = runner.enable_trace()
    timeline, outputs = [], 0
    bm = engine.block_manager
    start = time.perf_counter()
    report = Progress(mode, len(requests), args.progress_every)
    completed, truncated_at = 0, None
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        finished, stats = engine.step()
        now = time.perf_counter()
        outputs += sum(len(o.outputs[0].token_ids) for o in finished)
        completed += len(finished)
        if args.max_seconds is not None and truncated_at is None and now - start >= args.max_seconds:
            truncated_at = now - start
            outputs += abort_unfinished(engine, request_ids)
        if stats is None:  # no step launched: only the last one's tokens were collected
            report.finished += len(finished)
            continue
        report.step(now - start, len(finished), stats, engine)
        timeline.append(dict(t=now - start, dt=now - step_start, prefill=stats.is_prefill, seqs=stats.num_seqs,
                             decodes=stats.num_decodes,
                             tokens=stats.num_tokens, host_s=stats.host_s, compression_s=stats.compression_s,
                             kv_tokens=stats.kv_tokens, running=stats.num_running, waiting=stats.num_waiting,
                             preempted=stats.num_preempted,
                             blocks=bm.num_blocks - bm.num_free_blocks))
    wall = time.perf_counter() - start
    decode = [s for s in timeline if not s["prefill"] and s["seqs"]]
    bound = [(weight_bytes + s["kv_tokens"] * kv_per_token) / bandwidth for s in decode]
    decode_time = sum(s["dt"] for s in decode)
    steady = _steady_state(bound, decode)
    total_time = sum(s["dt"] for s in timeline) or 1e-9
    host = sorted(s["host_s"] for s in decode)
    metrics = dict(
        mode=mode, options=opts, requests=len(requests), output_tokens=outputs, wall_s=wall,
        tokens_per_s=outputs / wall, requests_per_s=completed / wall, finished_requests=completed,
        truncated_at_s=truncated_at,
        mean_running=sum(s["running"] * s["dt"] for s in timeline) / total_time,
        peak_running=max(s["running"] for s in timeline), num_blocks=bm.num_blocks,
        mean_block_occupancy=sum(s["blocks"] * s["dt"] for s in timeline) / total_time / bm.num_blocks,
        peak_block_occupancy=max(s["blocks"] for s in timeline) / bm.num_blocks,
        compression_share=sum(s["compression_s"] for s in timeline) / wall,
        num_compressions=engine.stats.num_compressions - compressions_before,
        num_preemptions=sum(s["preempted"] for s in timeline),
        host_ms_per_decode_step=1000 * host[len(host) // 2] if host else None,
        decode_share=decode_time / wall,
        roofline_fraction=sum(bound) / decode_time if decode_time else None,
        steady_roofline_fraction=(sum(b for b, _ in steady) / sum(s["dt"] for _, s in steady)) if steady else None,
        roofline_tokens_per_s=sum(s["seqs"] for s in decode) / sum(bound) if bound else None,
        roofline_bytes=dict(weights=weight_bytes, kv_per_token=kv_per_token),
        query_slots=runner.num_query_slots, setup_s=setup_s,
        blocks_returned=bm.num_free_blocks == bm.num_blocks and all(c == 0 for c in bm.ref_counts),
        gpu_timeline=trace.summary() if trace else None)
    if not metrics["blocks_returned"]:
        raise RuntimeError(f"{mode}: {bm.num_blocks - bm.num_free_blocks} KV blocks were not returned")
    llm.close()  # stops tensor-parallel followers before the next mode starts its own
    del llm, engine, runner
    free_device_memory()
    return dict(metrics=metrics, timeline=timeline)


def abort_unfinished(engine, request_ids) -> int:
    """Abort every unfinished request of a run cut short; return the tokens they had produced."""
    outputs = (engine.abort_request(rid) for rid in request_ids)
    return sum(len(o.outputs[0].token_ids) for o in outputs if o is not None)


class Progress:
    """A line every ``every`` seconds while a mode runs, so a run stopped by a time limit still
    says how far it got and how fast it was going."""

    def __init__(self, mode: str, num_requests: int, every: float):
        self.mode, self.num_requests, self.every = mode, num_requests, every
        self.finished = self.tokens = self.preempted = 0
        self.last_t = self.last_tokens = 0.0

    def step(self, t: float, finished: int, stats, engine) -> None:
        self.finished += finished
        self.tokens += stats.num_decodes
        self.preempted += stats.num_preempted
        if not self.every or t - self.last_t < self.every:
            return
        rate = (self.tokens - self.last_tokens) / (t - self.last_t)
        print(f"  {self.mode} {t:6.0f} s: {self.finished}/{self.num_requests} done, {stats.num_running} running, "
              f"{len(engine.scheduler.waiting)} waiting, {rate:,.0f} decode tokens/s, "
              f"{self.preempted} preemptions, {engine.stats.num_compressions} compressions", flush=True)
        self.last_t, self.last_tokens = t, self.tokens


def run_hf(args, settings, model_dir, load_format, requests) -> dict | None:
    """Tokens/s of transformers' ``generate`` on a few requests (same shape; random weights if dummy)."""
    if not args.hf_requests:
        return None
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    trust = _trust(args)
    if load_format == "dummy":
        from zipage.utils.loader import load_config
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(load_config(model_dir, trust), dtype=dtype,
                                                     trust_remote_code=trust)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust).to(device)
    model.eval()
    subset = requests[:args.hf_requests]
    new_tokens = min(settings["hf_max_tokens"], min(r.max_tokens for r in subset))
    batch_size = args.hf_batch_size or len(subset)
    generated, elapsed = 0, 0.0
    for first in range(0, len(subset), batch_size):
        batch = subset[first:first + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left padding
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad():
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=args.temperature,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed += time.perf_counter() - start
        generated += (out.shape[1] - width) * len(batch)
    del model
    free_device_memory()
    return dict(requests=len(subset), batch_size=batch_size, new_tokens_each=new_tokens,
                tokens_per_s=generated / elapsed)


def rolling_rate(times: list[float], counts: list[float], window: float) -> list[float]:
    """At each time ``times[i]`` (ascending): the counts in (t - window, t] per second of that
    window (of the time since 0 while it is shorter)."""
    rates, total, first = [], 0.0, 0
    for i, (t, count) in enumerate(zip(times, counts)):
        total += count
        while first < i and times[first] <= t - window:
            total -= counts[first]
            first += 1
        span = min(window, t)
        rates.append(total / span if span > 0 else 0.0)
    return rates


def plot(results: dict, path: str, title: str) -> None:
    """Tokens/s (each step's, faint, under a rolling mean over 1/30 of the longest run), running
    requests and KV occupancy against time, one line per mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    window = max((run["timeline"][-1]["t"] for run in results.values() if run["timeline"]), default=0.0) / 30
    for mode, run in results.items():
        timeline = run["timeline"]
        if not timeline:
            continue
        t = [s["t"] for s in timeline]
        produced = [s["decodes"] for s in timeline]  # one token per decoding request per step
        line, = axes[0].plot(t, [n / s["dt"] if s["dt"] > 0 else 0.0 for n, s in zip(produced, timeline)],
                             linewidth=0.5, alpha=0.25)
        axes[0].plot(t, rolling_rate(t, produced, window), color=line.get_color(), linewidth=2.0,
                     label=f"{mode} (mean over {window:.2g} s)")
        axes[1].plot(t, [s["running"] for s in timeline], label=mode)
        num_blocks = run["metrics"]["num_blocks"]
        axes[2].plot(t, [100 * s["blocks"] / num_blocks for s in timeline], label=mode)
    axes[0].set_ylabel("tokens/s (faint: each step)")
    axes[1].set_ylabel("running requests")
    axes[2].set_ylabel("KV blocks in use (%)")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def prepare_workload(args: argparse.Namespace):
    """Settings, model, seeded requests, cache size and checked modes of a run (printed in one line)."""
    settings = _settings(args)
    scale = settings["scale"]
    model_dir, load_format = model_dir_for(args.model, args.shape, args.arch)
    from zipage.utils.loader import load_config
    vocab = load_config(model_dir, _trust(args)).vocab_size
    cache_tokens = args.kv_cache_tokens or int(STANDARD_CACHE_TOKENS * scale)
    if args.num_requests:
        requests = make_workload(args.workload, math.ceil(args.num_requests / args.samples_per_prompt),
                                 args.samples_per_prompt, vocab, args.seed, scale)
    else:  # the standard run: peak KV demand twice the cache
        requests = requests_for_demand(args.workload, 2 * cache_tokens, vocab, args.seed, scale,
                                       args.samples_per_prompt)
    demand = peak_kv_demand(requests)
    # With the whole GPU the cache's size is known only once the engine is built.
    cache = "KV cache the whole GPU" if args.whole_gpu else \
        f"{demand / cache_tokens:.2f} x the cache; KV cache {cache_tokens} tokens"
    print(f"{args.workload} x{scale:g}: {len(requests)} requests, {sum(r.max_tokens for r in requests)} output "
          f"tokens, peak KV demand {demand} tokens ({cache})")
    hf_batch_size = getattr(args, "hf_batch_size", None)  # the replay shares this and has no such option
    if hf_batch_size is not None and hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {hf_batch_size}")
    if args.max_seconds is not None and not args.max_seconds > 0:
        raise ValueError(f"--max-seconds must be > 0, got {args.max_seconds}")
    modes = args.modes.split(",")
    for mode in modes:  # reject a bad mode before any run
        mode_options(mode, args, settings)
    check_one_engine_a_process(args, modes)
    return settings, model_dir, load_format, requests, cache_tokens, modes


def run_throughput_bench(args: argparse.Namespace) -> int:
    settings, model_dir, load_format, requests, cache_tokens, modes = prepare_workload(args)
    scale = settings["scale"]
    device = run_device(args.device)
    bandwidth, bandwidth_source = copy_bandwidth(device)
    results = {mode: run_mode(mode, args, settings, model_dir, load_format, requests, cache_tokens, bandwidth)
               for mode in modes}
    hf = run_hf(args, settings, model_dir, load_format, requests)
    rows = [r["metrics"] for r in results.values()]
    columns = ["mode", "tokens_per_s", "requests_per_s", "mean_running", "peak_running", "mean_block_occupancy",
               "compression_share", "host_ms_per_decode_step", "steady_roofline_fraction", "roofline_tokens_per_s"]
    print(f"\nroofline: each decode step moves the weights and every running request's KV at "
          f"{bandwidth / 1e9:,.1f} GB/s ({bandwidth_source})")
    print_table(rows, columns)
    ratios = {}
    full = next((m for m in results if m.split("+")[0] == "full"), None)
    for mode in results:
        if full and mode.split("+")[0] == "zipage" and results[full]["metrics"]["tokens_per_s"]:
            ratios[f"{mode}_over_{full}"] = (results[mode]["metrics"]["tokens_per_s"]
                                             / results[full]["metrics"]["tokens_per_s"])
    if hf:
        for mode, run in results.items():
            ratios[f"{mode}_over_hf"] = run["metrics"]["tokens_per_s"] / hf["tokens_per_s"]
        print(f"transformers generate: {hf['tokens_per_s']:.1f} tokens/s ({hf['requests']} requests, "
              f"{hf['batch_size']} per call)")
    print("ratios:", {k: round(v, 2) for k, v in ratios.items()})
    for mode, run in results.items():
        m = run["metrics"]
        if m["truncated_at_s"] is not None:
            print(f"{mode}: cut short at {m['truncated_at_s']:.0f} s (--max-seconds) with {m['finished_requests']} of "
                  f"{m['requests']} requests finished; its tokens/s are those of the run's first part")
    for mode, run in results.items():
        gpu = run["metrics"]["gpu_timeline"]
        if gpu:
            print(f"{mode}: GPU idle {gpu['idle_ms_per_step']:.2f} ms/step ({gpu['gpu_idle_s']:.1f} of "
                  f"{gpu['gpu_span_s']:.1f} s); compression {gpu['compression_gpu_s']:.2f} s on the GPU, "
                  f"{100 * (gpu['compression_hidden_fraction'] or 0):.0f}% hidden under decode steps")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        scale_text = f"{args.scale} (x{scale:.3g})" if args.scale in PRESETS else f"x{scale:g}"
        title = (f"bench throughput: {args.workload} at scale {scale_text}, {args.model or args.shape}, "
                 f"{device_name(device)}, {datetime.date.today().isoformat()}")
        plot(results, os.path.join(args.out, "throughput.png"), title)
        lengths = [r.max_tokens for r in requests]
        write_json(os.path.join(args.out, "throughput.json"), dict(
            benchmark="throughput", model=args.model or args.shape, settings=settings,
            workload=dict(name=args.workload, seed=args.seed, scale=scale, requests=len(requests),
                          samples_per_prompt=args.samples_per_prompt, cache_tokens=cache_tokens,
                          peak_kv_demand=peak_kv_demand(requests),
                          output_tokens=sum(lengths), mean_output=sum(lengths) / len(lengths),
                          max_output=max(lengths),
                          mean_prompt=sum(len(r.prompt) for r in requests) / len(requests)),
            options=dict(hybrid=not args.no_hybrid,
                         prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager,
                         redundancy=args.redundancy, temperature=args.temperature,
                         tensor_parallel_size=args.tensor_parallel_size),
            roofline=dict(copy_bytes_per_s=bandwidth, source=bandwidth_source),
            modes={m: r["metrics"] for m, r in results.items()}, hf_generate=hf, ratios=ratios,
            timelines={m: r["timeline"] for m, r in results.items()}), device=device)
    return 0
