"""``zipage bench chunks``: the steps that run one long prompt's chunks beside decoding streams.

``--streams`` requests (random prompts of ``--input-len`` tokens) decode; then one prompt of
``--prompt-len`` tokens arrives and is prefilled in chunks of ``--max-num-batched-tokens``
beside their decodes (full KV, or with ``--kv-budget-tokens`` every request compressed to
its budget, the prompt between its chunks with ``--prefill-compression always``). Every step
is timed on its own, the device synchronized after it: its host time (until the engine
returns) and its wall time. Reported, by depth into the prompt (eighths): the mixed steps'
median wall and host milliseconds, next to the median decode step before the prompt arrived,
whose 3x is the latency target of such steps (``docs/benchmarks.md``, "Long prompts among
decoding streams"); and every step from the prompt's arrival to its last chunk, by kind (a
chunk, a compression launched, both, or decodes only: with a budget, a prompt's compressions
between its chunks take steps of their own). With ``--profile``, where three mixed steps at
three quarters of the prompt spend their device time, kernels grouped by kind
(``bench/profile.py``).

This is what ``bench serve --long-prompts`` measures from the clients' side, taken apart:
a step's cost against its depth, and whether it is bound by the host or the device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from zipage.bench.common import device_name, model_dir_for, print_table, write_json

BANDS = 8
WARMUP_STEPS = 40  # decode steps before timing: every stream past its prefill, graphs warm
DECODE_STEPS = 30  # decode steps timed before the prompt arrives
PROFILED_STEPS = 3
STEP_KINDS = ("chunk", "chunk and compression", "compression", "decode")


def step_kind(chunk_tokens: int, compressions: int) -> str:
    """What a step beside the streams' decodes ran: a prompt chunk, compressions, both, or neither."""
    if chunk_tokens:
        return "chunk and compression" if compressions else "chunk"
    return "compression" if compressions else "decode"


def add_chunks_parser(sub) -> None:
    from zipage.cli import _attention_span

    p = sub.add_parser("chunks", help="steps mixing one long prompt's chunks with decodes, timed one by one",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: --shape with random weights)")
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--streams", type=int, default=128, help="requests decoding when the prompt arrives")
    p.add_argument("--input-len", type=int, default=128, help="the streams' prompt tokens")
    p.add_argument("--prompt-len", type=int, default=32768, help="the long prompt's tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens per step: the streams' decodes, then the prompt's chunk")
    p.add_argument("--piecewise-graph-tokens", type=int, default=None, metavar="N",
                   help="as for the engine (0: mixed steps run eagerly; default: the engine's)")
    p.add_argument("--prefill-attention-span", type=_attention_span, default=0, metavar="SPAN|model",
                   help="as for the engine: chunks deep into the prompt cost more of the step's tokens")
    p.add_argument("--kv-budget-tokens", type=int, default=None,
                   help="compress every request to this many tokens per layer and KV head (default: full KV)")
    p.add_argument("--prefill-compression", default="long", choices=["long", "always", "off"],
                   help="with --kv-budget-tokens, as for the engine: always compresses the prompt between its "
                        "chunks once its cache passes the budget, so chunks never attend to more than the "
                        "budget plus a chunk")
    p.add_argument("--block-size", type=int, default=256, help="tokens per KV block")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs at all")
    p.add_argument("--profile", action="store_true",
                   help="also record three mixed steps at 3/4 of the prompt with torch.profiler")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for chunks.json")
    p.set_defaults(func=run_chunks_bench)


