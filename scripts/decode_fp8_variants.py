"""Float8 decode attention: variants of the decode kernel's inner loop, timed on a GPU.

The engine's float8 decode kernel (``zipage/kernels/paged_decode.py``) reads half the bytes of
a bf16 cache but runs no faster (docs/fp8.md, "Decode attention speed"). This script times
variants of its split kernel beside it, each checked against the float64 twin on the
dequantized cache, at Qwen3-8B heads (32 query and 8 KV heads of 128, blocks of 256, 20 calls
in a CUDA graph), with the share of the copy bandwidth on the bytes read:

- ``base``: the engine's loop (tiles of 128 tokens, 4 warps, 3 stages, integer widening);
  ``w8``, ``b64``, ``s2``, ``s4``: 8 warps, tiles of 64, 2 or 4 stages;
- ``pt``: one block-table lookup per tile (tiles within a page) and unmasked K/V loads;
- ``qk8``: the query quantized to e4m3 (a scale per head) and Q.K^T on float8 tensor cores;
  ``pv8``: the probabilities (times the values' scales) quantized too, P.V in float8;
- ``kf``: tokens as the rows of both products (K as the left operand, Hopper's wgmma), the
  query heads as their columns.

    python scripts/decode_fp8_variants.py [--variants base,pt,qk8] [--out variants.json]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl

from zipage.bench.kernels import time_decode_variants
from zipage.kernels import paged_decode as pd
from zipage.kernels.common import fp8_to_bf16, load_kv_scales


@triton.jit
def _widen(x, FAST: tl.constexpr):
    if FAST:
        return fp8_to_bf16(x)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _variant_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, partial_out_ptr,
                    partial_lse_ptr, scale_log2, q_stride_seq, q_stride_head, out_stride_seq, out_stride_head,
                    cache_stride_block, cache_stride_slot, cache_stride_head, block_table_stride, num_heads,
                    num_splits, min_split_tiles, k_scale_ptr, v_scale_ptr, scale_stride_block, scale_stride_slot,
                    GROUP_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr, MASK_KV: tl.constexpr,
                    QK_FP8: tl.constexpr, PV_FP8: tl.constexpr, PAGE_TILE: tl.constexpr, KV_FIRST: tl.constexpr):
    """The float8 path of ``paged_decode._decode_split_kernel`` (program (seq, kv_head, split)), its
    inner loop varied by the flags (see the module's note); the same split outputs for the engine's
    merge kernel."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), min_split_tiles)
    active_splits = tl.cdiv(num_tiles, tiles_per_split)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    if (tile_begin >= tile_end) & (split > 0):
        return
    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP_SIZE
    heads = kv_head * GROUP_SIZE + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * q_stride_seq + heads[:, None] * q_stride_head + dims[None, :], mask=row_mask[:, None],
                other=0.0)
    if QK_FP8:
        q_scale = tl.maximum(tl.max(tl.abs(q.to(tl.float32)), 1), 1e-8) / 448.0
        q8 = (q.to(tl.float32) / q_scale[:, None]).to(tl.float8e4nv)
        q_fold = q_scale * scale_log2
    block_table_row = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    kv_head_offset = kv_head * cache_stride_head
    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    acc_t = tl.zeros([HEAD_DIM, GROUP_PAD], tl.float32)
    for tile in range(tile_begin, tile_end):
        positions = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = positions < context_len
        if PAGE_TILE:  # a tile lies within one page: one table lookup
            page = tl.load(block_table_row + (tile * BLOCK_N) // PAGE_SIZE)
            pages = tl.zeros([BLOCK_N], tl.int32) + page
        else:
            pages = tl.load(block_table_row + positions // PAGE_SIZE, mask=valid, other=0)
        token_offsets = (pages.to(tl.int64) * cache_stride_block + (positions % PAGE_SIZE) * cache_stride_slot
                         + kv_head_offset)
        kv_offsets = token_offsets[:, None] + dims[None, :]
        if MASK_KV:
            k = tl.load(k_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_offsets)
            v = tl.load(v_cache_ptr + kv_offsets)
        k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, pages, positions, scale_stride_block,
                                          scale_stride_slot, kv_head, valid, PAGE_SIZE)
        if KV_FIRST:  # tokens as the rows of the products: [BLOCK_N, GROUP_PAD] scores, [HEAD_DIM, GROUP_PAD] acc
            if QK_FP8:
                scores_t = tl.dot(k, tl.trans(q8)) * (k_scale[:, None] * q_fold[None, :])
            else:
                scores_t = tl.dot(_widen(k, FAST), tl.trans(q)) * (k_scale * scale_log2)[:, None]
            scores_t = tl.where(valid[:, None], scores_t, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores_t, 0))
            probs_t = tl.exp2(scores_t - new_max[None, :])
            correction = tl.exp2(row_max - new_max)
            row_sum = row_sum * correction + tl.sum(probs_t, 0)
            pv_t = probs_t * v_scale[:, None]
            if PV_FP8:
                p_scale = tl.maximum(tl.max(pv_t, 0), 1e-30) / 448.0
                p8 = (pv_t / p_scale[None, :]).to(tl.float8e4nv)
                acc_t = acc_t * correction[None, :] + tl.dot(tl.trans(v), p8) * p_scale[None, :]
            else:
                acc_t = tl.dot(tl.trans(_widen(v, FAST)), pv_t.to(tl.bfloat16), acc_t * correction[None, :])
            row_max = new_max
        else:
            if QK_FP8:
                scores = tl.dot(q8, tl.trans(k)) * (q_fold[:, None] * k_scale[None, :])
            else:
                scores = tl.dot(q, tl.trans(_widen(k, FAST))) * (k_scale * scale_log2)[None, :]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            probs = tl.exp2(scores - new_max[:, None])
            correction = tl.exp2(row_max - new_max)
            row_sum = row_sum * correction + tl.sum(probs, 1)
            pv = probs * v_scale[None, :]  # v_scale is 0 where invalid
            if PV_FP8:
                p_scale = tl.maximum(tl.max(pv, 1), 1e-30) / 448.0
                p8 = (pv / p_scale[:, None]).to(tl.float8e4nv)
                acc = acc * correction[:, None] + tl.dot(p8, v) * p_scale[:, None]
            else:
                acc = tl.dot(pv.to(tl.bfloat16), _widen(v, FAST), acc * correction[:, None])
            row_max = new_max
    if KV_FIRST:
        acc = tl.trans(acc_t)
    safe_sum = tl.where(row_sum > 0, row_sum, 1.0)
    result = acc / safe_sum[:, None]
    out_offsets = seq * out_stride_seq + heads[:, None] * out_stride_head + dims[None, :]
    if active_splits <= 1:
        tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        partial_rows = (seq * num_heads + heads) * num_splits + split
        tl.store(partial_out_ptr + partial_rows[:, None] * HEAD_DIM + dims[None, :], result, mask=row_mask[:, None])
        tl.store(partial_lse_ptr + partial_rows, row_max + tl.log2(safe_sum), mask=row_mask)



