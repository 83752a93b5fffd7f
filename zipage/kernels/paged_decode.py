"""Decode attention over the paged KV cache (one query token per sequence).

Flash-decoding with split-K: program (seq, kv_head, split) attends all query
heads of one GQA group to a contiguous, tile-aligned share of that sequence's
context, so every K/V tile is read from memory exactly once. Each split writes
a normalised partial output and its log-sum-exp; a second kernel merges them.
A split gets at least DECODE_MIN_SPLIT_TOKENS of context, so a short sequence
uses fewer splits than the launch has (decided on the device from its length,
which keeps the launch CUDA-graph safe), and one that needs a single split
writes its output directly, with nothing to merge.
"""

import math

import torch

from zipage.kernels.common import (dot_precision, fast_fp8_widening, is_fp8, launch_kernel, load_kv_scales,
                                   multiprocessor_count, pdl_launch, round_to_e4m3, split_pdl, token_major,
                                   wait_for_previous_kernel, widen_fp8)

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: only the PyTorch twin is usable
    triton = None

# Tuning knobs, measured on an H200 (bf16, 32 query / 8 KV heads).
# (tokens per K/V tile, num_warps, num_stages) by bytes per cached K/V row
# (head_dim * element size, clamped to 128..512); the 512 entry also keeps
# 1 KiB rows (float32, head_dim 256) within shared memory.
DECODE_TILE_CONFIG = {128: (128, 4, 3), 256: (64, 4, 3), 512: (32, 4, 2)}
# A float8 cache read a half of head_dim at a time (``_decode_split_kernel``'s HALVES), by the
# same key; measured on an H200 (Qwen3-8B heads, batch 16-256, contexts of 2,048-4,096 tokens,
# docs/fp8.md "Decode attention speed"): two stages beat three by 0-8%, 8 warps and tiles of
# 64 or 256 tokens lost at every size; with the values token-major (a float8 cache's layout)
# three stages, 8 warps and 64-token tiles lost again (15-45%).
DECODE_TILE_CONFIG_FP8_HALVES = {128: (128, 4, 2)}
# Split-K aims at this many programs per SM (about 8 waves of the 4 that are
# resident at once), so that batches of unequal context lengths balance
# across SMs; DECODE_MIN_SPLIT_TOKENS below keeps short contexts from being cut
# into splits too small to pay for their merge.
DECODE_PROGRAMS_PER_SM = 32
DECODE_MAX_SPLITS = 64  # bounds the merge kernel's register tile
# Context tokens a split gets at least, once the batch alone fills the GPU. Measured on
# an H200 in CUDA graphs (batch 64, equal contexts of 1,024 tokens): 8 splits of 128
# tokens took 81 us, one split 66 us (3.3 against 4.1 TB/s); at 4,096 tokens 268
# against 244 us. With contexts of unequal length (128..8,192) the 8 splits balanced
# best (278-285 us). A smaller batch scales the minimum down in proportion to
# DECODE_FILL_PROGRAMS_PER_SM programs per SM: at batch 1 one split per KV head left
# 124 of 132 SMs idle (32 us per layer against 8 at 1,024 tokens).
DECODE_MIN_SPLIT_TOKENS = 1024
DECODE_FILL_PROGRAMS_PER_SM = 4
# A float8 cache (values token-major, tiles within a page): multiply P @ V on float8 matrix units
# (``_decode_fp8_probs_kernel``: the probabilities rounded to e4m3, the values as stored) instead of
# widening the values to bf16. Off by default: compiled for sm_90 its loop takes 856 instructions a
# 128-token tile against 1,174 (Hopper's float8 warpgroup MMA, the values copied straight to shared
# memory) but 180 registers a thread against 122; on an H200, capped at 128 registers, the kernel
# alone ran 0-8% faster from 64 requests on, but whole decode steps ran 2-3% slower and reasoning-8k
# 0.8% slower, and the rounding adds about 1-2% relative error to the attention output (the float8
# cache itself about 4-6%; docs/fp8.md).
FP8_PROBABILITIES = False
# Registers a thread of that kernel may hold (Triton's ``maxnreg``; None: as the compiler needs). At 180
# two programs fit an SM; 168 (three) spills 10 instructions' worth, 128 (four, as the widening kernel)
# 23, compiled for sm_90. On an H200, from 16 requests on, uncapped ran 13-28% slower than 128
# (scripts/decode_tile_sweep.py).
FP8_PROBS_MAX_REGISTERS = None
# Registers a thread of the widening kernel may hold with a float8 cache (Triton's ``maxnreg``; None: as
# the compiler needs). Compiled for sm_90 with Triton 3.6 at Qwen3-8B heads it takes 128, so four
# programs fit an SM where their shared memory (41 KB each) would allow five; capped at 96 it fits
# five with nothing spilled, for 7% more instructions (registers are granted 8 a thread at a time: no
# cap above 96 fits a fifth). On an H200 the cap at 96 ran decode attention 3-14% faster with random
# context lengths but up to 15% slower with equal ones at 64-128 requests, and whole decode steps 1-3%
# slower (docs/fp8.md; ``bash scripts/gpu_fp8.sh registers``), so it is off.
FP8_WIDENING_MAX_REGISTERS = None

