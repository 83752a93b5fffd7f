"""Write new keys and values into the paged KV cache.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]; token slot s
lives at block s // block_size, offset s % block_size. A negative slot marks a
padding row (CUDA graphs) whose key and value are not stored.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: only the PyTorch twin is usable
    triton = None


if triton is not None:

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
        num_kv_heads,
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEADS_PAD: tl.constexpr,
    ):
        """One program per token: copies all its KV heads into the cache slot."""
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:
            return
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, HEAD_DIM)[None, :]
        head_mask = heads < num_kv_heads
        key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims, mask=head_mask)
        value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims, mask=head_mask)
        # int64 slot arithmetic: a layer's cache can exceed 2**31 elements.
        cache_offsets = (
            (slot // PAGE_SIZE) * cache_stride_block
            + (slot % PAGE_SIZE) * cache_stride_slot
            + heads * cache_stride_head
            + dims
        )
        tl.store(k_cache_ptr + cache_offsets, key, mask=head_mask)
        tl.store(v_cache_ptr + cache_offsets, value, mask=head_mask)


def _check_args(key, value, k_cache, v_cache, slot_mapping):
    assert key.shape == value.shape and key.dim() == 3
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert key.shape[1:] == k_cache.shape[2:]
    assert slot_mapping.shape == key.shape[:1]


def store_kv(key, value, k_cache, v_cache, slot_mapping):
    """Store key[i] / value[i] ([num_tokens, kv_heads, head_dim]) at cache slot slot_mapping[i].

    key and value may be strided views (e.g. slices of a fused qkv output) as
    long as the last dimension is contiguous. Slots < 0 are skipped.
    """
    _check_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.stride(3) == 1
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        PAGE_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
    )


def store_kv_torch(key, value, k_cache, v_cache, slot_mapping):
    """PyTorch twin of store_kv (same arguments and semantics)."""
    _check_args(key, value, k_cache, v_cache, slot_mapping)
    num_kv_heads, head_dim = key.shape[1:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # view() (not reshape) so that the writes land in the cache itself.
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[keep].to(v_cache.dtype)
