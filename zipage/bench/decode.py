"""``zipage bench decode``: decode throughput at fixed batch and context.

For each batch size, ``batch`` requests with ``context``-token random prompts are
prefilled, then decoded together for ``steps`` steps. The roofline is the time
the step's unavoidable bytes (weights once, plus every request's KV) take at the
measured copy bandwidth. With ``--penalties`` each batch runs again with repetition,
presence and frequency penalties on every request, printed beside the plain run.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from zipage.bench.common import COPY_BANDWIDTH_BYTES_PER_S, model_dir_for, print_table, write_json
from zipage.bench.profile import StepProfiler, breakdown

# ``--penalties``: every request penalised (token counts read and updated on the device each step)
PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)


def add_decode_parser(sub) -> None:
    p = sub.add_parser("decode", help="decode tokens/s at fixed batch sizes and context length")
    p.add_argument("--model", default=None, help="checkpoint directory (default: --shape with random weights)")
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--batch", default="1,64,256", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size")
    p.add_argument("--modes", default="graphs,eager", help="graphs and/or eager")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--device", default=None)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the timed steps, record this many with torch.profiler and print where the "
                        "step's time goes, kernels grouped by kind (0: none)")
    p.add_argument("--penalties", action="store_true",
                   help="run each batch again with repetition 1.1, presence 0.5 and frequency 0.5 on every "
                        "request, beside the plain run (vs_plain: its tokens/s over the plain run's)")
    p.add_argument("--out", default=None, help="write JSON results here")
    p.set_defaults(func=run_decode_bench)


def _weight_bytes(model) -> int:
    """Bytes of weights one decode step reads (the embedding table only by rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if embed is not model.lm_head.weight:
        total -= embed.numel() * embed.element_size()
    return total


def run_decode_bench(args: argparse.Namespace) -> int:
    from zipage import LLM

    if args.steps < 3 or args.profile_steps < 0:
        raise ValueError(f"--steps must be >= 3 (got {args.steps}) and --profile-steps >= 0 "
                         f"(got {args.profile_steps})")
    model_dir, load_format = model_dir_for(args.model, args.shape, args.arch)
    batches = [int(b) for b in args.batch.split(",")]
    variants = {"plain": {}, "penalties": PENALTIES} if args.penalties else {"plain": {}}
    rows = []
    for mode in args.modes.split(","):
        llm = LLM(model_dir, load_format=load_format, device=args.device, block_size=args.block_size,
                  max_num_seqs=max(batches), max_model_len=args.context + args.steps + args.profile_steps + 8,
                  enforce_eager=(mode == "eager"), enable_prefix_caching=False)
        runner = llm.engine.runner
        rng = random.Random(0)
        for batch in batches:
            prompts = [[rng.randrange(runner.vocab_size) for _ in range(args.context)] for _ in range(batch)]
            for variant, penalties in variants.items():
                row = dict(mode=mode, batch=batch, context=args.context)
                if args.penalties:
                    row["sampling"] = variant
                row.update(_run_batch(llm, args, prompts, penalties))
                if args.penalties:
                    row["vs_plain"] = row["tokens_per_s"] / rows[-1]["tokens_per_s"] if penalties else 1.0
                rows.append(row)
                print_table(rows[-1:], [c for c in row if c != "profile"])
                if "profile" in row:
                    print(f"  where a step's {row['step_ms']:.2f} ms go ({args.profile_steps} steps recorded; "
                          "times per step):")
                    print_table(row["profile"], ["kind", "kernels_per_step", "ms_per_step", "share"])
        del llm, runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print()
    print_table(rows, [c for c in rows[0] if c != "profile"])
    write_json(args.out, dict(benchmark="decode", model=args.model or args.shape, rows=rows,
                              block_size=args.block_size, steps=args.steps))
    return 0


def _run_batch(llm, args: argparse.Namespace, prompts: list[list[int]], penalties: dict) -> dict:
    """Prefill ``prompts`` together, decode them ``args.steps`` steps (plus any profiled ones) and
    return the median step's numbers."""
    from zipage import SamplingParams

    runner, batch = llm.engine.runner, len(prompts)
    for prompt in prompts:
        llm.engine.add_request(prompt, SamplingParams(
            temperature=0, max_tokens=args.steps + args.profile_steps + 1, ignore_eos=True, **penalties))
    decode_times, host_times = [], []
    profiler, kernels, profiled = None, None, 0
    while llm.engine.has_unfinished_requests():
        if args.profile_steps and profiler is None and len(decode_times) == args.steps:
            profiler = StepProfiler(runner.device)  # the timed steps are done: record the next ones
            profiler.start()
        start = time.perf_counter()
        _, stats = llm.engine.step()
        if stats is None or stats.is_prefill or stats.num_seqs != batch:
            continue
        if profiler is None:
            decode_times.append(time.perf_counter() - start)
            host_times.append(stats.host_s)
        elif kernels is None:
            profiled += 1
            if profiled == args.profile_steps:
                kernels = profiler.stop()
    if profiler is not None and kernels is None and profiled:
        kernels = profiler.stop()
    step = sorted(decode_times[2:])[len(decode_times[2:]) // 2]  # median after warm-up
    host = sorted(host_times[2:])[len(host_times[2:]) // 2]
    spec = runner.spec
    kv_bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * runner.dtype.itemsize
    bytes_per_step = _weight_bytes(runner.model) + batch * (args.context + args.steps / 2) * kv_bytes_per_token
    floor = bytes_per_step / COPY_BANDWIDTH_BYTES_PER_S
    row = dict(step_ms=1000 * step, host_ms=1000 * host, tokens_per_s=batch / step,
               roofline_tokens_per_s=batch / floor, roofline_fraction=floor / step)
    if kernels is not None:
        row["profile"] = breakdown(kernels, profiled, step)
    return row
