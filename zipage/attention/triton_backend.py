"""GPU attention: Triton kernels for the cache and decode, flash attention for prefill.

Prefill goes through torch's variable-length flash attention when this torch has it.
Without a cached prefix it reads the keys and values straight from the step's
projections. With one (a prompt chunk after the first, or a prefix-cache hit), every
sequence's context is first gathered from the paged cache into one packed tensor (a
float8 cache dequantized to the queries' dtype), which costs a copy of the context's
keys and values per layer: for a chunk of n queries over c keys, 4 * c * kv_heads *
head_dim bytes against 4 * n * c * heads * head_dim FLOPs of attention, small beside
them from a few dozen queries on. Without flash attention (or in float32) the Triton
kernel reads the paged cache itself.
"""

from __future__ import annotations

import inspect

import torch

from zipage.attention.backend import AttentionBackend
from zipage.kernels.paged_decode import paged_decode_attention
from zipage.kernels.paged_prefill import paged_prefill_attention
from zipage.kernels.store_kv import store_kv

try:
    from torch.nn.attention.varlen import varlen_attn
    _VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters)
except ImportError:  # torch < 2.10
    varlen_attn, _VARLEN_PARAMS = None, set()


def _attend_flash(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """Causal varlen flash attention; with more keys than queries the diagonal is aligned at
    the end (query i of a sequence of n queries over c keys sees keys 0..c - n + i)."""
    kwargs = {}
    if "scale" in _VARLEN_PARAMS:
        kwargs["scale"] = scale
    if "window_size" in _VARLEN_PARAMS:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


# The packed context of a step is gathered only up to this size (its keys and values); past it
# the Triton kernel reads the paged cache in place, so that a long context never needs a
# large transient next to a cache that fills the rest of the memory.
FLASH_GATHER_MAX_BYTES = 1 << 30


def context_slots(meta, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cache slot of every key of every sequence's context, packed in sequence order;
    cu_seqlens_k) for a prefill step's metadata, on the device without a host sync."""
    lens = meta.context_lens.long()
    cu_k = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(lens, 0, out=cu_k[1:])
    total = meta.total_seqlen_k
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=total)
    pos = torch.arange(total, device=lens.device) - cu_k[:-1].long()[seq]
    page = meta.block_tables.long()[seq, pos // block_size]
    return page * block_size + pos % block_size, cu_k


def gather_context(k_cache, v_cache, meta, dtype, k_scale=None, v_scale=None):
    """(keys, values, cu_seqlens_k): every sequence's context [total_seqlen_k, kv_heads,
    head_dim] in ``dtype``, packed; a float8 cache times its scales (each product rounded
    once to ``dtype``). The slots are computed at a step's first layer and kept in
    ``meta.context_slots`` for the others."""
    if meta.context_slots is None:
        meta.context_slots = context_slots(meta, k_cache.shape[1])
    slots, cu_k = meta.context_slots
    kv_heads, head_dim = k_cache.shape[2:]
    keys = k_cache.view(-1, kv_heads, head_dim).index_select(0, slots)
    values = v_cache.view(-1, kv_heads, head_dim).index_select(0, slots)
    if k_scale is not None:  # float8 -> dtype is exact; the in-place products run in float32
        keys = keys.to(dtype).mul_(k_scale.view(-1, kv_heads).index_select(0, slots)[..., None])
        values = values.to(dtype).mul_(v_scale.view(-1, kv_heads).index_select(0, slots)[..., None])
    return keys, values, cu_k


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, use_flash_prefill: bool | None = None):
        available = varlen_attn is not None
        self.use_flash_prefill = available if use_flash_prefill is None else use_flash_prefill and available

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, query=None, query_cache=None, query_slots=None,
                 *, k_scale=None, v_scale=None):
        store_kv(key, value, k_cache, v_cache, slot_mapping, query, query_cache, query_slots,
                 k_scale=k_scale, v_scale=v_scale)

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale, *, k_scale=None, v_scale=None):
        flash_ok = (self.use_flash_prefill and q.dtype != torch.float32
                    and ("scale" in _VARLEN_PARAMS or abs(scale - q.shape[-1] ** -0.5) < 1e-12))
        if flash_ok and not meta.has_cached_prefix:
            # The step's keys and values as computed (also with a float8 cache: later steps
            # read them quantized).
            cu = meta.cu_seqlens_q
            return _attend_flash(q, k, v, cu, cu, meta.max_seqlen_q, meta.max_seqlen_q, scale)
        gathered_bytes = 2 * meta.total_seqlen_k * k_cache.shape[2] * k_cache.shape[3] * q.element_size()
        if flash_ok and 0 < gathered_bytes <= FLASH_GATHER_MAX_BYTES:
            keys, values, cu_k = gather_context(k_cache, v_cache, meta, q.dtype, k_scale, v_scale)
            return _attend_flash(q, keys, values, meta.cu_seqlens_q, cu_k, meta.max_seqlen_q, meta.max_seqlen_k,
                                 scale)
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                       meta.context_lens, meta.max_seqlen_q, scale, k_scale=k_scale, v_scale=v_scale)

    def decode(self, q, k_cache, v_cache, meta, scale, *, k_scale=None, v_scale=None):
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                      k_scale=k_scale, v_scale=v_scale)
