"""Attention and KV-cache kernels: Triton versions and their PyTorch twins."""

from zipage.kernels.paged_decode import paged_decode_attention, paged_decode_attention_torch
from zipage.kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_torch
from zipage.kernels.store_kv import store_kv, store_kv_torch

__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_torch",
    "paged_prefill_attention",
    "paged_prefill_attention_torch",
    "store_kv",
    "store_kv_torch",
]
