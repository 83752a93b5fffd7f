"""Plain PyTorch attention over the paged cache: the CPU path and the kernels' twin."""

from __future__ import annotations

from zipage.attention.backend import AttentionBackend
from zipage.kernels.paged_decode import paged_decode_attention_torch
from zipage.kernels.paged_prefill import paged_prefill_attention_torch
from zipage.kernels.store_kv import store_kv_torch


class TorchBackend(AttentionBackend):
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping):
        store_kv_torch(key, value, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale):
        return paged_prefill_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                             meta.context_lens, meta.max_seqlen_q, scale)

    def decode(self, q, k_cache, v_cache, meta, scale):
        return paged_decode_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