_LOG2_E = 1.4426950408889634


if triton is not None:

    @triton.jit
    def _split_tiles(context_len, split, num_splits, min_split_tiles, BLOCK_N: tl.constexpr):
        """(first tile, end tile, active splits) of this split of a sequence's context_len tokens."""
        num_tiles = tl.cdiv(context_len, BLOCK_N)
        tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), min_split_tiles)
        tile_begin = split * tiles_per_split
        return tile_begin, tl.minimum(tile_begin + tiles_per_split, num_tiles), tl.cdiv(num_tiles, tiles_per_split)

    @triton.jit
    def _store_split(acc, row_max, row_sum, out_ptr, partial_out_ptr, partial_lse_ptr, seq, heads, row_mask, split,
                     num_splits, active_splits, num_heads, out_stride_seq, out_stride_head,
                     HEAD_DIM: tl.constexpr, SINGLE_SPLIT: tl.constexpr):
        """A split's normalised output [query heads, HEAD_DIM]: the sequence's output when it needs one
        split (always when SINGLE_SPLIT), else a partial output and its log-sum-exp for the merge."""
        # context_len 0 leaves row_sum 0: write zeros, not NaN.
        safe_sum = tl.where(row_sum > 0, row_sum, 1.0)
        result = acc / safe_sum[:, None]
        dims = tl.arange(0, HEAD_DIM)
        if SINGLE_SPLIT or active_splits <= 1:  # nothing to merge
            out_offsets = seq * out_stride_seq + heads[:, None] * out_stride_head + dims[None, :]
            tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        else:
            partial_rows = (seq * num_heads + heads) * num_splits + split
            tl.store(partial_out_ptr + partial_rows[:, None] * HEAD_DIM + dims[None, :], result,
                     mask=row_mask[:, None])
            tl.store(partial_lse_ptr + partial_rows, row_max + tl.log2(safe_sum), mask=row_mask)

    @triton.jit(do_not_specialize=["block_table_stride", "num_splits"])
    def _decode_split_kernel(
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
        DOT_PRECISION: tl.constexpr,
        FP8: tl.constexpr,
        FAST_FP8: tl.constexpr,
        HALVES: tl.constexpr,
        V_TOKEN_MAJOR: tl.constexpr,
        PAGE_PER_TILE: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """One program per (seq, kv_head, split); writes `out` directly when the sequence
        needs one split (always when SINGLE_SPLIT). V_TOKEN_MAJOR: the values are stored
        token-major (v_stride_slot 1). PAGE_PER_TILE: BLOCK_N divides PAGE_SIZE, so that a tile
        lies in one page (with token-major values, each value dimension's tokens are then one
        contiguous run)."""
        wait_for_previous_kernel(PDL)
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)

        context_len = tl.load(context_lens_ptr + seq)
        tile_begin, tile_end, active_splits = _split_tiles(context_len, split, num_splits, min_split_tiles, BLOCK_N)
        # Splits past a short context have no work; the merge kernel skips
        # them. Split 0 always runs so that a context_len of 0 writes zeros.
        if (tile_begin >= tile_end) & (split > 0):
            return

        # The group's query heads are the rows of a matrix, padded to the
        # smallest tl.dot shape; padding rows are zero and never stored.
        rows = tl.arange(0, GROUP_PAD)
        row_mask = rows < GROUP_SIZE
        heads = kv_head * GROUP_SIZE + rows
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + seq * q_stride_seq + heads[:, None] * q_stride_head + dims[None, :],
            mask=row_mask[:, None],
            other=0.0,
        )

        block_table_row = block_tables_ptr + seq.to(tl.int64) * block_table_stride
        kv_head_offset = kv_head * cache_stride_head
        row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        row_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        # HALVES: each tile's keys and values are read, widened and multiplied a half of head_dim
        # at a time, so that half as many widened elements are live in registers (float8 caches).
        HALF: tl.constexpr = HEAD_DIM // 2
        half_dims = tl.arange(0, HALF)
        if HALVES:
            q_rows = q_ptr + seq * q_stride_seq + heads[:, None] * q_stride_head
            q_lo = tl.load(q_rows + half_dims[None, :], mask=row_mask[:, None], other=0.0)
            q_hi = tl.load(q_rows + HALF + half_dims[None, :], mask=row_mask[:, None], other=0.0)
            acc_lo = tl.zeros([GROUP_PAD, HALF], tl.float32)
            acc_hi = tl.zeros([GROUP_PAD, HALF], tl.float32)
        for tile in range(tile_begin, tile_end):
            positions = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            valid = positions < context_len
            if PAGE_PER_TILE:  # one table entry, and slots known to be consecutive
                page = tl.load(block_table_row + (tile * BLOCK_N) // PAGE_SIZE)
                pages = tl.full([BLOCK_N], 0, tl.int32) + page
                slots = (tile % (PAGE_SIZE // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
            else:
                # A tile may span several pages when BLOCK_N > PAGE_SIZE: look up the
                # page of every token (repeated entries hit the cache).
                pages = tl.load(block_table_row + positions // PAGE_SIZE, mask=valid, other=0)
                slots = positions % PAGE_SIZE
            token_offsets = pages.to(tl.int64) * cache_stride_block + slots * cache_stride_slot + kv_head_offset
            if HALVES:
                k_rows = k_cache_ptr + token_offsets[:, None]
                k_lo = tl.load(k_rows + half_dims[None, :], mask=valid[:, None], other=0.0)
                scores = tl.dot(q_lo, tl.trans(widen_fp8(k_lo, q.dtype, FAST_FP8)), input_precision=DOT_PRECISION)
                k_hi = tl.load(k_rows + HALF + half_dims[None, :], mask=valid[:, None], other=0.0)
                scores = tl.dot(q_hi, tl.trans(widen_fp8(k_hi, q.dtype, FAST_FP8)), scores,
                                input_precision=DOT_PRECISION)
            else:
                kv_offsets = token_offsets[:, None] + dims[None, :]
                # Masked (not just discarded) so that stale NaNs past the context
                # cannot reach the P @ V product.
                k = tl.load(k_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0)
                if not V_TOKEN_MAJOR:
                    v = tl.load(v_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0)
                if FP8:
                    # float8 -> the query's dtype is exact; each key's scale multiplies its logit
                    # and each value's scale its probability (the same products as dequantizing).
                    k = widen_fp8(k, q.dtype, FAST_FP8)
                    if not V_TOKEN_MAJOR:
                        v = widen_fp8(v, q.dtype, FAST_FP8)
                scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if FP8:
                k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, pages, positions, scale_stride_block,
                                                  scale_stride_slot, kv_head, valid, PAGE_SIZE)
                scores = scores * (k_scale * scale_log2)[None, :]
            else:
                scores = scores * scale_log2
            scores = tl.where(valid[None, :], scores, float("-inf"))
            # Every tile holds at least one valid token, so new_max is finite.
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            probs = tl.exp2(scores - new_max[:, None])
            correction = tl.exp2(row_max - new_max)
            row_sum = row_sum * correction + tl.sum(probs, 1)
            if FP8:
                probs = probs * v_scale[None, :]
            probs = probs.to(q.dtype)
            if V_TOKEN_MAJOR:
                # Values [dims, tokens] of one page, tokens contiguous: P @ V sums over the tokens,
                # and each thread's operand words hold consecutive ones. Past the context they are
                # the page's stale values (finite: the cache starts zeroed and FAST_FP8's widening
                # makes every byte finite) times a probability of 0, so only the slow widening,
                # which would turn a stale NaN byte into NaN, needs the mask (it breaks the vectors).
                if PAGE_PER_TILE:
                    v_cols = (v_cache_ptr + page.to(tl.int64) * v_stride_block + kv_head * v_stride_head
                              + slots[None, :])
                    v_mask = valid[None, :] | FAST_FP8
                else:  # pages smaller than a tile: each token's own page, byte by byte
                    v_cols = (v_cache_ptr + (pages.to(tl.int64) * v_stride_block + kv_head * v_stride_head
                                             + slots)[None, :])
                    v_mask = valid[None, :]
                if HALVES:
                    v_lo = tl.load(v_cols + half_dims[:, None] * v_stride_dim, mask=v_mask, other=0.0)
                    acc_lo = tl.dot(probs, tl.trans(widen_fp8(v_lo, q.dtype, FAST_FP8)), acc_lo * correction[:, None],
                                    input_precision=DOT_PRECISION)
                    v_hi = tl.load(v_cols + (HALF + half_dims[:, None]) * v_stride_dim, mask=v_mask, other=0.0)
                    acc_hi = tl.dot(probs, tl.trans(widen_fp8(v_hi, q.dtype, FAST_FP8)), acc_hi * correction[:, None],
                                    input_precision=DOT_PRECISION)
                else:
                    v = tl.load(v_cols + dims[:, None] * v_stride_dim, mask=v_mask, other=0.0)
                    if FP8:
                        v = widen_fp8(v, q.dtype, FAST_FP8)
                    acc = tl.dot(probs, tl.trans(v), acc * correction[:, None], input_precision=DOT_PRECISION)
            elif HALVES:
                v_rows = v_cache_ptr + token_offsets[:, None]
                v_lo = tl.load(v_rows + half_dims[None, :], mask=valid[:, None], other=0.0)
                acc_lo = tl.dot(probs, widen_fp8(v_lo, q.dtype, FAST_FP8), acc_lo * correction[:, None],
                                input_precision=DOT_PRECISION)
                v_hi = tl.load(v_rows + HALF + half_dims[None, :], mask=valid[:, None], other=0.0)
                acc_hi = tl.dot(probs, widen_fp8(v_hi, q.dtype, FAST_FP8), acc_hi * correction[:, None],
                                input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(probs, v, acc * correction[:, None], input_precision=DOT_PRECISION)
            row_max = new_max

        if HALVES:  # [lo | hi] along head_dim
            acc = tl.join(acc_lo, acc_hi).permute(0, 2, 1).reshape(GROUP_PAD, HEAD_DIM)
        _store_split(acc, row_max, row_sum, out_ptr, partial_out_ptr, partial_lse_ptr, seq, heads, row_mask, split,
                     num_splits, active_splits, num_heads, out_stride_seq, out_stride_head, HEAD_DIM, SINGLE_SPLIT)

    @triton.jit
    def _zero_columns(x, keep):
        """Float8 ``x`` [rows, columns] with the columns where ``keep`` is off set to +0 (as bytes)."""
        return tl.where(keep[None, :], x.to(tl.uint8, bitcast=True), 0).to(tl.float8e4nv, bitcast=True)

    @triton.jit
    def _fp8_probs_tile(
        q_lo, q_hi, row_max, row_sum, acc_lo, acc_hi, tile, context_len,
        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, kv_head, scale_log2,
        cache_stride_block, cache_stride_slot, cache_stride_head, scale_stride_block, scale_stride_slot,
        v_stride_block, v_stride_head, v_stride_dim,
        HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
        FAST_FP8: tl.constexpr, MASKED: tl.constexpr, EXACT_ROUNDING: tl.constexpr,
    ):
        """One tile of ``_decode_fp8_probs_kernel``: the online softmax's state after it. MASKED: the
        tile runs past the context (the sequence's last tile); the others are read unmasked."""
        page = tl.load(block_table_row + (tile * BLOCK_N) // PAGE_SIZE)
        slots = (tile % (PAGE_SIZE // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = tile * BLOCK_N + tl.arange(0, BLOCK_N) < context_len
        half_dims = tl.arange(0, HALF)
        k_rows = k_cache_ptr + (page.to(tl.int64) * cache_stride_block + slots * cache_stride_slot
                                + kv_head * cache_stride_head)[:, None]
        scale_offsets = page.to(tl.int64) * scale_stride_block + slots * scale_stride_slot + kv_head
        v_cols = v_cache_ptr + page.to(tl.int64) * v_stride_block + kv_head * v_stride_head + slots[None, :]
        if MASKED:
            k_lo = tl.load(k_rows + half_dims[None, :], mask=valid[:, None], other=0.0)
            k_hi = tl.load(k_rows + HALF + half_dims[None, :], mask=valid[:, None], other=0.0)
            k_scale = tl.load(k_scale_ptr + scale_offsets, mask=valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_offsets, mask=valid, other=0.0)
            # Stale bytes past the context may be float8 NaNs, which a probability of 0 does not cancel:
            # read whole words, then zero those tokens' bytes (a masked load would go byte by byte and
            # hold each byte in a register of its own: 235 registers a thread against 180, compiled for sm_90)
            v_lo = _zero_columns(tl.load(v_cols + half_dims[:, None] * v_stride_dim), valid)
            v_hi = _zero_columns(tl.load(v_cols + (HALF + half_dims[:, None]) * v_stride_dim), valid)
        else:
            k_lo = tl.load(k_rows + half_dims[None, :])
            k_hi = tl.load(k_rows + HALF + half_dims[None, :])
            k_scale = tl.load(k_scale_ptr + scale_offsets)
            v_scale = tl.load(v_scale_ptr + scale_offsets)
            v_lo = tl.load(v_cols + half_dims[:, None] * v_stride_dim)
            v_hi = tl.load(v_cols + (HALF + half_dims[:, None]) * v_stride_dim)
        scores = tl.dot(q_lo, tl.trans(widen_fp8(k_lo, q_lo.dtype, FAST_FP8)), input_precision=DOT_PRECISION)
        scores = tl.dot(q_hi, tl.trans(widen_fp8(k_hi, q_hi.dtype, FAST_FP8)), scores, input_precision=DOT_PRECISION)
        scores = scores * (k_scale * scale_log2)[None, :]
        if MASKED:
            scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))  # finite: every tile holds a valid token
        probs = tl.exp2(scores - new_max[:, None])
        correction = tl.exp2(row_max - new_max)
        row_sum = row_sum * correction + tl.sum(probs, 1)
        # Each probability times its value's scale, in float8: scaled per query head so that the
        # largest of the tile is 448 (e4m3's largest), the scale applied to the product instead.
        weighted = probs * v_scale[None, :]
        bound = tl.max(weighted, 1)
        row_scale = tl.where(bound > 0, bound * (1.0 / 448.0), 1.0)
        weighted = weighted * (1.0 / row_scale)[:, None]
        if EXACT_ROUNDING:
            weighted = round_to_e4m3(weighted)
        weights = weighted.to(tl.float8e4nv)
        # Transposed, so that the float8 operands meet the matrix units as they lie: O^T [dims, heads]
        # += V^T [dims, tokens] @ P^T [tokens, heads], V^T being a token-major block's own layout.
        acc_lo = acc_lo * correction[None, :] + row_scale[None, :] * tl.dot(v_lo, tl.trans(weights))
        acc_hi = acc_hi * correction[None, :] + row_scale[None, :] * tl.dot(v_hi, tl.trans(weights))
        return new_max, row_sum, acc_lo, acc_hi

    @triton.jit(do_not_specialize=["block_table_stride", "num_splits"])
    def _decode_fp8_probs_kernel(
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
        DOT_PRECISION: tl.constexpr,
        FAST_FP8: tl.constexpr,
        EXACT_ROUNDING: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """``_decode_split_kernel`` for a float8 cache with token-major values and tiles within a
        page, with P @ V on float8 matrix units (``FP8_PROBABILITIES``): the values are multiplied
        as stored, not widened, and the probabilities (times the values' scales) are rounded to
        e4m3. Q @ K^T is as in ``_decode_split_kernel`` (keys widened exactly, half rows)."""
        wait_for_previous_kernel(PDL)
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
        HALF: tl.constexpr = HEAD_DIM // 2
        half_dims = tl.arange(0, HALF)
        q_rows = q_ptr + seq * q_stride_seq + heads[:, None] * q_stride_head
        q_lo = tl.load(q_rows + half_dims[None, :], mask=row_mask[:, None], other=0.0)
        q_hi = tl.load(q_rows + HALF + half_dims[None, :], mask=row_mask[:, None], other=0.0)
        block_table_row = block_tables_ptr + seq.to(tl.int64) * block_table_stride
        row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        row_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc_lo = tl.zeros([HALF, GROUP_PAD], tl.float32)  # transposed: [dims, query heads]
        acc_hi = tl.zeros([HALF, GROUP_PAD], tl.float32)
        # The tiles wholly inside the context unmasked; then the sequence's partial last tile, if
        # this split has it.
        full_end = tl.maximum(tl.minimum(tile_end, context_len // BLOCK_N), tile_begin)
        for tile in range(tile_begin, full_end):
            row_max, row_sum, acc_lo, acc_hi = _fp8_probs_tile(
                q_lo, q_hi, row_max, row_sum, acc_lo, acc_hi, tile, context_len,
                k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, kv_head, scale_log2,
                cache_stride_block, cache_stride_slot, cache_stride_head, scale_stride_block, scale_stride_slot,
                v_stride_block, v_stride_head, v_stride_dim,
                HALF, PAGE_SIZE, BLOCK_N, DOT_PRECISION, FAST_FP8, False, EXACT_ROUNDING)
        if full_end < tile_end:
            row_max, row_sum, acc_lo, acc_hi = _fp8_probs_tile(
                q_lo, q_hi, row_max, row_sum, acc_lo, acc_hi, full_end, context_len,
                k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, kv_head, scale_log2,
                cache_stride_block, cache_stride_slot, cache_stride_head, scale_stride_block, scale_stride_slot,
                v_stride_block, v_stride_head, v_stride_dim,
                HALF, PAGE_SIZE, BLOCK_N, DOT_PRECISION, FAST_FP8, True, EXACT_ROUNDING)

        acc = tl.join(tl.trans(acc_lo), tl.trans(acc_hi)).permute(0, 2, 1).reshape(GROUP_PAD, HEAD_DIM)
        _store_split(acc, row_max, row_sum, out_ptr, partial_out_ptr, partial_lse_ptr, seq, heads, row_mask, split,
                     num_splits, active_splits, num_heads, out_stride_seq, out_stride_head, HEAD_DIM, SINGLE_SPLIT)

    @triton.jit(do_not_specialize=["num_splits"])
    def _decode_merge_kernel(
        partial_out_ptr,
        partial_lse_ptr,
        context_lens_ptr,
        out_ptr,
        out_stride_seq,
        out_stride_head,
        num_heads,
        num_splits,
        min_split_tiles,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """One program per (seq, head): log-sum-exp weighted sum of the split outputs."""
        wait_for_previous_kernel(PDL)
        seq = tl.program_id(0)
        head = tl.program_id(1)

        # Recompute which splits got work (same arithmetic as the split kernel):
        # the others returned early and left their scratch rows unwritten.
        context_len = tl.load(context_lens_ptr + seq)
        num_tiles = tl.cdiv(context_len, BLOCK_N)
        tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), min_split_tiles)  # >= 1
        active_splits = tl.cdiv(num_tiles, tiles_per_split)
        if active_splits <= 1:  # the split kernel wrote this sequence's output itself
            return

        splits = tl.arange(0, SPLITS_PAD)
        split_mask = splits < active_splits
        partial_rows = (seq * num_heads + head) * num_splits + splits
        lse = tl.load(partial_lse_ptr + partial_rows, mask=split_mask, other=float("-inf"))
        max_lse = tl.max(lse, 0)
        # No active split (context_len 0): keep the weights 0 instead of NaN.
        max_lse = tl.where(max_lse == float("-inf"), 0.0, max_lse)
        weights = tl.exp2(lse - max_lse)
        dims = tl.arange(0, HEAD_DIM)
        partial_out = tl.load(
            partial_out_ptr + partial_rows[:, None] * HEAD_DIM + dims[None, :],
            mask=split_mask[:, None],
            other=0.0,
        )
        weight_sum = tl.sum(weights, 0)
        result = tl.sum(partial_out * weights[:, None], 0) / tl.where(weight_sum > 0, weight_sum, 1.0)
        tl.store(out_ptr + seq * out_stride_seq + head * out_stride_head + dims, result.to(out_ptr.dtype.element_ty))


def decode_tile(head_dim: int, cache_dtype: torch.dtype) -> tuple[int, int, int]:
    """(tokens per K/V tile, num_warps, num_stages) by the bytes of a cached row. A float8
    cache is tiled by its own bytes although its tiles are widened to the queries' dtype in
    registers: on an H200 (Qwen3-8B heads, batch 64-256, contexts of 1,024-4,096 tokens,
    ``scripts/decode_tile_sweep.py``) tiles of 128 tokens ran 1.2-1.4x faster than the 64 of
    a bf16 row of the same head size."""
    key = min(max(head_dim * cache_dtype.itemsize, 128), 512)
    if _halves(head_dim, cache_dtype) and key in DECODE_TILE_CONFIG_FP8_HALVES:
        return DECODE_TILE_CONFIG_FP8_HALVES[key]
    return DECODE_TILE_CONFIG[key]


def _halves(head_dim: int, cache_dtype: torch.dtype) -> bool:
    """Whether the kernel reads a float8 cache's rows a half at a time: on a GPU, 1.2-1.3x faster
    than whole rows at Qwen3-8B heads (fewer widened elements live in registers); each half must
    still be a ``tl.dot`` operand (at least 16 wide)."""
    return is_fp8(cache_dtype) and head_dim >= 32


def fp8_probabilities(cache_dtype: torch.dtype, head_dim: int, page_per_tile: bool) -> bool:
    """Whether decode attention multiplies P @ V in float8 (``FP8_PROBABILITIES``): where it is on, for a
    float8 cache whose values are token-major with each tile in one page, read by half rows."""
    return FP8_PROBABILITIES and page_per_tile and _halves(head_dim, cache_dtype)


def _choose_num_splits(batch, num_kv_heads, max_tiles, min_split_tiles, device):
    """Splits per sequence from static shapes only (CUDA-graph safe).

    Up to DECODE_PROGRAMS_PER_SM programs per SM, and no more splits than
    the longest possible context fills with min_split_tiles tiles each.
    """
    target_programs = DECODE_PROGRAMS_PER_SM * multiprocessor_count(device)
    splits = target_programs // max(batch * num_kv_heads, 1)
    return max(1, min(splits, triton.cdiv(max_tiles, min_split_tiles), DECODE_MAX_SPLITS))


def split_plan(batch, num_kv_heads, max_context, block_n, device, num_splits=None, min_split_tokens=None):
    """(splits per sequence, tiles a split gets at least) of a launch of ``batch`` sequences whose contexts
    hold up to ``max_context`` tokens, from static shapes only; ``num_splits`` and ``min_split_tokens``
    override the choice (DECODE_MIN_SPLIT_TOKENS, scaled down for a batch that does not fill the GPU)."""
    if min_split_tokens is None:
        fill = DECODE_FILL_PROGRAMS_PER_SM * multiprocessor_count(device)
        min_split_tokens = max(1, DECODE_MIN_SPLIT_TOKENS * min(batch * num_kv_heads, fill) // fill)
    assert min_split_tokens >= 1, f"min_split_tokens must be >= 1, got {min_split_tokens}"
    min_split_tiles = triton.cdiv(min_split_tokens, block_n)
    if num_splits is None:
        num_splits = _choose_num_splits(batch, num_kv_heads, triton.cdiv(max_context, block_n), min_split_tiles,
                                        device)
    return num_splits, min_split_tiles


def _check_args(q, k_cache, v_cache, block_tables, context_lens, k_scale=None, v_scale=None):
    batch, num_heads, head_dim = q.shape
    assert (k_scale is None) == (v_scale is None) == (not is_fp8(k_cache.dtype)), \
        "a float8 cache goes with its k_scale / v_scale, and only it"
    if k_scale is not None:
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride()
        assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.stride(2) == 1
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert v_cache.shape == k_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch
    assert context_lens.shape == (batch,)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out=None, *, num_splits=None,
                           min_split_tokens=None, k_scale=None, v_scale=None, tile=None, launches=None):
    """Attend each sequence's single query to its first context_lens[i] cached tokens.

    q: [batch, num_heads, head_dim]; k_cache / v_cache: [num_blocks, block_size,
    kv_heads, head_dim], the values either with the keys' layout or token-major (slots
    contiguous, as a float8 cache stores them: ``runner.kv_cache.values_token_major``);
    block_tables: int32 [batch, >= pages needed]; context_lens: int32 [batch] (0 gives
    zeros). Returns [batch, num_heads, head_dim] in q.dtype, written into `out` when given. num_splits and
    min_split_tokens override the split-K factor and DECODE_MIN_SPLIT_TOKENS, and tile
    the (tokens per tile, num_warps, num_stages) of DECODE_TILE_CONFIG (for tuning and
    tests). CUDA-graph capturable. A float8 e4m3 cache comes with its
    float32 scales k_scale / v_scale [num_blocks, block_size, kv_heads]. ``launches``: the
    step's ``common.StepLaunches`` when the call repeats layer after layer with the same
    shapes (the split buffers and the binaries are then found once a step).
    """
    _check_args(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert head_dim in (16, 32, 64, 128, 256), "head_dim must be a power of two in [16, 256]"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    fp8 = k_scale is not None
    assert fp8 or q.dtype == k_cache.dtype == v_cache.dtype
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and block_tables.stride(1) == 1
    assert context_lens.is_contiguous(), "context_lens is read as a dense array"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if batch == 0:
        return out

    group_size = num_heads // num_kv_heads
    block_n, num_warps, num_stages = tile or decode_tile(head_dim, k_cache.dtype)
    values_token_major = token_major(v_cache)
    if values_token_major:  # one page a tile where pages allow (every tl.dot operand is at least 16 wide)
        block_n = max(16, min(block_n, block_size))
    else:
        assert v_cache.stride(3) == 1, "the values are stored row-major (head_dim contiguous) or token-major"
    num_splits, min_split_tiles = split_plan(batch, num_kv_heads, block_tables.shape[1] * block_size, block_n,
                                             q.device, num_splits, min_split_tokens)
    single_split = num_splits == 1

    def split_buffers():
        return (torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device),
                torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device))

    if single_split:
        partial_out = partial_lse = out  # unused
    elif launches is not None:
        partial_out, partial_lse = launches.scratch(("decode splits", batch, num_heads, num_splits, head_dim),
                                                    split_buffers)
    else:
        partial_out, partial_lse = split_buffers()

    args = (q, k_cache, v_cache, block_tables, context_lens, out, partial_out, partial_lse, scale * _LOG2_E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), block_tables.stride(0), num_heads, num_splits, min_split_tiles,
            k_scale if fp8 else context_lens,  # placeholders, never read
            v_scale if fp8 else context_lens,
            k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0, *v_cache.stride())
    constexprs = dict(GROUP_SIZE=group_size, GROUP_PAD=max(16, triton.next_power_of_2(group_size)),
                      HEAD_DIM=head_dim, PAGE_SIZE=block_size, BLOCK_N=block_n, SINGLE_SPLIT=single_split,
                      DOT_PRECISION=dot_precision(q.dtype), FAST_FP8=fp8 and fast_fp8_widening(q.dtype, q.device))
    page_per_tile = values_token_major and block_size % block_n == 0
    pdl, pdl_options = split_pdl(pdl_launch(q.device))
    constexprs.update(pdl)
    options = dict(num_warps=num_warps, num_stages=num_stages, **pdl_options)
    if fp8_probabilities(k_cache.dtype, head_dim, page_per_tile):
        kernel = _decode_fp8_probs_kernel
        constexprs["EXACT_ROUNDING"] = q.device.type != "cuda"  # the interpreter's conversion mis-rounds
        if FP8_PROBS_MAX_REGISTERS is not None and q.device.type == "cuda":
            options["maxnreg"] = FP8_PROBS_MAX_REGISTERS
    else:
        kernel = _decode_split_kernel
        constexprs.update(FP8=fp8, HALVES=_halves(head_dim, k_cache.dtype), V_TOKEN_MAJOR=values_token_major,
                          PAGE_PER_TILE=page_per_tile)
        if fp8 and FP8_WIDENING_MAX_REGISTERS is not None and q.device.type == "cuda":
            options["maxnreg"] = FP8_WIDENING_MAX_REGISTERS
    launch_kernel(kernel, (batch, num_kv_heads, num_splits), args, constexprs, launches, **options)
    if not single_split:
        args = (partial_out, partial_lse, context_lens, out, out.stride(0), out.stride(1), num_heads, num_splits,
                min_split_tiles)
        constexprs = dict(HEAD_DIM=head_dim, BLOCK_N=block_n, SPLITS_PAD=triton.next_power_of_2(num_splits), **pdl)
        launch_kernel(_decode_merge_kernel, (batch, num_heads), args, constexprs, launches, **pdl_options)
    return out


def _gather_context(k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, dtype):
    """Each sequence's keys and values [batch, tokens, kv_heads, head_dim] as ``dtype`` (a float8
    cache's values as stored), their scales [batch, tokens, kv_heads, 1] (None without), and which
    tokens lie in the context [batch, tokens]; padded to the longest context's pages."""
    batch, (_, block_size, num_kv_heads, head_dim) = block_tables.shape[0], k_cache.shape
    # Gather only as many pages as the longest context needs (at least one,
    # so that every reduction has a non-empty axis).
    max_context = int(context_lens.max()) if batch else 0
    num_pages = max(math.ceil(max_context / block_size), 1)
    page_index = torch.arange(num_pages, device=k_cache.device)
    pages_used = (context_lens[:, None].long() + block_size - 1) // block_size
    # Unused block-table entries may hold anything: point them at block 0.
    pages = torch.where(page_index[None, :] < pages_used, block_tables[:, :num_pages].long(), 0)
    shape = (batch, num_pages * block_size, num_kv_heads)
    keys = k_cache[pages].reshape(*shape, head_dim).to(dtype)
    values = v_cache[pages].reshape(*shape, head_dim).to(dtype)
    scales = None
    if k_scale is not None:
        scales = (k_scale[pages].reshape(*shape, 1).to(dtype), v_scale[pages].reshape(*shape, 1).to(dtype))
    valid = torch.arange(num_pages * block_size, device=k_cache.device)[None, :] < context_lens[:, None]
    return keys, values, scales, valid


def paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, out=None, *,
                                 k_scale=None, v_scale=None):
    """PyTorch twin of paged_decode_attention (float32 math, vectorised over the batch)."""
    _check_args(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    keys, values, scales, valid = _gather_context(k_cache, v_cache, block_tables, context_lens, k_scale, v_scale,
                                                  torch.float32)
    if scales is not None:  # dequantize
        keys, values = keys * scales[0], values * scales[1]
    values = values.masked_fill(~valid[:, :, None, None], 0.0)

    queries = q.float().reshape(batch, num_kv_heads, group_size, head_dim)
    scores = torch.einsum("bhgd,bnhd->bhgn", queries, keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    probs = torch.exp(scores - row_max)
    row_sum = probs.sum(dim=-1, keepdim=True)
    result = torch.einsum("bhgn,bnhd->bhgd", probs, values) / torch.where(row_sum > 0, row_sum, 1.0)
    result = result.reshape(batch, num_heads, head_dim).to(q.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def paged_decode_attention_fp8_probs_torch(q, k_cache, v_cache, block_tables, context_lens, scale, *, k_scale,
                                           v_scale, block_n: int):
    """PyTorch twin of the float8 P @ V path (``FP8_PROBABILITIES``), in float64: per tile of
    ``block_n`` tokens and query head, the probabilities times the values' scales are scaled so
    that the largest is 448, rounded to e4m3, multiplied by the stored values and scaled back
    (the rounding does not depend on the running maximum the kernel keeps, nor on its splits);
    the softmax's sum is of the unrounded probabilities."""
    _check_args(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    assert is_fp8(k_cache.dtype)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    keys, values, (key_scales, value_scales), valid = _gather_context(
        k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, torch.float64)
    tokens = valid.shape[1]
    pad = -tokens % block_n  # whole tiles (pages smaller than a tile do not take this path)
    queries = q.double().reshape(batch, num_kv_heads, group_size, head_dim)
    scores = torch.einsum("bhgd,bnhd->bhgn", queries, keys * key_scales) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    probs = torch.exp(scores - row_max)  # 0 past the context
    row_sum = probs.sum(dim=-1, keepdim=True)
    weighted = probs * value_scales[..., 0].permute(0, 2, 1)[:, :, None, :].nan_to_num(0.0)  # stale past the context
    weighted = torch.nn.functional.pad(weighted, (0, pad)).unflatten(-1, (-1, block_n))  # [b, h, g, tiles, n]
    bound = weighted.amax(dim=-1, keepdim=True)
    row_scale = torch.where(bound > 0, bound / 448, 1.0)
    rounded = (weighted / row_scale).to(k_cache.dtype).double()
    values = torch.nn.functional.pad(values.masked_fill(~valid[:, :, None, None], 0.0), (0, 0, 0, 0, 0, pad))
    products = torch.einsum("bhgtn,btnhd->bhgtd", rounded, values.unflatten(1, (-1, block_n)))
    result = (products * row_scale).sum(dim=3) / torch.where(row_sum > 0, row_sum, 1.0)
    return result.reshape(batch, num_heads, head_dim)
