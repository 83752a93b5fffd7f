"""GPU attention: Triton kernels for the cache and decode, flash attention for prefill.

Prefill without a cached prefix reads keys/values straight from the step's
projections through torch's variable-length flash attention when this torch has
it; otherwise, and whenever a prefix comes from the cache, a Triton kernel reads
the paged cache.
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


def _flash_prefill(q, k, v, meta, scale):
    """Causal varlen flash attention over the packed new tokens (no cached prefix)."""
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
    cu = meta.cu_seqlens_q
    return varlen_attn(q, k, v, cu, cu, meta.max_seqlen_q, meta.max_seqlen_q, **kwargs)


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
        # Without a cached prefix, flash attention reads the step's keys and values as computed
        # (also with a float8 cache: later steps read them quantized).
        flash_ok = (self.use_flash_prefill and not meta.has_cached_prefix and q.dtype != torch.float32
                    and ("scale" in _VARLEN_PARAMS or abs(scale - q.shape[-1] ** -0.5) < 1e-12))
        if flash_ok:
            return _flash_prefill(q, k, v, meta, scale)
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                       meta.context_lens, meta.max_seqlen_q, scale, k_scale=k_scale, v_scale=v_scale)

    def decode(self, q, k_cache, v_cache, meta, scale, *, k_scale=None, v_scale=None):
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                      k_scale=k_scale, v_scale=v_scale)
