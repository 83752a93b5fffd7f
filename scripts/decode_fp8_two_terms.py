"""Float8 decode attention with both products on float8 matrix units, timed on a GPU.

The engine's float8 decode kernel widens the stored keys and values to bf16 in registers before
its bf16 products (``zipage/kernels/paged_decode.py``). This experiment multiplies them as stored
instead: the products are transposed (S^T = K Q^T and O^T = V^T P^T, the keys and the token-major
values as Hopper's float8 warpgroup MMA takes its operands from shared memory), and the query and
the probabilities (times the values' scales) are each split into two e4m3 terms, hi + lo, whose
sum is within about 2^-8 of them (e4m3 alone: 2^-4), multiplied in turn into one float32 sum, so
that the error stays that of bf16 operands. Variants (docs/fp8.md, "Decode attention speed"):

- ``two``: as above, tiles of 128 tokens, 4 warps, 2 stages; ``two_s3``: 3 stages;
  ``two_b64``, ``two_b256``: tiles of 64 or 256 tokens; ``two_w8``: 8 warps;
- ``two_sum``: the softmax's sums kept per token and reduced once after the loop (one
  reduction across the warps a tile fewer);
- ``two_bound``: that, and the probabilities scaled by the split's largest value scale (read
  once before the loop) instead of each tile's largest product (one more reduction fewer);
  ``two_bound_r168`` and ``two_bound_r128``: its registers capped at 168 or 128 a thread.

Each is checked against the float64 twin on the dequantized cache and timed beside the engine's
kernel (20 calls in a CUDA graph, Qwen3-8B heads, blocks of 256), with the share of the copy
bandwidth on the bytes read.

    python scripts/decode_fp8_two_terms.py [--variants two,two_bound] [--batch 64,256] [--context 1040,4096]
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
from zipage.kernels.common import round_to_e4m3
from zipage.kernels.paged_decode import _split_tiles, _store_split, _zero_columns


@triton.jit
def _two_e4m3_terms(x, EXACT_ROUNDING: tl.constexpr):
    """float32 ``x`` (|x| <= 448) as two e4m3 terms whose sum is within about 2^-8 |x| of it
    (e4m3's own rounding is 2^-4): ``hi`` the nearest e4m3 value, ``lo`` that of the rest."""
    if EXACT_ROUNDING:  # the interpreter's conversion mis-rounds
        hi = round_to_e4m3(x)
        return hi.to(tl.float8e4nv), round_to_e4m3(x - hi).to(tl.float8e4nv)
    else:
        hi = x.to(tl.float8e4nv)
        return hi, (x - hi.to(tl.float32)).to(tl.float8e4nv)


@triton.jit
def _two_term_tile(
    q_hi, q_lo, logit_scale, row_max, row_sum, acc, tile, context_len,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, kv_head,
    cache_stride_block, cache_stride_slot, cache_stride_head, scale_stride_block, scale_stride_slot,
    v_stride_block, v_stride_head, v_stride_dim, v_factor,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    EXACT_ROUNDING: tl.constexpr, DEFER_SUM: tl.constexpr, SPLIT_VBOUND: tl.constexpr,
):
    """One tile of ``_decode_two_term_kernel``: the online softmax's state after it. MASKED: the
    tile runs past the context (the sequence's last tile); the others are read unmasked."""
    page = tl.load(block_table_row + (tile * BLOCK_N) // PAGE_SIZE)
    slots = (tile % (PAGE_SIZE // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = tile * BLOCK_N + tl.arange(0, BLOCK_N) < context_len
    dims = tl.arange(0, HEAD_DIM)
    k_rows = k_cache_ptr + (page.to(tl.int64) * cache_stride_block + slots * cache_stride_slot
                            + kv_head * cache_stride_head)[:, None]
    scale_offsets = page.to(tl.int64) * scale_stride_block + slots * scale_stride_slot + kv_head
    v_cols = v_cache_ptr + page.to(tl.int64) * v_stride_block + kv_head * v_stride_head + slots[None, :]
    if MASKED:
        k = tl.load(k_rows + dims[None, :], mask=valid[:, None], other=0.0)
        k_scale = tl.load(k_scale_ptr + scale_offsets, mask=valid, other=0.0)
        v_scale = tl.load(v_scale_ptr + scale_offsets, mask=valid, other=0.0)
        v = _zero_columns(tl.load(v_cols + dims[:, None] * v_stride_dim), valid)  # stale bytes may be NaN
    else:
        k = tl.load(k_rows + dims[None, :])
        k_scale = tl.load(k_scale_ptr + scale_offsets)
        v_scale = tl.load(v_scale_ptr + scale_offsets)
        v = tl.load(v_cols + dims[:, None] * v_stride_dim)
    # Transposed, so that the float8 operands meet the matrix units as they lie (Hopper's warpgroup
    # MMA takes its first operand 64 rows at a time and both summed along contiguous bytes): S^T
    # [tokens, query heads] = K [tokens, dims] @ Q^T, both terms of the query in turn.
    scores = tl.dot(k, tl.trans(q_hi))
    scores = tl.dot(k, tl.trans(q_lo), scores)
    scores = scores * k_scale[:, None] * logit_scale[None, :]
    if MASKED:
        scores = tl.where(valid[:, None], scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 0))  # finite: every tile holds a valid token
    probs = tl.exp2(scores - new_max[None, :])
    correction = tl.exp2(row_max - new_max)
    if DEFER_SUM:
        row_sum = row_sum * correction[None, :] + probs
    else:
        row_sum = row_sum * correction + tl.sum(probs, 0)
    # Each probability times its value's scale, scaled per query head so that the tile's largest
    # is 448, in two e4m3 terms; O^T [dims, query heads] += V^T [dims, tokens] @ P^T, the values
    # token-major as stored (the tokens of a dimension contiguous: P @ V's summed axis).
    if SPLIT_VBOUND:
        p_hi, p_lo = _two_e4m3_terms(probs * (v_scale * v_factor)[:, None], EXACT_ROUNDING)
        product = tl.dot(v, p_hi)
        product = tl.dot(v, p_lo, product)
        acc = acc * correction[None, :] + product
    else:
        weighted = probs * v_scale[:, None]
        bound = tl.max(weighted, 0)
        row_scale = tl.where(bound > 0, bound * (1.0 / 448.0), 1.0)
        p_hi, p_lo = _two_e4m3_terms(weighted * (1.0 / row_scale)[None, :], EXACT_ROUNDING)
        product = tl.dot(v, p_hi)
        product = tl.dot(v, p_lo, product)
        acc = acc * correction[None, :] + product * row_scale[None, :]
    return new_max, row_sum, acc


@triton.jit(do_not_specialize=["block_table_stride", "num_splits"])
def _decode_two_term_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    q_stride_seq,
    q_stride_head,
    out_stride_seq,
    out_stride_head,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    block_table_stride,
    num_heads,
    num_splits,
    min_split_tiles,
    k_scale_ptr,
    v_scale_ptr,
    scale_stride_block,
    scale_stride_slot,
    v_stride_block,
    v_stride_slot,
    v_stride_head,
    v_stride_dim,
    GROUP_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    EXACT_ROUNDING: tl.constexpr,
    DEFER_SUM: tl.constexpr,
    SPLIT_VBOUND: tl.constexpr,
):
    """``paged_decode._decode_split_kernel`` for a float8 cache with token-major values and tiles within a
    page, with both products on float8 matrix units: the keys and values are multiplied as
    stored, not widened; the query and the probabilities (times the values' scales) each as the
    sum of two e4m3 terms, multiplied in turn into one float32 sum. DEFER_SUM: the softmax's
    sums kept per token and reduced once after the loop; SPLIT_VBOUND: the probabilities scaled
    by the split's largest value scale instead of each tile's largest product."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    tile_begin, tile_end, active_splits = _split_tiles(context_len, split, num_splits, min_split_tiles, BLOCK_N)
    if (tile_begin >= tile_end) & (split > 0):
        return

    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP_SIZE
    heads = kv_head * GROUP_SIZE + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * q_stride_seq + heads[:, None] * q_stride_head + dims[None, :],
                mask=row_mask[:, None], other=0.0).to(tl.float32)
    # Each query head scaled so that its largest element is 448; the logits scaled back.
    q_bound = tl.max(tl.abs(q), 1)
    q_scale = tl.where(q_bound > 0, q_bound * (1.0 / 448.0), 1.0)
    q_hi, q_lo = _two_e4m3_terms(q * (1.0 / q_scale)[:, None], EXACT_ROUNDING)
    logit_scale = q_scale * scale_log2
    block_table_row = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    if DEFER_SUM:
        row_sum = tl.zeros([BLOCK_N, GROUP_PAD], tl.float32)
    else:
        row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([HEAD_DIM, GROUP_PAD], tl.float32)  # transposed: [dims, query heads]
    v_factor = 1.0
    if SPLIT_VBOUND:  # the split's largest value scale: probabilities (<= 1) times scales <= 448
        v_bound = tl.zeros([BLOCK_N], tl.float32)
        for tile in range(tile_begin, tile_end):
            page = tl.load(block_table_row + (tile * BLOCK_N) // PAGE_SIZE)
            slots = (tile % (PAGE_SIZE // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
            valid = tile * BLOCK_N + tl.arange(0, BLOCK_N) < context_len
            v_bound = tl.maximum(v_bound, tl.load(v_scale_ptr + page.to(tl.int64) * scale_stride_block
                                                  + slots * scale_stride_slot + kv_head, mask=valid, other=0.0))
        v_max = tl.max(v_bound, 0)
        v_factor = tl.where(v_max > 0, 448.0 / v_max, 1.0)
    full_end = tl.maximum(tl.minimum(tile_end, context_len // BLOCK_N), tile_begin)
    for tile in range(tile_begin, full_end):
        row_max, row_sum, acc = _two_term_tile(
            q_hi, q_lo, logit_scale, row_max, row_sum, acc, tile, context_len,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, kv_head,
            cache_stride_block, cache_stride_slot, cache_stride_head, scale_stride_block, scale_stride_slot,
            v_stride_block, v_stride_head, v_stride_dim, v_factor, HEAD_DIM, PAGE_SIZE, BLOCK_N, False,
            EXACT_ROUNDING, DEFER_SUM, SPLIT_VBOUND)
    if full_end < tile_end:
        row_max, row_sum, acc = _two_term_tile(
            q_hi, q_lo, logit_scale, row_max, row_sum, acc, full_end, context_len,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, kv_head,
            cache_stride_block, cache_stride_slot, cache_stride_head, scale_stride_block, scale_stride_slot,
            v_stride_block, v_stride_head, v_stride_dim, v_factor, HEAD_DIM, PAGE_SIZE, BLOCK_N, True,
            EXACT_ROUNDING, DEFER_SUM, SPLIT_VBOUND)
    if DEFER_SUM:
        row_sum = tl.sum(row_sum, 0)
    if SPLIT_VBOUND:
        acc = acc * (1.0 / v_factor)
    _store_split(tl.trans(acc), row_max, row_sum, out_ptr, partial_out_ptr, partial_lse_ptr, seq, heads, row_mask,
                 split, num_splits, active_splits, num_heads, out_stride_seq, out_stride_head, HEAD_DIM, SINGLE_SPLIT)


def run_two_terms(q, kc, vc, tables, lens, scale, k_scale, v_scale, *, block_n=128, warps=4, stages=2,
                  defer_sum=False, split_bound=False, max_registers=None, num_splits=None, min_split_tokens=None,
                  out=None):
    """Decode attention with both products in float8, split as the engine's kernel splits it (or as
    ``num_splits`` / ``min_split_tokens`` say) and merged by its merge kernel. ``vc`` holds the values
    token-major (``bench.kernels._as_fp8``); pages hold whole tiles."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = kc.shape
    assert vc.stride(1) == 1 and block_size % block_n == 0, "token-major values, tiles within a page"
    out = torch.empty_like(q) if out is None else out
    num_splits, min_split_tiles = pd.split_plan(batch, num_kv_heads, tables.shape[1] * block_size, block_n, q.device,
                                                num_splits, min_split_tokens)
    partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    options = dict(num_warps=warps, num_stages=stages)
    if max_registers is not None and q.is_cuda:
        options["maxnreg"] = max_registers
    _decode_two_term_kernel[(batch, num_kv_heads, num_splits)](
        q, kc, vc, tables, lens, out, partial_out, partial_lse, scale * 1.4426950408889634, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), tables.stride(0), num_heads,
        num_splits, min_split_tiles, k_scale, v_scale, k_scale.stride(0), k_scale.stride(1), *vc.stride(),
        GROUP_SIZE=num_heads // num_kv_heads, GROUP_PAD=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
        HEAD_DIM=head_dim, PAGE_SIZE=block_size, BLOCK_N=block_n, SINGLE_SPLIT=num_splits == 1,
        EXACT_ROUNDING=not q.is_cuda, DEFER_SUM=defer_sum, SPLIT_VBOUND=split_bound, **options)
    if num_splits > 1:
        pd._decode_merge_kernel[(batch, num_heads)](partial_out, partial_lse, lens, out, out.stride(0), out.stride(1),
                                                    num_heads, num_splits, min_split_tiles, HEAD_DIM=head_dim,
                                                    BLOCK_N=block_n, SPLITS_PAD=triton.next_power_of_2(num_splits))
    return out


VARIANTS = {
    "two": {}, "two_s3": dict(stages=3), "two_b64": dict(block_n=64), "two_b256": dict(block_n=256),
    "two_w8": dict(warps=8), "two_sum": dict(defer_sum=True),
    "two_bound": dict(defer_sum=True, split_bound=True),
    "two_bound_r168": dict(defer_sum=True, split_bound=True, max_registers=168),
    "two_bound_r128": dict(defer_sum=True, split_bound=True, max_registers=128),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", default="16,64,128,256")
    p.add_argument("--context", default="1040,2048,4096")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    variants = {name: functools.partial(run_two_terms, **VARIANTS[name]) for name in args.variants.split(",")}
    rows = time_decode_variants([int(x) for x in args.batch.split(",")], [int(x) for x in args.context.split(",")],
                                variants)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
