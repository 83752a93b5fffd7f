"""Rotary position embedding (the rotate-half form used by Llama and Qwen)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from zipage.kernels import norm_rope
from zipage.layers.fusion import fused
from zipage.layers.norm import rms_norm_eager


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair rotation frequencies, with Llama 3 or linear scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(in_band, blended, scaled)
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@fused(kernel=norm_rope.rope_triton if norm_rope.AVAILABLE else None)
def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor):
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


@fused(kernel=norm_rope.norm_rope_triton if norm_rope.AVAILABLE else None)
def norm_and_apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                        q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float):
    """Qwen3's per-head RMSNorm of queries and keys, then RoPE (one kernel when fused)."""
    q, k = rms_norm_eager(q, q_weight, eps), rms_norm_eager(k, k_weight, eps)
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotate ``q`` [tokens, heads, dim] and ``k`` [tokens, kv_heads, dim] by position."""
        return apply_rope(positions, q, k, self.cos_sin)


@dataclass
class RopeInputs:
    """A layer's query/key norm (Qwen3: per-head weights; None without) and RoPE, handed to the
    attention layer so that a backend can rotate and store the keys in one launch
    (``AttentionBackend.norm_rope_store_kv``)."""
    positions: torch.Tensor
    cos_sin: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 0.0

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm and RoPE alone: rotated ``(q, k)``."""
        if self.q_weight is None:
            return apply_rope(self.positions, q, k, self.cos_sin)
        return norm_and_apply_rope(self.positions, q, k, self.cos_sin, self.q_weight, self.k_weight, self.eps)