def _check(args) -> None:
    for name in ("streams", "input_len", "prompt_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_num_batched_tokens <= args.streams:
        raise ValueError(f"--max-num-batched-tokens must exceed --streams ({args.streams}), whose decodes come first "
                         f"in every step, got {args.max_num_batched_tokens}")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_chunks_bench(args: argparse.Namespace) -> int:
    from zipage import LLM, CompressionConfig, SamplingParams
    from zipage.bench.profile import StepProfiler, breakdown

    _check(args)
    model_dir, load_format = model_dir_for(args.model, args.shape, args.arch)
    room = args.max_num_batched_tokens - args.streams
    steps_for_prompt = -(-args.prompt_len // room)
    # The streams outlast the timed decodes and every chunk (a chunk deep into the prompt may get
    # fewer tokens when chunks cost by attention: twice the plain count, and more, is room enough).
    stream_tokens = WARMUP_STEPS + DECODE_STEPS + 4 * steps_for_prompt + 4 * PROFILED_STEPS + 16
    max_model_len = max(args.prompt_len + 8, args.input_len + stream_tokens)
    compression = None
    if args.kv_budget_tokens is not None:
        compression = CompressionConfig(kv_budget_tokens=args.kv_budget_tokens,
                                        prefill_compression=args.prefill_compression)
    started = time.perf_counter()
    llm = LLM(model_dir, load_format=load_format, device=args.device, seed=args.seed, max_model_len=max_model_len,
              max_num_seqs=args.streams + 1, max_num_batched_tokens=args.max_num_batched_tokens,
              piecewise_graph_tokens=args.piecewise_graph_tokens, prefill_attention_span=args.prefill_attention_span,
              enforce_eager=args.enforce_eager, compression=compression, block_size=args.block_size)
    engine = llm.engine
    start_s = time.perf_counter() - started
    device = torch.device(engine.config.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(args.seed)

    def random_prompt(n: int) -> list[int]:
        return torch.randint(0, engine.vocab_size, (n,), generator=g).tolist()

    every = []  # every step from the prompt's arrival (a dict each)

    def timed_step(depth=None):
        """(the step's prompt tokens, host ms, wall ms); recorded in ``every`` when given its depth."""
        t0 = time.perf_counter()
        _, stats = engine.step()
        t1 = time.perf_counter()
        sync()
        if stats is None:
            raise RuntimeError("the engine stopped scheduling before the long prompt was prefilled")
        chunk, host, wall = stats.num_tokens - stats.num_decodes, 1000 * (t1 - t0), 1000 * (time.perf_counter() - t0)
        if depth is not None:
            every.append(dict(depth=depth, kind=step_kind(chunk, stats.num_compressed), chunk_tokens=chunk,
                              compressions=stats.num_compressed, host_ms=host, wall_ms=wall))
        return chunk, host, wall

    try:
        for _ in range(args.streams):
            engine.add_request(random_prompt(args.input_len), SamplingParams(max_tokens=stream_tokens, ignore_eos=True))
        for _ in range(WARMUP_STEPS):
            engine.step()
        sync()
        decode_ms = [timed_step()[2] for _ in range(DECODE_STEPS)]
        engine.add_request(random_prompt(args.prompt_len), SamplingParams(max_tokens=1, ignore_eos=True))
        mixed, profile_rows, done = [], None, 0  # mixed: (depth, chunk tokens, host ms, wall ms)
        while done < args.prompt_len:
            if args.profile and profile_rows is None and done >= 0.75 * args.prompt_len:
                profiler = StepProfiler(device)
                profiler.start()
                walls = []
                for _ in range(PROFILED_STEPS):
                    chunk, _, wall = timed_step(done)
                    done += chunk
                    walls.append(wall)
                profile_rows = breakdown(profiler.stop(), PROFILED_STEPS, sum(walls) / len(walls) / 1000)
                continue
            chunk, host, wall = timed_step(done)
            if chunk > 0:
                mixed.append((done, chunk, host, wall))
            done += chunk
        compressions = engine.stats.num_compressions
    finally:
        llm.close()

    graph_tokens = 0 if args.enforce_eager else min(engine.config.piecewise_graph_tokens, args.max_num_batched_tokens)
    bands = []
    for band in range(BANDS):
        lo, hi = band * args.prompt_len / BANDS, (band + 1) * args.prompt_len / BANDS
        rows = [m for m in mixed if lo <= m[0] < hi]
        if rows:
            bands.append(dict(depth=f"{int(lo):,}-{int(hi):,}", steps=len(rows),
                              chunk_tokens=_median([r[1] for r in rows]), host_ms=_median([r[2] for r in rows]),
                              wall_ms=_median([r[3] for r in rows]), max_wall_ms=max(r[3] for r in rows)))
    walls = sorted(m[3] for m in mixed)
    decode_step = _median(decode_ms)
    kinds = []
    for kind in STEP_KINDS:
        steps = [e for e in every if e["kind"] == kind]
        walls_of_kind = sorted(e["wall_ms"] for e in steps)
        if steps:
            kinds.append(dict(kind=kind, steps=len(steps), wall_ms_p50=_median(walls_of_kind),
                              wall_ms_p90=walls_of_kind[int(0.9 * (len(steps) - 1))], wall_ms_max=walls_of_kind[-1],
                              host_ms_p50=_median([e["host_ms"] for e in steps])))
    summary = dict(decode_step_ms=decode_step, mixed_steps=len(mixed), wall_ms_p50=_median(walls),
                   wall_ms_p90=walls[int(0.9 * (len(walls) - 1))] if walls else None,
                   wall_ms_max=walls[-1] if walls else None, host_ms_p50=_median([m[2] for m in mixed]),
                   target_ms=3 * decode_step if decode_step else None, engine_start_s=start_s,
                   compressions=compressions)
    kv = "full KV" if compression is None else (f"budget {args.kv_budget_tokens}, prefill compression "
                                                f"{args.prefill_compression}")
    print(f"{args.streams} streams decoding, one prompt of {args.prompt_len:,} tokens in steps of "
          f"{args.max_num_batched_tokens} tokens; {kv}; pieces up to {graph_tokens} tokens; "
          f"{device_name(device)}; engine start {start_s:.1f} s")
    print(f"decode step before the prompt: {decode_step:.2f} ms (target for a mixed step: 3x = "
          f"{3 * decode_step:.1f} ms)")
    print_table(bands, list(bands[0]) if bands else [])
    print("every step while the prompt was prefilled, by kind (a compression's device time counts in the step "
          "that launched it):")
    print_table(kinds, list(kinds[0]) if kinds else [])
    print(f"mixed steps: {len(mixed)}, wall p50 {summary['wall_ms_p50']:.1f} ms, p90 {summary['wall_ms_p90']:.1f} ms, "
          f"max {summary['wall_ms_max']:.1f} ms; host p50 {summary['host_ms_p50']:.1f} ms")
    if profile_rows:
        print(f"device time of {PROFILED_STEPS} mixed steps at 3/4 of the prompt, per step:")
        print_table(profile_rows, list(profile_rows[0]))
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    write_json(args.out and os.path.join(args.out, "chunks.json"), dict(benchmark="chunks", settings=settings,
                              piecewise_graph_tokens=graph_tokens, summary=summary,
                              bands=bands, steps=mixed, decode_steps_ms=decode_ms, profile=profile_rows,
                              kinds=kinds, every_step=every), device)
    return 0
