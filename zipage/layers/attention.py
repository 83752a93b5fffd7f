"""The attention layer: store the step's keys/values, then attend through the backend."""

from __future__ import annotations

import torch
from torch import nn

from zipage.attention.backend import dense_causal_attention
from zipage.attention.metadata import get_attention_metadata
from zipage.kernels.common import StepLaunches
from zipage.layers.rotary import RopeInputs


class Attention(nn.Module):
    def __init__(self, layer_index: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # Bound by the model runner once the cache is allocated.
        self.k_cache = self.v_cache = torch.empty(0)
        # With kv_cache_dtype="fp8": float32 scales [blocks, block_size, kv_heads] of k_cache / v_cache.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.query_cache: torch.Tensor | None = None  # [slots * window + 1, heads, dim] with compression
        self.backend = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
                rope: RopeInputs | None = None) -> torch.Tensor:
        """``q`` [tokens, heads, dim], ``k``/``v`` [tokens, kv_heads, dim] -> [tokens, heads, dim],
        written into ``out`` when given (a step's static buffer: no copy of the result). With
        ``rope``, ``q`` and ``k`` are not rotated yet: the backend rotates them as it stores them."""
        meta = get_attention_metadata()
        if self.k_cache.numel() == 0:  # memory profiling run, before the cache exists
            if rope is not None:
                q, k = rope.apply(q, k)
            return dense_causal_attention(q, k, v, meta.cu_seqlens_q.tolist(), self.scale)
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)  # None but with a float8 cache
        if meta.is_prefill and meta.launches is None and q.is_cuda:  # an eager step: layer after layer
            meta.launches = StepLaunches()
        # with compression: q into the observation window, in the same launch
        window = (self.query_cache, meta.query_slots) if meta.query_slots is not None else (None, None)
        if rope is not None:
            q, k = self.backend.norm_rope_store_kv(rope, q, k, v, self.k_cache, self.v_cache, meta.slot_mapping,
                                                   *window, launches=meta.launches, **scales)
        else:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping,
                                  q if window[0] is not None else None, *window, launches=meta.launches, **scales)
        if meta.decode_part is not None:  # decodes beside prompt chunks: each through its own kernel
            d = meta.decode_part.context_lens.shape[0]
            out = torch.empty_like(q) if out is None else out
            self.backend.decode(q[:d], self.k_cache, self.v_cache, meta.decode_part, self.scale, out=out[:d],
                                launches=meta.launches, **scales)
            out[d:].copy_(self.backend.prefill(q[d:], k[d:], v[d:], self.k_cache, self.v_cache, meta.chunk_part,
                                               self.scale, **scales))
            return out
        if meta.is_prefill:
            result = self.backend.prefill(q, k, v, self.k_cache, self.v_cache, meta, self.scale, **scales)
            return result if out is None else out.copy_(result)
        return self.backend.decode(q, self.k_cache, self.v_cache, meta, self.scale, out=out, **scales)

