"""The attention backend interface and the choice of backend.

A backend stores the step's new keys/values into the paged cache and computes
attention for prefill (packed variable-length sequences, possibly behind a cached
prefix) and decode (one query per sequence). Adding a kernel means adding a
backend file, not editing the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zipage.attention.metadata import AttentionMetadata


class AttentionBackend:
    name = "base"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, query=None, query_cache=None,
                 query_slots=None, *, k_scale=None, v_scale=None, launches=None) -> None:
        """Keys and values into their cache slots; with compression also the queries into
        their observation-window rows. A float8 cache (``kv_cache_dtype="fp8"``) comes with
        its float32 scales k_scale / v_scale [num_blocks, block_size, kv_heads], also passed
        to ``prefill`` and ``decode``; they are None otherwise. ``launches``: the step's
        ``StepLaunches`` (``zipage/kernels/common.py``) in a step that runs attention eagerly
        layer after layer, also passed to ``decode``; a backend without Triton kernels ignores it."""
        raise NotImplementedError

    def norm_rope_store_kv(self, rope, q, k, v, k_cache, v_cache, slot_mapping, query_cache=None,
                           query_slots=None, *, k_scale=None, v_scale=None, launches=None):
        """``rope.apply(q, k)`` (a ``layers.rotary.RopeInputs``), then ``store_kv`` of the rotated
        key, ``v`` and (with ``query_cache``) the rotated query: the rotated ``(q, k)``. Here two
        steps; a backend with a kernel for both does them in one launch."""
        q, k = rope.apply(q, k)
        self.store_kv(k, v, k_cache, v_cache, slot_mapping, q if query_cache is not None else None, query_cache,
                      query_slots, k_scale=k_scale, v_scale=v_scale, launches=launches)
        return q, k

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, *, k_scale=None,
                v_scale=None) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, *, k_scale=None,
               v_scale=None, out: torch.Tensor | None = None, launches=None) -> torch.Tensor:
        """One query per sequence; written into ``out`` (shaped like ``q``) when given."""
        raise NotImplementedError

    def warm_up(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compile now what some steps need only later (e.g. deep into a long prompt), so that no
        step in the middle of serving stalls on a compilation."""


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens: list[int], scale: float) -> torch.Tensor:
    """Causal attention of packed sequences without a cache (memory profiling only)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        # [1, heads, tokens, dim]: batched 4-D inputs let SDPA pick a flash kernel on CUDA; the math
        # fallback would materialise the tokens x tokens scores (hundreds of GB at a 40K context).
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        attn = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        out[start:end] = attn[0].transpose(0, 1)
    return out


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks Triton on CUDA and plain PyTorch on the CPU."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("attention_backend='triton' needs a CUDA device; use 'torch' on the CPU")
        from zipage.attention.triton_backend import TritonBackend
        return TritonBackend()
    if name == "torch":
        from zipage.attention.torch_backend import TorchBackend
        return TorchBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'auto', 'torch' or 'triton'")
