"""Plain PyTorch attention over the paged cache: the CPU path and the kernels' twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zipage.attention.backend import AttentionBackend
from zipage.kernels.paged_prefill import paged_prefill_attention_torch
from zipage.kernels.store_kv import store_kv_torch


class TorchBackend(AttentionBackend):
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, query=None, query_cache=None, query_slots=None,
                 *, k_scale=None, v_scale=None, launches=None):
        store_kv_torch(key, value, k_cache, v_cache, slot_mapping, query, query_cache, query_slots,
                       k_scale=k_scale, v_scale=v_scale)

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale, *, k_scale=None, v_scale=None):
        return paged_prefill_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                             meta.context_lens, meta.max_seqlen_q, scale,
                                             k_scale=k_scale, v_scale=v_scale)

    def decode(self, q, k_cache, v_cache, meta, scale, *, k_scale=None, v_scale=None, out=None, launches=None):
        result = paged_decode_attention_sdpa(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                             k_scale=k_scale, v_scale=v_scale)
        return result if out is None else out.copy_(result)


def paged_decode_attention_sdpa(q, k_cache, v_cache, block_tables, context_lens, scale, *, k_scale=None,
                                v_scale=None) -> torch.Tensor:
    """Decode attention on the CPU: each request's pages gathered once, then one SDPA call in
    which a KV head's group of query heads is the query axis (no copies of K/V per query head).

    Twice as fast on a CPU as the float32 twin ``paged_decode_attention_torch``, which also
    zeroes masked values so that it may serve as a reference on caches holding anything; here
    positions past a context must hold finite values, as the engine's zero-initialised cache does.
    A float8 cache (with its float32 scales k_scale / v_scale [num_blocks, block_size, kv_heads]) is
    dequantized to q's dtype as its pages are gathered.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_pages = max(-(-int(context_lens.max()) // block_size), 1) if batch else 1
    used = (context_lens[:, None].long() + block_size - 1) // block_size
    page_index = torch.arange(num_pages, device=q.device)
    pages = torch.where(page_index[None, :] < used, block_tables[:, :num_pages].long(), 0)  # unused: block 0
    keys = k_cache[pages].view(batch, num_pages * block_size, num_kv_heads, head_dim).transpose(1, 2)
    # reshape: a float8 cache's token-major values come out of the gather in their own layout
    values = v_cache[pages].reshape(batch, num_pages * block_size, num_kv_heads, head_dim).transpose(1, 2)
    if k_scale is not None:
        keys = keys.to(q.dtype) * k_scale[pages].view(batch, num_pages * block_size, num_kv_heads, 1).transpose(
            1, 2).to(q.dtype)
        values = values.to(q.dtype) * v_scale[pages].view(batch, num_pages * block_size, num_kv_heads, 1).transpose(
            1, 2).to(q.dtype)
    valid = torch.arange(num_pages * block_size, device=q.device)[None, :] < context_lens[:, None]
    queries = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim)
