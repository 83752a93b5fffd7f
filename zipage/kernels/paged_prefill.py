"""Prefill attention over the paged KV cache (varlen, causal, with cached prefix).

Sequence i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1]; they are the
last q_len tokens of its context_lens[i] cached tokens, so query j sits at
position context_len - q_len + j and sees keys at positions <= its own
(bottom-right aligned causal mask). Flash-attention forward: one program per
(query tile, sequence, query head), online softmax in float32.
"""

import math

import torch

from zipage.kernels.common import (dot_precision, fast_fp8_widening, is_fp8, load_kv_scales, token_major,
                                   widen_fp8)
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: only the PyTorch twin is usable
    triton = None

# Tuning knobs, measured on an H200 (bf16, 32 query / 8 KV heads).
# (query rows per program, keys per tile, num_warps, num_stages) by bytes per
# K/V row (head_dim * element size, clamped to 128..512); the 512 entry also
# keeps 1 KiB rows (float32, head_dim 256) within shared memory.
PREFILL_TILE_CONFIG = {128: (64, 64, 4, 2), 256: (128, 128, 8, 2), 512: (64, 32, 4, 2)}

_LOG2_E = 1.4426950408889634


if triton is not None:

    @triton.jit
    def _attend_tile(
        q,
        row_max,
        row_sum,
        acc,
        key_begin,
        q_positions,
        context_len,
        k_cache_ptr,
        v_cache_ptr,
        block_table_row,
        kv_head_offset,
        cache_stride_block,
        cache_stride_slot,
        scale_log2,
        k_scale_ptr,
        v_scale_ptr,
        scale_stride_block,
        scale_stride_slot,
        kv_head,
        v_stride_block,
        v_stride_slot,
        v_stride_head,
        v_stride_dim,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        FP8: tl.constexpr,
        FAST_FP8: tl.constexpr,
        V_TILE_PAGE: tl.constexpr,
    ):
        """Online-softmax update with keys key_begin:key_begin+BLOCK_N.

        With CAUSAL False the caller guarantees every key is valid and visible to
        every query row, so no masking is done. V_TILE_PAGE: the values are stored
        token-major and the tile lies in one page (BLOCK_N divides PAGE_SIZE; key_begin
        is a multiple of BLOCK_N), so that each value dimension's tokens are one run.
        """
        positions = key_begin + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, HEAD_DIM)
        in_context = positions < context_len
        pages = tl.load(block_table_row + positions // PAGE_SIZE, mask=in_context, other=0)
        token_offsets = pages.to(tl.int64) * cache_stride_block + (positions % PAGE_SIZE) * cache_stride_slot
        kv_offsets = (token_offsets + kv_head_offset)[:, None] + dims[None, :]
        if V_TILE_PAGE:  # values [dims, tokens] of one page, read as runs of tokens
            page = tl.load(block_table_row + key_begin // PAGE_SIZE)
            v_cols = (page.to(tl.int64) * v_stride_block + kv_head * v_stride_head
                      + (key_begin % PAGE_SIZE + tl.arange(0, BLOCK_N)))
            v_offsets = v_cols[None, :] + dims[:, None] * v_stride_dim
        else:  # row-major values, or token-major ones in pages smaller than a tile
            v_offsets = ((pages.to(tl.int64) * v_stride_block + (positions % PAGE_SIZE) * v_stride_slot
                          + kv_head * v_stride_head)[:, None] + dims[None, :] * v_stride_dim)
        if CAUSAL:
            k = tl.load(k_cache_ptr + kv_offsets, mask=in_context[:, None], other=0.0)
            if V_TILE_PAGE:
                # Past the context: the page's stale values (finite: the cache starts zeroed and
                # FAST_FP8's widening makes every byte finite) times a probability of 0; only the
                # slow widening needs the mask.
                v = tl.trans(tl.load(v_cache_ptr + v_offsets, mask=in_context[None, :] | FAST_FP8, other=0.0))
            else:
                v = tl.load(v_cache_ptr + v_offsets, mask=in_context[:, None], other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_offsets)
            v = tl.load(v_cache_ptr + v_offsets)
            if V_TILE_PAGE:
                v = tl.trans(v)

        if FP8:
            # float8 -> the query's dtype is exact; each key's scale multiplies its logit
            # and each value's scale its probability (the same products as dequantizing).
            k = widen_fp8(k, q.dtype, FAST_FP8)
            v = widen_fp8(v, q.dtype, FAST_FP8)
            k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, pages, positions, scale_stride_block,
                                              scale_stride_slot, kv_head, in_context, PAGE_SIZE)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (k_scale * scale_log2)[None, :]
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if CAUSAL:
            visible = (positions[None, :] <= q_positions[:, None]) & in_context[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        # Key 0 is visible to every row and sits in the first tile processed, so
        # row_max is finite from the first call on.
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        probs = tl.exp2(scores - new_max[:, None])
        correction = tl.exp2(row_max - new_max)
        row_sum = row_sum * correction + tl.sum(probs, 1)
        if FP8:
            probs = probs * v_scale[None, :]
        acc = tl.dot(probs.to(v.dtype), v, acc * correction[:, None], input_precision=DOT_PRECISION)
        return new_max, row_sum, acc

    @triton.jit(do_not_specialize=["block_table_stride"])
    def _prefill_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        cu_seqlens_q_ptr,
        context_lens_ptr,
        out_ptr,
        scale_log2,
        q_stride_token,
        q_stride_head,
        out_stride_token,
        out_stride_head,
        cache_stride_block,
        cache_stride_slot,
        cache_stride_head,
        block_table_stride,
        k_scale_ptr,
        v_scale_ptr,
        scale_stride_block,
        scale_stride_slot,
        v_stride_block,
        v_stride_slot,
        v_stride_head,
        v_stride_dim,
        GROUP_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        FP8: tl.constexpr,
        FAST_FP8: tl.constexpr,
        V_TILE_PAGE: tl.constexpr,
    ):
        """One program per (BLOCK_M query rows, sequence, query head)."""
        q_tile = tl.program_id(0)
        seq = tl.program_id(1)
        head = tl.program_id(2)

        q_begin = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
        # The grid is sized for the longest sequence.
        if q_tile * BLOCK_M >= q_len:
            return
        context_len = tl.load(context_lens_ptr + seq)
        prefix_len = context_len - q_len

        rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        q_positions = prefix_len + rows
        dims = tl.arange(0, HEAD_DIM)
        tokens = (q_begin + rows).to(tl.int64)
        q = tl.load(
            q_ptr + tokens[:, None] * q_stride_token + head * q_stride_head + dims[None, :],
            mask=row_mask[:, None],
            other=0.0,
        )

        block_table_row = block_tables_ptr + seq.to(tl.int64) * block_table_stride
        kv_head = head // GROUP_SIZE
        kv_head_offset = kv_head * cache_stride_head
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

        # Keys before the tile's first query position are visible to all its rows
        # (and lie inside the context): full tiles of them need no mask.
        unmasked_end = (prefix_len + q_tile * BLOCK_M) // BLOCK_N * BLOCK_N
        # No row of this tile sees past the last row's position (tiles further
        # right are entirely above the diagonal and skipped).
        key_end = tl.minimum(context_len, prefix_len + (q_tile + 1) * BLOCK_M)
        for key_begin in range(0, unmasked_end, BLOCK_N):
            row_max, row_sum, acc = _attend_tile(
                q, row_max, row_sum, acc, key_begin, q_positions, context_len,
                k_cache_ptr, v_cache_ptr, block_table_row, kv_head_offset,
                cache_stride_block, cache_stride_slot, scale_log2,
                k_scale_ptr, v_scale_ptr, scale_stride_block, scale_stride_slot, kv_head,
                v_stride_block, v_stride_slot, v_stride_head, v_stride_dim,
                HEAD_DIM, PAGE_SIZE, BLOCK_N, CAUSAL=False, DOT_PRECISION=DOT_PRECISION, FP8=FP8, FAST_FP8=FAST_FP8,
                V_TILE_PAGE=V_TILE_PAGE,
            )  # fmt: skip
        for key_begin in range(unmasked_end, key_end, BLOCK_N):
            row_max, row_sum, acc = _attend_tile(
                q, row_max, row_sum, acc, key_begin, q_positions, context_len,
                k_cache_ptr, v_cache_ptr, block_table_row, kv_head_offset,
                cache_stride_block, cache_stride_slot, scale_log2,
                k_scale_ptr, v_scale_ptr, scale_stride_block, scale_stride_slot, kv_head,
                v_stride_block, v_stride_slot, v_stride_head, v_stride_dim,
                HEAD_DIM, PAGE_SIZE, BLOCK_N, CAUSAL=True, DOT_PRECISION=DOT_PRECISION, FP8=FP8, FAST_FP8=FAST_FP8,
                V_TILE_PAGE=V_TILE_PAGE,
            )  # fmt: skip

        result = acc / row_sum[:, None]
        tl.store(
            out_ptr + tokens[:, None] * out_stride_token + head * out_stride_head + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None],
        )


