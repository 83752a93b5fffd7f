"""``zipage bench kernels``: the attention, KV-store, norm and RoPE kernels against their
twins and the copy ceiling.

Checks each kernel's output against its PyTorch twin on fresh random inputs, then
times it with CUDA events. The paged-decode kernel must read every K and V byte
of every request once, so bytes over time is its achieved bandwidth. The small
elementwise kernels are timed per call inside a CUDA graph (as a decode step runs
them), beside their ``torch.compile``d twins.
"""

from __future__ import annotations

import argparse

import torch

from zipage.bench.common import COPY_BANDWIDTH_BYTES_PER_S, print_table, write_json


def add_kernel_parser(sub) -> None:
    p = sub.add_parser("kernels", help="attention kernel correctness and bandwidth (GPU)")
    p.add_argument("--batch", default="1,64,256")
    p.add_argument("--context", default="1024,4096")
    p.add_argument("--block-size", default="16,256")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: the paged caches as float8 e4m3 with a scale per token and KV head")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run_kernel_bench)


def _time_ms(fn, iters: int = 50) -> float:
    """Median of CUDA-event timings after a warm-up."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _paged_problem(batch, context, block_size, heads, kv_heads, head_dim, dtype, device, ragged=False):
    g = torch.Generator(device=device).manual_seed(batch * 7919 + context)
    lens = torch.full((batch,), context, dtype=torch.int32)
    if ragged:
        lens = torch.randint(1, context + 1, (batch,), generator=torch.Generator().manual_seed(context))
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).view(batch, blocks_per_seq)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g, device=device, dtype=dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g, device=device, dtype=dtype)
    return k, v, tables.to(device=device, dtype=torch.int32), lens.to(device)


def time_decode_variants(batches, contexts, variants, *, row_major_values=False, with_bf16=False) -> list[dict]:
    """Decode-attention experiments on a GPU (Qwen3-8B heads: 32 query and 8 KV heads of 128, pages of 256):
    for each batch and context, the engine's kernel on a float8 cache (and on bf16 with ``with_bf16``) and
    each of ``variants``, ``{name: fn(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    -> out}``, checked against the float64 twin on the dequantized cache and timed (20 calls in a CUDA graph),
    with the share of the copy bandwidth on the bytes read; a line printed and a row returned each. The
    float8 values are token-major (the engine's layout), row-major with ``row_major_values``."""
    from zipage.kernels.paged_decode import paged_decode_attention, paged_decode_attention_torch

    device, heads, kv_heads, dim, block = torch.device("cuda"), 32, 8, 128, 256
    rows = []
    for batch in batches:
        for context in contexts:
            k, v, tables, lens = _paged_problem(batch, context, block, heads, kv_heads, dim, torch.bfloat16, device)
            q = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16)
            scale = dim ** -0.5
            kc, vc, sc = _as_fp8(k, v, True)
            if row_major_values:
                vc = vc.contiguous()
            ref = paged_decode_attention_torch(q.double(), kc, vc, tables, lens, scale, **sc)
            fp8_bytes = 2 * batch * context * kv_heads * (dim + 4)

            def record(name, fn, read=fp8_bytes):
                out = fn()
                us = _graph_us(fn, calls=20)
                row = dict(batch=batch, context=context, variant=name, us=us, rel_err=_rel_err(out, ref),
                           of_copy=read / (us / 1e6) / COPY_BANDWIDTH_BYTES_PER_S)
                rows.append(row)
                print(f"batch {batch:4d} context {context:5d} {name:16s} {us:8.1f} us {row['of_copy']:6.1%} of copy "
                      f"err {row['rel_err']:.2e}", flush=True)

            if with_bf16:
                record("engine, bf16", lambda: paged_decode_attention(q, k, v, tables, lens, scale),
                       2 * batch * context * kv_heads * dim * 2)
            record("engine, fp8", lambda: paged_decode_attention(q, kc, vc, tables, lens, scale, **sc))
            for name, fn in variants.items():
                record(name, lambda fn=fn: fn(q, kc, vc, tables, lens, scale, sc["k_scale"], sc["v_scale"]))
    return rows


def _decode_store_rows(k, v, heads, block_size, window=16) -> list[dict]:
    """The KV store at decode sizes, without and with the window queries a Zipage step also
    writes: each checked to equal its twin exactly (a copy), then timed."""
    from zipage.kernels.store_kv import store_kv, store_kv_torch

    rows = []
    _, _, kvh, d = k.shape
    for tokens in (64, 256):
        gen = torch.Generator(device=k.device).manual_seed(tokens)
        key, value = (torch.randn(tokens, kvh, d, generator=gen, device=k.device, dtype=k.dtype) for _ in range(2))
        query = torch.randn(tokens, heads, d, generator=gen, device=k.device, dtype=k.dtype)
        slots = torch.randperm(k.shape[0] * block_size, generator=gen, device=k.device)[:tokens]
        query_cache = torch.zeros(tokens * window + 1, heads, d, device=k.device, dtype=k.dtype)
        query_slots = torch.randperm(query_cache.shape[0], generator=gen, device=k.device)[:tokens]
        for with_query in (False, True):
            extra = (query, query_cache, query_slots) if with_query else ()
            outputs = []
            for fn in (store_kv, store_kv_torch):
                caches = [t.clone() for t in (k, v, query_cache)]
                fn(key, value, caches[0], caches[1], slots, *((query, caches[2], query_slots) if with_query else ()))
                outputs.append(caches)
            exact = all(torch.equal(a, b) for a, b in zip(*outputs))
            ms = _time_ms(lambda: store_kv(key, value, k, v, slots, *extra))
            moved = (4 * key.numel() + (2 * query.numel() if with_query else 0)) * k.dtype.itemsize
            rows.append(dict(kernel="store_kv+query" if with_query else "store_kv_decode", block_size=block_size,
                             batch=tokens, equals_twin=exact, us=1000 * ms, tb_per_s=moved / ms / 1e9))
            print_table(rows[-1:], list(rows[-1]))
    return rows


def _graph_us(fn, calls: int = 100) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` back-to-back calls:
    the kernels' time plus the gaps between them, as a decode step's graph runs them."""
    fn()  # compiles (Triton, torch.compile) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return 1000 * _time_ms(graph.replay, iters=20) / calls


def _elementwise_rows(heads: int, kv_heads: int, head_dim: int, device=torch.device("cuda"),
                      dtype=torch.bfloat16) -> list[dict]:
    """The norm and RoPE kernels against their eager twins (error) and their ``torch.compile``d
    form (time per call inside a CUDA graph), at decode sizes (hidden size ``heads * head_dim``)."""
    from zipage.kernels.norm_rope import add_rms_norm_triton, norm_rope_triton
    from zipage.layers.norm import add_rms_norm
    from zipage.layers.rotary import norm_and_apply_rope

    hidden, eps = heads * head_dim, 1e-6
    compiled_norm = torch.compile(add_rms_norm.eager, dynamic=True)
    compiled_rope = torch.compile(norm_and_apply_rope.eager, dynamic=True)
    rows = []

    def compare(name, tokens, kernel, eager, compiled, args):
        error = max(_rel_err(a, b) for a, b in zip(kernel(*args), eager(*args)))
        rows.append(dict(kernel=name, tokens=tokens, rel_err=error, triton_us=_graph_us(lambda: kernel(*args)),
                         compiled_us=_graph_us(lambda: compiled(*args))))
        print_table(rows[-1:], list(rows[-1]))

    for tokens in (64, 256):
        gen = torch.Generator(device=device).manual_seed(tokens)

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

        x, residual, weight = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
        compare("add_rms_norm", tokens, add_rms_norm_triton, add_rms_norm.eager, compiled_norm,
                (x, residual, weight, eps))
        qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim)
        q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
        positions = torch.randint(0, 4096, (tokens,), device=device)
        angles = torch.rand(4096, head_dim // 2, device=device) * 6.3
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
        compare("qk_norm_rope", tokens, norm_rope_triton, norm_and_apply_rope.eager, compiled_rope,
                (positions, q, k, cos_sin, randn(head_dim), randn(head_dim), eps))
    return rows


def _as_fp8(k, v, enabled: bool):
    """(k, v, {k_scale, v_scale}) as float8 with their scales when ``enabled``, else unchanged. The
    float8 values are stored token-major, as the engine's float8 cache stores them."""
    if not enabled:
        return k, v, {}
    from zipage.kernels.common import quantize_fp8_torch
    k8, k_scale = quantize_fp8_torch(k)
    v8, v_scale = quantize_fp8_torch(v)
    v8 = v8.movedim(1, 3).contiguous().movedim(3, 1)  # [blocks, kv_heads, head_dim, slots] in memory
    return k8, v8, dict(k_scale=k_scale, v_scale=v_scale)


def run_kernel_bench(args: argparse.Namespace) -> int:
    from zipage.kernels.paged_decode import paged_decode_attention, paged_decode_attention_torch
    from zipage.kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_torch
    from zipage.kernels.store_kv import store_kv

    if not torch.cuda.is_available():
        raise ValueError("zipage bench kernels needs a CUDA GPU")
    device, dtype = torch.device("cuda"), torch.bfloat16
    fp8 = getattr(args, "kv_cache_dtype", "auto") == "fp8"
    h, kvh, d = args.heads, args.kv_heads, args.head_dim
    kv_row_bytes = d + 4 if fp8 else d * dtype.itemsize  # one token's K (or V) row of one KV head
    scale = d ** -0.5
    rows = []
    for block_size in [int(x) for x in args.block_size.split(",")]:
        for context in [int(x) for x in args.context.split(",")]:
            for batch in [int(x) for x in args.batch.split(",")]:
                k, v, tables, lens = _paged_problem(batch, context, block_size, h, kvh, d, dtype, device)
                k, v, sc = _as_fp8(k, v, fp8)
                q = torch.randn(batch, h, d, device=device, dtype=dtype)
                out = paged_decode_attention(q, k, v, tables, lens, scale, **sc)
                ref = paged_decode_attention_torch(q, k, v, tables, lens, scale, **sc)
                ms = _time_ms(lambda: paged_decode_attention(q, k, v, tables, lens, scale, **sc))
                moved = 2 * batch * context * kvh * kv_row_bytes + 2 * q.numel() * dtype.itemsize
                rows.append(dict(kernel="paged_decode", block_size=block_size, batch=batch, context=context,
                                 rel_err=_rel_err(out, ref), us=1000 * ms, tb_per_s=moved / ms / 1e9,
                                 of_copy_ceiling=moved / (ms / 1e3) / COPY_BANDWIDTH_BYTES_PER_S))
                print_table(rows[-1:], list(rows[-1]))
                del k, v
    # Prefill over the paged cache (the prefix-cache path) and the KV store, one size each.
    for block_size in [int(x) for x in args.block_size.split(",")]:
        batch, context, new = 8, 2048, 1024
        k, v, tables, lens = _paged_problem(batch, context, block_size, h, kvh, d, dtype, device)
        k, v, sc = _as_fp8(k, v, fp8)
        cu = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=device)
        q = torch.randn(batch * new, h, d, device=device, dtype=dtype)
        out = paged_prefill_attention(q, k, v, tables, cu, lens, new, scale, **sc)
        ref = paged_prefill_attention_torch(q, k, v, tables, cu, lens, new, scale, **sc)
        ms = _time_ms(lambda: paged_prefill_attention(q, k, v, tables, cu, lens, new, scale, **sc), iters=20)
        # causal FLOPs: each query sees (context - new + its index) keys; 4 FLOPs per q-k-d (QK and PV)
        keys_seen = batch * (new * (context - new) + new * (new + 1) / 2)
        flops = 4 * keys_seen * h * d
        rows.append(dict(kernel="paged_prefill", block_size=block_size, batch=batch, context=context,
                         rel_err=_rel_err(out, ref), us=1000 * ms, tflops=flops / ms / 1e9))
        print_table(rows[-1:], list(rows[-1]))
        tokens = batch * new
        key, value = (torch.randn(tokens, kvh, d, device=device, dtype=dtype) for _ in range(2))
        slots = torch.randperm(k.shape[0] * block_size, device=device)[:tokens]
        ms = _time_ms(lambda: store_kv(key, value, k, v, slots, **sc))
        moved = 2 * key.numel() * dtype.itemsize + 2 * tokens * kvh * kv_row_bytes
        rows.append(dict(kernel="store_kv", block_size=block_size, batch=tokens, us=1000 * ms,
                         tb_per_s=moved / ms / 1e9))
        print_table(rows[-1:], list(rows[-1]))
        if not fp8:  # (its rows are bf16 caches)
            rows += _decode_store_rows(k, v, h, block_size)
    rows += _elementwise_rows(h, kvh, d)
    write_json(args.out, dict(benchmark="kernels", rows=rows, heads=h, kv_heads=kvh, head_dim=d,
                              kv_cache_dtype="fp8" if fp8 else "auto"))
    print()
    for kind in ("paged_decode", "paged_prefill", "store_kv", "store_kv_decode", "store_kv+query", "add_rms_norm",
                 "qk_norm_rope"):
        subset = [r for r in rows if r["kernel"] == kind]
        if not subset:
            continue
        print_table(subset, list(subset[0]))
    return 0