def run_variant(q, kc, vc, tables, lens, scale, k_scale, v_scale, *, block_n=128, warps=4, stages=3, fast=True,
                mask_kv=True, qk_fp8=False, pv_fp8=False, page_tile=False, kv_first=False, num_splits=None, out=None):
    """One variant's decode attention, split as the engine's kernel splits it, merged by its merge kernel."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = kc.shape
    out = torch.empty_like(q) if out is None else out
    num_splits, min_split_tiles = pd.split_plan(batch, num_kv_heads, tables.shape[1] * block_size, block_n, q.device,
                                                num_splits)
    partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _variant_kernel[(batch, num_kv_heads, num_splits)](
        q, kc, vc, tables, lens, out, partial_out, partial_lse, scale * 1.4426950408889634, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), tables.stride(0), num_heads,
        num_splits, min_split_tiles, k_scale, v_scale, k_scale.stride(0), k_scale.stride(1),
        GROUP_SIZE=num_heads // num_kv_heads, GROUP_PAD=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
        HEAD_DIM=head_dim, PAGE_SIZE=block_size, BLOCK_N=block_n, FAST=fast, MASK_KV=mask_kv, QK_FP8=qk_fp8,
        PV_FP8=pv_fp8, PAGE_TILE=page_tile, KV_FIRST=kv_first, num_warps=warps, num_stages=stages)
    if num_splits > 1:
        pd._decode_merge_kernel[(batch, num_heads)](partial_out, partial_lse, lens, out, out.stride(0), out.stride(1),
                                                    num_heads, num_splits, min_split_tiles, HEAD_DIM=head_dim,
                                                    BLOCK_N=block_n, SPLITS_PAD=triton.next_power_of_2(num_splits))
    return out


VARIANTS = {
    "base": {}, "w8": dict(warps=8), "b64": dict(block_n=64), "s2": dict(stages=2), "s4": dict(stages=4),
    "pt": dict(page_tile=True, mask_kv=False), "qk8": dict(qk_fp8=True), "qk8pv8": dict(qk_fp8=True, pv_fp8=True),
    "kf": dict(kv_first=True), "kf_w8": dict(kv_first=True, warps=8), "kf_qk8": dict(kv_first=True, qk_fp8=True),
    "kf_qk8pv8": dict(kv_first=True, qk_fp8=True, pv_fp8=True),
    "kf_qk8_pt": dict(kv_first=True, qk_fp8=True, page_tile=True, mask_kv=False),
    "kf_pt": dict(kv_first=True, page_tile=True, mask_kv=False),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", default="64,256")
    p.add_argument("--context", default="1024,4096")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    # these variants read row-major values (the engine's layout until 2026-12-04)
    variants = {name: functools.partial(run_variant, **VARIANTS[name]) for name in args.variants.split(",")}
    rows = time_decode_variants([int(x) for x in args.batch.split(",")], [int(x) for x in args.context.split(",")],
                                variants, row_major_values=True, with_bf16=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
