"""Write new keys and values into the paged KV cache (and, with compression, the
step's queries into the observation-window cache, in the same launch).

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]; token slot s
lives at block s // block_size, offset s % block_size. A negative slot marks a
padding row (CUDA graphs) whose key and value are not stored. Query rows go to
query_cache[query_slots[i]] ([rows, num_heads, head_dim]); tokens outside any
window name the cache's spare last row.

FP8 KV cache (k_scale / v_scale given): each token's KV head row is stored as float8
e4m3 with a float32 scale (amax / 448) in k_scale / v_scale ([num_blocks, block_size,
kv_heads], the slot's entry); see zipage/kernels/common.py.
"""

import torch

from zipage.kernels.common import (FP8_AMAX_FLOOR, FP8_MAX, is_fp8, launch_kernel, pdl_launch, quantize_fp8_torch,
                                   split_pdl, wait_for_previous_kernel)

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: only the PyTorch twin is usable
    triton = None


if triton is not None:
    _FP8_MAX = tl.constexpr(FP8_MAX)
    _FP8_AMAX_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)

    @triton.jit
    def quantize_fp8_rows(x):
        """float32 rows [R, D] -> (float8e4nv rows, float32 scale [R]); the same numbers as
        quantize_fp8_torch. Rounds to the e4m3 grid (to nearest, ties to even) in float32
        first, so that the cast is exact on every backend (the interpreter's cast truncates)."""
        scale = fp8_row_scale(tl.max(tl.abs(x), 1))
        return round_to_fp8(x, scale), scale

    @triton.jit
    def fp8_row_scale(amax):
        """The float32 scale of rows whose largest magnitude is ``amax`` [R] (``quantize_fp8_rows``)."""
        # IEEE divisions (a plain "/" is approximate on NVIDIA GPUs): the twin's numbers exactly
        return tl.math.div_rn(tl.maximum(amax, _FP8_AMAX_FLOOR), _FP8_MAX)

    @triton.jit
    def round_to_fp8(x, scale):
        """float32 rows [R, D] over their ``scale`` [R], rounded to float8e4nv (``quantize_fp8_rows``)."""
        y = tl.math.div_rn(x, scale[:, None])
        y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)
        bits = y.to(tl.int32, bitcast=True)
        exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3: 3 mantissa bits, subnormal below 2^-6
        quantum = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3)
        inverse = ((130 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(3 - exponent)
        rounded = ((y * inverse + 12582912.0) - 12582912.0) * quantum  # 1.5 * 2^23: round to an integer
        return rounded.to(tl.float8e4nv)

    @triton.jit
    def _store_kv_kernel(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_mapping_ptr,
        key_stride_token,
        key_stride_head,
        value_stride_token,
        value_stride_head,
        cache_stride_block,
        cache_stride_slot,
        cache_stride_head,
        v_stride_block,
        v_stride_slot,
        v_stride_head,
        v_stride_dim,
        num_kv_heads,
        query_ptr,
        query_cache_ptr,
        query_slots_ptr,
        query_stride_token,
        query_stride_head,
        query_cache_stride_row,
        query_cache_stride_head,
        num_heads,
        k_scale_ptr,
        v_scale_ptr,
        scale_stride_block,
        scale_stride_slot,
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        HAS_QUERY: tl.constexpr,
        QUERY_HEADS_PAD: tl.constexpr,
        FP8: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """One program per token: copies all its KV heads into the cache slot (and its
        query heads into its query-cache row)."""
        wait_for_previous_kernel(PDL)
        token = tl.program_id(0).to(tl.int64)
        dims = tl.arange(0, HEAD_DIM)[None, :]
        if HAS_QUERY:
            q_heads = tl.arange(0, QUERY_HEADS_PAD)[:, None]
            q_mask = q_heads < num_heads
            row = tl.load(query_slots_ptr + token).to(tl.int64)
            query = tl.load(query_ptr + token * query_stride_token + q_heads * query_stride_head + dims, mask=q_mask)
            tl.store(query_cache_ptr + row * query_cache_stride_row + q_heads * query_cache_stride_head + dims,
                     query, mask=q_mask)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:
            return
        heads = tl.arange(0, HEADS_PAD)[:, None]
        head_mask = heads < num_kv_heads
        # int64 slot arithmetic: a layer's cache can exceed 2**31 elements.
        cache_offsets = (
            (slot // PAGE_SIZE) * cache_stride_block
            + (slot % PAGE_SIZE) * cache_stride_slot
            + heads * cache_stride_head
            + dims
        )
        # The values may be laid out otherwise (a float8 cache stores them token-major).
        v_offsets = (
            (slot // PAGE_SIZE) * v_stride_block
            + (slot % PAGE_SIZE) * v_stride_slot
            + heads * v_stride_head
            + dims * v_stride_dim
        )
        if FP8:
            key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims, mask=head_mask,
                          other=0.0).to(tl.float32)
            value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims,
                            mask=head_mask, other=0.0).to(tl.float32)
            key, key_scale = quantize_fp8_rows(key)
            value, value_scale = quantize_fp8_rows(value)
            # The scale caches: [num_blocks, block_size, kv_heads], heads contiguous.
            scale_offsets = (slot // PAGE_SIZE) * scale_stride_block + (slot % PAGE_SIZE) * scale_stride_slot
            scale_heads = tl.arange(0, HEADS_PAD)
            tl.store(k_scale_ptr + scale_offsets + scale_heads, key_scale, mask=scale_heads < num_kv_heads)
            tl.store(v_scale_ptr + scale_offsets + scale_heads, value_scale, mask=scale_heads < num_kv_heads)
        else:
            key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims, mask=head_mask)
            value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims,
                            mask=head_mask)
        tl.store(k_cache_ptr + cache_offsets, key, mask=head_mask)
        tl.store(v_cache_ptr + v_offsets, value, mask=head_mask)


def check_store_args(key, value, k_cache, v_cache, slot_mapping, query=None, query_cache=None, query_slots=None,
                k_scale=None, v_scale=None):
    assert key.shape == value.shape and key.dim() == 3
    assert (k_scale is None) == (v_scale is None) == (not is_fp8(k_cache.dtype)), \
        "a float8 cache goes with its k_scale / v_scale, and only it"
    if k_scale is not None:
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride()
        assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.stride(2) == 1
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4
    assert key.shape[1:] == k_cache.shape[2:]
    assert slot_mapping.shape == key.shape[:1]
    assert (query is None) == (query_cache is None) == (query_slots is None), "query, its cache and slots go together"
    if query is not None:
        assert query.dim() == 3 and query.shape[0] == key.shape[0] and query.shape[2] == key.shape[2]
        assert query_cache.shape[1:] == query.shape[1:] and query_slots.shape == key.shape[:1]


def store_kv(key, value, k_cache, v_cache, slot_mapping, query=None, query_cache=None, query_slots=None, *,
             k_scale=None, v_scale=None, launches=None):
    """Store key[i] / value[i] ([num_tokens, kv_heads, head_dim]) at cache slot slot_mapping[i],
    and, when given, query[i] ([num_tokens, heads, head_dim]) at query_cache[query_slots[i]].

    key, value and query may be strided views (e.g. slices of a fused qkv output) as
    long as the last dimension is contiguous; so may k_cache, while v_cache may have any
    strides (a float8 cache stores its values token-major). Slots < 0 are skipped (query slots are
    all written: rows outside a window point at a spare row). With a float8 cache,
    k_scale / v_scale ([num_blocks, block_size, kv_heads] float32) receive each row's scale.
    ``launches``: the step's ``common.StepLaunches`` when the call repeats layer after layer.
    """
    check_store_args(key, value, k_cache, v_cache, slot_mapping, query, query_cache, query_slots, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.stride(3) == 1
    has_query = query is not None
    if has_query:
        if query.stride(2) != 1:  # a layout the model may hand over; the kernel reads rows of head_dim
            query = query.contiguous()
        assert query_cache.stride(2) == 1
        assert query_slots.is_contiguous(), "query_slots is read as a dense array"
    assert slot_mapping.is_contiguous(), "slot_mapping is read as a dense array"
    if num_tokens == 0:
        return
    if not has_query:  # placeholders, never read
        query, query_cache, query_slots = key, k_cache, slot_mapping
    fp8 = k_scale is not None
    if not fp8:  # placeholders, never read
        k_scale = v_scale = slot_mapping
    args = (key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0),
            value.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *v_cache.stride(), num_kv_heads,
            query,
            query_cache, query_slots, query.stride(0), query.stride(1), query_cache.stride(0), query_cache.stride(1),
            query.shape[1], k_scale, v_scale, k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0)
    constexprs = dict(PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
                      HAS_QUERY=has_query, QUERY_HEADS_PAD=triton.next_power_of_2(query.shape[1]), FP8=fp8)
    pdl, options = split_pdl(pdl_launch(key.device))
    launch_kernel(_store_kv_kernel, (num_tokens,), args, {**constexprs, **pdl}, launches, **options)


def store_kv_torch(key, value, k_cache, v_cache, slot_mapping, query=None, query_cache=None, query_slots=None, *,
                   k_scale=None, v_scale=None):
    """PyTorch twin of store_kv (same arguments and semantics)."""
    check_store_args(key, value, k_cache, v_cache, slot_mapping, query, query_cache, query_slots, k_scale, v_scale)
    if query is not None:
        query_cache.index_copy_(0, query_slots.long(), query.to(query_cache.dtype))
    num_kv_heads, head_dim = key.shape[1:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if k_scale is not None:
        key, key_scale = quantize_fp8_torch(key[keep])
        value, value_scale = quantize_fp8_torch(value[keep])
        k_scale.view(-1, num_kv_heads)[slots] = key_scale
        v_scale.view(-1, num_kv_heads)[slots] = value_scale
    else:
        key, value = key[keep].to(k_cache.dtype), value[keep].to(v_cache.dtype)
    # Indexed by (block, slot), which writes into the caches whatever their strides.
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value
