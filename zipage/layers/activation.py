from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zipage.layers.fusion import fused


@fused
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """SwiGLU gate: ``silu(gate) * up`` for the fused ``[gate, up]`` projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
