"""Linear layers whose weights may be packed from several checkpoint tensors.

Fusing q/k/v (and gate/up) into one matrix turns three (two) small matmuls into
one; ``weight_loader`` knows where each checkpoint tensor goes in the fused one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x W^T (+ b)``, with a loader that checks shapes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shard_sizes: dict | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # shard name -> (row offset, rows) inside the fused weight
        self.shard_slices: dict = {}
        if shard_sizes:
            offset = 0
            for name, rows in shard_sizes.items():
                self.shard_slices[name] = (offset, rows)
                offset += rows
            assert offset == out_features, (shard_sizes, out_features)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        target = param.data
        if shard is not None:
            offset, rows = self.shard_slices[shard]
            target = target.narrow(0, offset, rows)
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a "
                             f"parameter slice of shape {tuple(target.shape)} (shard {shard!r})")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def qkv_linear(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool) -> Linear:
    sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
    return Linear(hidden_size, sum(sizes.values()), bias, shard_sizes=sizes)


def gate_up_linear(hidden_size: int, intermediate_size: int, bias: bool) -> Linear:
    return Linear(hidden_size, 2 * intermediate_size, bias,
                  shard_sizes={"gate": intermediate_size, "up": intermediate_size})
