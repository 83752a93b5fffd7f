"""``zipage bench compression``: the time of one compression, by stage, beside a decode step.

Requests are put straight into the state that triggers compression (a full
budget of N blocks of random keys, values and window queries), so no prefill is
needed. The kernels are first checked against their PyTorch twins on this state.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from zipage.bench.common import model_dir_for, print_table, write_json


def add_compression_parser(sub) -> None:
    p = sub.add_parser("compression", help="time one compression per stage, next to a decode step")
    p.add_argument("--model", default=None)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--requests", default="64,256", help="comma-separated compression batch sizes")
    p.add_argument("--budget", type=int, default=2048, help="kv_budget_tokens")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--redundancy", default="lightning", choices=["lightning", "raw", "off"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: float8 e4m3 keys and values with a scale per token and KV head")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8 weights, quantized at load (the decode steps of --beside)")
    p.add_argument("--device", default=None)
    p.add_argument("--check", type=int, default=4, help="requests whose kernel outputs are checked (0: none)")
    p.add_argument("--beside", type=int, default=0,
                   help="also time what each batch of --requests costs when launched beside the decode steps of "
                        "this many other requests (0: skip)")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run_compression_bench)


def _fill_requests(llm, count: int, rng: random.Random):
    """``count`` running requests, each holding N full blocks of random cache contents."""
    from zipage import SamplingParams
    from zipage.engine.sequence import SequenceStatus

    engine, cfg = llm.engine, llm.config.compression
    bm, scheduler, runner = engine.block_manager, engine.scheduler, engine.runner
    tokens = cfg.max_blocks_per_seq * llm.config.cache.block_size
    seqs = []
    for _ in range(count):
        seq = engine.prepare_request([rng.randrange(runner.vocab_size) for _ in range(tokens)],
                                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        engine.add_sequence(seq)
        scheduler.waiting.remove(seq)
        bm.allocate(seq)
        seq.kv_len = tokens
        seq.token_ids.append(0)  # the sampled token waiting to be cached
        seq.status = SequenceStatus.RUNNING
        seq.query_slot = scheduler.free_query_slots.pop()
        scheduler.running.append(seq)
        seqs.append(seq)
    for block in (b for s in seqs for b in s.block_table):  # in place: no copy of the whole set
        for plane in runner.kv_cache:
            if runner.kv_scales is None:
                plane[:, block].normal_()
            else:  # float8 codes of normal values (unit scale's range), and scales around a key's size
                plane[:, block].copy_(torch.randn(plane[:, block].shape, device=plane.device).mul_(64))
        if runner.kv_scales is not None:
            runner.kv_scales[:, :, block].uniform_(0.5 / 64, 1.5 / 64)
    runner.query_cache.normal_()
    return seqs


def _finish(llm, seqs) -> None:
    for seq in seqs:
        llm.engine.scheduler.finish(seq, "abort")
        llm.engine._requests.pop(seq.request_id, None)


def _check_kernels(llm, seqs) -> dict:
    """Relative error of each kernel against its twin on the live state (first layer group)."""
    from zipage.kernels import compact_kv as ck
    from zipage.kernels import compress_scores as cs

    runner, cfg = llm.engine.runner, llm.config.compression
    bs = llm.config.cache.block_size
    tables = torch.tensor([list(s.block_table) for s in seqs], dtype=torch.int32, device=runner.device)
    lengths = torch.tensor([s.kv_len for s in seqs], device=runner.device)
    n_max = tables.shape[1] * bs
    layers = slice(0, min(cfg.layer_group, runner.spec.num_layers))
    keys = runner.kv_cache.keys[layers]
    scales = None if runner.kv_scales is None else runner.kv_scales[:, layers]
    key_scale = {} if scales is None else {"k_scale": scales[0]}
    rows = torch.stack([s.query_slot * cfg.window + torch.arange(cfg.window) for s in seqs]).to(runner.device)
    queries = runner.query_cache[layers][:, rows].transpose(0, 1).contiguous()
    scale = runner.spec.head_dim ** -0.5

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

    errors = {"attention": rel(cs.paged_attention_scores(queries, keys, tables, lengths, scale, n_max, **key_scale),
                               cs.paged_attention_scores_torch(queries, keys, tables, lengths, scale, n_max,
                                                               **key_scale))}
    if bs <= cs.REDUNDANCY_MAX_BLOCK:
        errors["redundancy"] = rel(
            cs.paged_redundancy_sums(keys, tables, lengths, cfg.similarity_threshold, n_max, **key_scale),
            cs.paged_redundancy_sums_torch(keys, tables, lengths, cfg.similarity_threshold, n_max, **key_scale))
    if runner.device.type == "cuda" and bs <= cs.REDUNDANCY_MAX_BLOCK:  # selection (history off: no cache read)
        from zipage.kernels import choose_kept as ch

        attention = cs.paged_attention_scores(queries, keys, tables, lengths, scale, n_max, **key_scale)
        rsum = cs.paged_redundancy_sums(keys, tables, lengths, cfg.similarity_threshold, n_max, **key_scale)
        args = (attention, rsum, lengths, torch.zeros_like(lengths), True, torch.zeros_like(lengths), None, tables,
                cfg, cfg.kv_budget_tokens, bs)
        chosen, twin = ch.choose_kept(*args, write_scores=False)[0], ch.choose_kept_torch(*args, write_scores=False)[0]
        errors["selection"] = (chosen != twin).double().mean().item()  # share of kept indices that differ
    kept = torch.sort(torch.randperm(n_max, device=runner.device)[:cfg.kv_budget_tokens]).values
    kept = kept.expand(len(seqs), keys.shape[0], keys.shape[-2], -1).contiguous()
    free = llm.engine.block_manager.free_blocks
    targets = torch.tensor(list(free)[:len(seqs) * (tables.shape[1] - 1)], dtype=torch.int32,
                           device=runner.device).view(len(seqs), -1)
    kv = runner.kv_cache.layers(layers)
    outs = []
    for compact in (ck.compact_kv, ck.compact_kv_torch):
        compact(kv, None, kept, None, tables, targets, scale_group=scales)
        moved = [plane[:, targets.flatten().long()].float() for plane in kv]
        if scales is not None:
            moved += [scales[:, :, targets.flatten().long()].flatten()]
        outs.append(torch.cat([m.flatten() for m in moved]))
    errors["compaction"] = rel(outs[0], outs[1])
    return errors


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cost_beside_decode(llm, num_decoding: int, counts: list[int], rng: random.Random, steps: int = 48,
                        period: int = 4) -> list[dict]:
    """What a compression costs the decode steps it is launched beside.

    ``num_decoding`` requests decode through the runner as the engine drives it (launch a
    step, then read the previous one's tokens) for ``steps`` steps, alone and with a
    compression of C other requests launched on the compression stream every ``period``
    steps; the cost of one compression is the extra wall time over the compressions
    launched (best of two loops each). Beside it, the compression's own time on an idle
    device.
    """
    from zipage.compression.planner import plan_compression

    engine, runner = llm.engine, llm.engine.runner
    bm, device = engine.block_manager, runner.device
    decoders = _fill_requests(llm, num_decoding, rng)
    for seq in decoders:
        bm.append_slot(seq)

    def loop(tasks) -> tuple[float, int]:
        _synchronize(device)
        start, previous, launched = time.perf_counter(), None, 0
        for i in range(steps):
            if tasks and i % period == 0:
                runner.start_compression(tasks)
                launched += 1
            step = runner.launch(decoders, False, engine.eos_token_ids)
            if previous is not None:
                previous.token_ids()
            previous = step
        previous.token_ids()
        _synchronize(device)
        return time.perf_counter() - start, launched

    rows = []
    for count in counts:
        seqs = _fill_requests(llm, count, rng)
        # Planned as the engine plans asynchronous ones; replaying the same tasks re-reads the
        # same sources (still held) and rewrites the same targets.
        tasks = [plan_compression(s, bm, llm.config.compression, asynchronous=True) for s in seqs]
        loop(tasks)  # warm-up
        alone = min(loop(None)[0] for _ in range(2))
        together, launched = min(loop(tasks) for _ in range(2))
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(3):
            runner.compress(tasks)
        _synchronize(device)
        isolated = (time.perf_counter() - start) / 3
        for task in tasks:  # planned outside the engine's lifecycle: release the sources here
            bm.finish_compaction(task.seq, task.pending_release)
        _finish(llm, seqs)
        rows.append(dict(requests=count, decoding=num_decoding, isolated_ms=1000 * isolated,
                         step_alone_ms=1000 * alone / steps, step_beside_ms=1000 * together / steps,
                         cost_ms=1000 * (together - alone) / launched))
        print_table([rows[-1]], list(rows[-1]))
    _finish(llm, decoders)
    return rows


def run_compression_bench(args: argparse.Namespace) -> int:
    from zipage import LLM, CompressionConfig
    from zipage.compression.planner import plan_compression

    model_dir, load_format = model_dir_for(args.model, args.shape, args.arch)
    counts = [int(x) for x in args.requests.split(",")]
    config = CompressionConfig(kv_budget_tokens=args.budget, redundancy=args.redundancy)
    max_len = args.budget + 2 * args.block_size + 8
    llm = LLM(model_dir, load_format=load_format, device=args.device, block_size=args.block_size,
              max_num_seqs=max(counts) + args.beside, max_model_len=max_len, enable_prefix_caching=False,
              compression=config, kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    engine, runner = llm.engine, llm.engine.runner
    compressor = runner.compressor
    rng = random.Random(0)
    errors = {}
    if args.check:
        seqs = _fill_requests(llm, args.check, rng)
        errors = _check_kernels(llm, seqs)
        print("kernel vs twin relative error:", {k: f"{v:.2e}" for k, v in errors.items()})
        _finish(llm, seqs)
    rows = []
    for round_index, count in enumerate([min(counts)] + counts):  # round 0 compiles the kernels
        seqs = _fill_requests(llm, count, rng)
        tasks = [plan_compression(s, engine.block_manager, llm.config.compression) for s in seqs]
        compressor.stage_seconds = {}
        start = time.perf_counter()
        runner.compress(tasks)
        _synchronize(runner.device)
        total = time.perf_counter() - start
        stages = compressor.stage_seconds
        compressor.stage_seconds = None
        for seq in seqs:
            engine.block_manager.append_slot(seq)
        step_times = []
        for _ in range(4):  # decode steps over the compacted caches
            start = time.perf_counter()
            runner.execute(seqs, False, engine.eos_token_ids)
            step_times.append(time.perf_counter() - start)
        _finish(llm, seqs)
        if round_index == 0:
            continue
        row = dict(requests=count, total_ms=1000 * total,
                   **{f"{k}_ms": 1000 * v for k, v in stages.items()},
                   decode_step_ms=1000 * sorted(step_times[1:])[len(step_times[1:]) // 2])
        rows.append(row)
        print_table([row], list(row))
    print()
    print_table(rows, list(rows[0]))
    beside = []
    if args.beside:
        print(f"\ncost of a compression beside the decode steps of {args.beside} requests:")
        beside = _cost_beside_decode(llm, args.beside, counts, rng)
    bm = engine.block_manager
    if bm.num_free_blocks != bm.num_blocks:
        raise RuntimeError(f"{bm.num_blocks - bm.num_free_blocks} KV blocks were not returned")
    write_json(args.out, dict(benchmark="compression", model=args.model or args.shape, budget=args.budget,
                              block_size=args.block_size, redundancy=args.redundancy,
                              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, rows=rows,
                              kernel_errors=errors, beside_decode=beside))
    return 0