def _check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, k_scale=None, v_scale=None):
    assert q.dim() == 3 and k_cache.dim() == 4
    assert (k_scale is None) == (v_scale is None) == (not is_fp8(k_cache.dtype)), \
        "a float8 cache goes with its k_scale / v_scale, and only it"
    if k_scale is not None:
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride()
        assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.stride(2) == 1
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, cache_head_dim = k_cache.shape[2:]
    assert v_cache.shape == k_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    batch = context_lens.shape[0]
    assert cu_seqlens_q.shape == (batch + 1,) and block_tables.shape[0] == batch


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, scale, *,
                            k_scale=None, v_scale=None):
    """Causal varlen attention of packed queries over the paged KV cache.

    q: [total_q, num_heads, head_dim]; cu_seqlens_q: int32 [batch + 1];
    context_lens: int32 [batch] (>= each sequence's q_len, keys already
    stored); v_cache may have any strides (a float8 cache stores its values
    token-major), k_cache a contiguous last dimension; max_seqlen_q: host int >=
    every q_len. Returns [total_q, num_heads, head_dim] in q.dtype. A float8 e4m3 cache comes with its float32
    scales k_scale / v_scale [num_blocks, block_size, kv_heads].
    """
    _check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, k_scale, v_scale)
    total_q, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = context_lens.shape[0]
    assert head_dim in (16, 32, 64, 128, 256), "head_dim must be a power of two in [16, 256]"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    fp8 = k_scale is not None
    assert fp8 or q.dtype == k_cache.dtype == v_cache.dtype
    assert cu_seqlens_q.is_contiguous() and context_lens.is_contiguous(), "read as dense arrays"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and block_tables.stride(1) == 1
    out = torch.empty_like(q)
    if total_q == 0 or batch == 0:
        return out

    # float8 tiles are widened to q's dtype in registers: tiled as q's dtype.
    row_bytes = head_dim * (q.element_size() if fp8 else k_cache.element_size())
    block_m, block_n, num_warps, num_stages = PREFILL_TILE_CONFIG[min(max(row_bytes, 128), 512)]
    _prefill_kernel[(triton.cdiv(max_seqlen_q, block_m), batch, num_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        scale * _LOG2_E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        k_scale if fp8 else context_lens,  # placeholders, never read
        v_scale if fp8 else context_lens,
        k_scale.stride(0) if fp8 else 0,
        k_scale.stride(1) if fp8 else 0,
        *v_cache.stride(),
        GROUP_SIZE=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        FP8=fp8,
        FAST_FP8=fp8 and fast_fp8_widening(q.dtype, q.device),
        V_TILE_PAGE=token_major(v_cache) and block_size % block_n == 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def paged_prefill_attention_torch(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, scale,
                                  *, k_scale=None, v_scale=None):
    """PyTorch twin of paged_prefill_attention (float32 math, one SDPA call per sequence)."""
    _check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, k_scale, v_scale)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_heads // num_kv_heads
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        q_begin, q_end = bounds[seq], bounds[seq + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        pages = block_tables[seq, : math.ceil(context_len / block_size)].long()
        # [kv_heads, context_len, head_dim]
        keys = k_cache[pages].flatten(0, 1)[:context_len].transpose(0, 1).float()
        values = v_cache[pages].flatten(0, 1)[:context_len].transpose(0, 1).float()
        if k_scale is not None:  # dequantize: [kv_heads, context_len, 1] scales
            keys = keys * k_scale[pages].flatten(0, 1)[:context_len].transpose(0, 1)[..., None]
            values = values * v_scale[pages].flatten(0, 1)[:context_len].transpose(0, 1)[..., None]
        # Fold the GQA group into the query rows: [kv_heads, group * q_len, head_dim].
        queries = q[q_begin:q_end].float().reshape(q_len, num_kv_heads, group_size, head_dim)
        queries = queries.permute(1, 2, 0, 3).reshape(num_kv_heads, group_size * q_len, head_dim)
        q_positions = torch.arange(context_len - q_len, context_len, device=q.device)
        visible = torch.arange(context_len, device=q.device)[None, :] <= q_positions[:, None]
        visible = visible.repeat(group_size, 1)
        result = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, scale=scale)
        result = result.reshape(num_kv_heads, group_size, q_len, head_dim).permute(2, 0, 1, 3)
        out[q_begin:q_end] = result.reshape(q_len, num_heads, head_dim).to(q.dtype)
    return out
