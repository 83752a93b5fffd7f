"""``zipage bench decode``: decode throughput at fixed batch and context.

For each batch size, ``batch`` requests with ``context``-token random prompts are
prefilled, then decoded together for ``steps`` steps. The roofline is the time
the step's unavoidable bytes (weights once, plus every request's KV) take at the
measured copy bandwidth; with ``--tensor-parallel-size`` N, one GPU's share of them
(its shards of the weights, its KV heads), which the N GPUs read at the same time.

``--one-rank-of N`` decodes, on one GPU, the layers one rank of tensor parallelism over N GPUs
holds (the shape's query and KV heads, MLP width and vocabulary divided by N): a rank's compute
without the collectives. A TP=N step takes that plus its collectives and the waits between the
ranks, so it bounds what TP=N can reach and, against ``--tensor-parallel-size N``, measures what the
collectives cost.

``--variants`` runs each batch again with the sampling features a server uses, each
printed beside the plain run (``vs_plain``: its mean step's tokens/s over plain's):
``penalties`` (repetition, presence and frequency on every request), ``logprobs`` (5
alternatives per token), ``json`` (every request held to a JSON schema with a long
free-text field, through xgrammar; the checkpoint then gets a synthetic tokenizer of the
shape's vocabulary size, so that the grammar masks cost what they would), ``budgets``
(with ``--kv-budget-tokens``: a third of the requests at the engine's budget, a third
at half, a third at a quarter).
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from zipage.bench.common import (COPY_BANDWIDTH_BYTES_PER_S, check_one_engine_a_process, model_dir_for, print_table,
                                 write_json)
from zipage.bench.profile import StepProfiler, breakdown
from zipage.runner.kv_cache import bytes_per_block

# ``--penalties``: every request penalised (token counts read and updated on the device each step)
PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
# ``json``: an answer with a free-text field, as a reasoning or extraction schema has; a random model
# stays in the string (the synthetic vocabulary has few tokens that close it), so the mask stays on
JSON_SCHEMA = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
               "required": ["reasoning", "answer"]}
VARIANTS = ("plain", "penalties", "logprobs", "json", "budgets")
UNPRINTED = ("profile", "bytes_per_step")  # in the JSON only


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
    p.add_argument("--penalties", action="store_true", help="the same as adding 'penalties' to --variants")
    p.add_argument("--variants", default="plain",
                   help=f"comma-separated, from {', '.join(VARIANTS)}: each batch runs with each, beside plain "
                        "(see the module's help: zipage/bench/decode.py)")
    p.add_argument("--kv-budget-tokens", type=int, default=None,
                   help="run with compression at this budget (the 'budgets' variant needs it)")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="fp8 weights, quantized at load")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: float8 e4m3 keys and values with a scale per token and KV head")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs per model; the roofline counts one GPU's share of the weights and KV")
    p.add_argument("--all-reduce", default="nccl", choices=["nccl", "one-shot"],
                   help="how tensor-parallel GPUs sum partial outputs (EngineConfig.all_reduce)")
    p.add_argument("--one-rank-of", type=int, default=1, metavar="N",
                   help="decode on one GPU the layers one rank of tensor parallelism over N GPUs holds (the "
                        "shape's heads, KV heads, MLP width and vocabulary divided by N): a rank's compute "
                        "without the collectives, the most TP=N can reach")
    p.add_argument("--out", default=None, help="write JSON results here")
    p.set_defaults(func=run_decode_bench)


def _weight_bytes(model, batch: int) -> int:
    """Bytes of weights a decode step of ``batch`` tokens reads: the embedding table only by rows;
    of a mixture-of-experts layer, the experts its tokens choose, as many as ``batch`` uniform
    choices of ``top_k`` touch on average: E * (1 - (1 - k / E) ** batch)."""
    from zipage.layers.moe import SparseMoE

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if embed is not model.lm_head.weight:
        total -= embed.numel() * embed.element_size()
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        experts = sum(p.numel() * p.element_size() for p in (moe.w13, moe.w2))
        touched = 1 - (1 - moe.top_k / moe.num_experts) ** batch
        total -= int(experts * (1 - touched))
    return total


def run_decode_bench(args: argparse.Namespace) -> int:
    from zipage import LLM

    if args.steps < 3 or args.profile_steps < 0:
        raise ValueError(f"--steps must be >= 3 (got {args.steps}) and --profile-steps >= 0 "
                         f"(got {args.profile_steps})")
    if args.one_rank_of < 1:
        raise ValueError(f"--one-rank-of must be >= 1, got {args.one_rank_of}")
    if args.one_rank_of > 1 and (args.model or args.tensor_parallel_size > 1):
        raise ValueError("--one-rank-of shrinks a --shape to one rank's layers on one GPU: not with --model or "
                         f"--tensor-parallel-size {args.tensor_parallel_size}")
    check_one_engine_a_process(args, args.modes.split(","))
    variants = _variants(args)
    if args.one_rank_of > 1 and "json" in variants:
        raise ValueError("--one-rank-of: not with the json variant (its tokenizer spans the whole vocabulary)")
    model_dir, load_format = model_dir_for(args.model, args.shape, args.arch, full_vocab="json" in variants,
                                           one_rank_of=args.one_rank_of)
    batches = [int(b) for b in args.batch.split(",")]
    compression = None
    if args.kv_budget_tokens is not None:
        from zipage.config import CompressionConfig
        compression = CompressionConfig(kv_budget_tokens=args.kv_budget_tokens)
    rows = []
    for mode in args.modes.split(","):
        llm = LLM(model_dir, load_format=load_format, device=args.device, block_size=args.block_size,
                  max_num_seqs=max(batches), max_model_len=args.context + args.steps + args.profile_steps + 8,
                  enforce_eager=(mode == "eager"), enable_prefix_caching=False, compression=compression,
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                  tensor_parallel_size=args.tensor_parallel_size, all_reduce=args.all_reduce,
                  enable_chunked_prefill=False)  # whole prompts first: then every step decodes the whole batch
        runner = llm.engine.runner
        rng = random.Random(0)
        for batch in batches:
            prompts = [[rng.randrange(runner.vocab_size) for _ in range(args.context)] for _ in range(batch)]
            plain = None
            for variant, make_params in variants.items():
                row = dict(mode=mode, batch=batch, context=args.context)
                if args.tensor_parallel_size > 1:
                    row["tp"] = args.tensor_parallel_size
                if args.one_rank_of > 1:
                    row["one_rank_of"] = args.one_rank_of
                if len(variants) > 1:
                    row["sampling"] = variant
                row.update(_run_batch(llm, args, prompts, make_params))
                if len(variants) > 1:
                    plain = plain or row
                    row["vs_plain"] = row["mean_tokens_per_s"] / plain["mean_tokens_per_s"]
                rows.append(row)
                print_table(rows[-1:], [c for c in row if c not in UNPRINTED])
                if "profile" in row:
                    print(f"  where a step's {row['step_ms']:.2f} ms go ({args.profile_steps} steps recorded; "
                          "times per step):")
                    print_table(row["profile"], ["kind", "kernels_per_step", "ms_per_step", "share"])
        llm.close()  # stops tensor-parallel followers before the next mode starts its own
        del llm, runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print()
    print_table(rows, [c for c in rows[0] if c not in UNPRINTED])
    write_json(args.out, dict(benchmark="decode", model=args.model or args.shape, rows=rows,
                              block_size=args.block_size, steps=args.steps, kv_budget_tokens=args.kv_budget_tokens,
                              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                              tensor_parallel_size=args.tensor_parallel_size, one_rank_of=args.one_rank_of,
                              json_schema=JSON_SCHEMA if "json" in variants else None))
    return 0


def _variants(args: argparse.Namespace) -> dict:
    """{name: the extra SamplingParams of request i (a function of i)}, plain first."""
    names = [v for v in args.variants.split(",") if v]
    if args.penalties and "penalties" not in names:
        names.append("penalties")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    budget = args.kv_budget_tokens
    if "budgets" in names:
        if budget is None:
            raise ValueError("--variants budgets needs --kv-budget-tokens (the engine's budget)")
        block = args.block_size
        smaller = [max(block, budget // d // block * block) for d in (1, 2, 4)]
    makers = {
        "plain": lambda i: {},
        "penalties": lambda i: PENALTIES,
        "logprobs": lambda i: {"logprobs": 5},
        "json": lambda i: {"structured_outputs": {"json": JSON_SCHEMA}},
        "budgets": lambda i: {"kv_budget_tokens": smaller[i % 3]},
    }
    return {name: makers[name] for name in ["plain"] + [n for n in names if n != "plain"]}


def _run_batch(llm, args: argparse.Namespace, prompts: list[list[int]], make_params) -> dict:
    """Prefill ``prompts`` together, decode them ``args.steps`` steps (plus any profiled ones) and
    return the median step's numbers (and the mean step's, which counts the slow ones too)."""
    from zipage import SamplingParams

    runner, batch = llm.engine.runner, len(prompts)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(prompt, SamplingParams(
            temperature=0, max_tokens=args.steps + args.profile_steps + 1, ignore_eos=True, **make_params(i)))
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
    if len(decode_times) < 3:
        raise RuntimeError(f"only {len(decode_times)} decode steps ran the whole batch of {batch} (requests "
                           "ended early): nothing to time")
    step = sorted(decode_times[2:])[len(decode_times[2:]) // 2]  # median after warm-up
    mean = sum(decode_times[2:]) / len(decode_times[2:])
    host = sorted(host_times[2:])[len(host_times[2:]) // 2]
    # One GPU's share (with tensor parallelism rank 0 holds its shards of the weights and its KV heads;
    # the ranks read theirs at the same time)
    kv_bytes_per_token = bytes_per_block(runner.model.local_spec, 1, runner.kv_dtype)  # float8: with its scales
    bytes_per_step = _weight_bytes(runner.model, batch) + batch * (args.context + args.steps / 2) * kv_bytes_per_token
    floor = bytes_per_step / COPY_BANDWIDTH_BYTES_PER_S
    row = dict(step_ms=1000 * step, host_ms=1000 * host, tokens_per_s=batch / step, mean_tokens_per_s=batch / mean,
               timed_steps=len(decode_times) - 2, bytes_per_step=int(bytes_per_step),
               roofline_tokens_per_s=batch / floor, roofline_fraction=floor / step)
    if kernels is not None:
        row["profile"] = breakdown(kernels, profiled, step)
    return row
