"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from zipage.distributed import PartialSum, all_reduce_add_rms_norm
from zipage.kernels import norm_rope
from zipage.layers import quant
from zipage.layers.fusion import fused


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@fused(kernel=norm_rope.rms_norm_triton if norm_rope.AVAILABLE else None)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_eager(x, weight, eps)


@fused(kernel=norm_rope.add_rms_norm_triton if norm_rope.AVAILABLE else None)
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(norm(x + residual), x + residual)``."""
    x = x + residual
    return rms_norm_eager(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.quantize_for = None

    def feeds(self, projection: nn.Module) -> None:
        """Name the projection that alone reads this norm's output: when it holds float8 weights
        and runs W8A8, the norm hands it its rows quantized (one kernel instead of two). A plain
        reference, not a submodule: the projection belongs to its own parent."""
        object.__setattr__(self, "quantize_for", projection)

    def forward(self, x, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``, returns ``(norm(x + residual), x + residual)``. The
        norm comes as ``quant.QuantizedRows`` when the projection it ``feeds`` quantizes its input.
        ``x`` may be a ``distributed.PartialSum`` (a row-parallel projection's output): it is summed
        over the group first, in the norm's kernel where the one-shot all-reduce is on."""
        if isinstance(x, PartialSum):
            if residual is not None and not self._quantizes(x.partial):
                fused_out = all_reduce_add_rms_norm(x.partial, residual, self.weight, self.eps)
                if fused_out is not None:
                    return fused_out
            x = x.reduce()
        if self._quantizes(x):
            out = norm_rope.add_rms_norm_quantize_triton(x, residual, self.weight, self.eps)
            normed = quant.QuantizedRows(*(out if residual is None else out[0]), x.dtype)
            return normed if residual is None else (normed, out[1])
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def _quantizes(self, x: torch.Tensor) -> bool:
        consumer = self.quantize_for
        return consumer is not None and consumer.is_fp8 and norm_rope.AVAILABLE and quant.producer_quantizes(x)
