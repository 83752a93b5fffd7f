"""Linear layers, whole or split across the tensor-parallel group.

Fusing q/k/v (and gate/up) into one matrix turns three (two) small matmuls into
one; ``weight_loader`` knows where each checkpoint tensor goes in the fused one,
and which of its rows (columns) this rank keeps.

- ``ColumnParallelLinear`` splits the output features: each named part (q, k, v;
  gate, up) is cut on its own, in units (heads, rows), so a rank's output is its
  own heads or its own slice of the MLP, usable without communication.
- ``RowParallelLinear`` splits the input features (the heads of ``o_proj``, the
  MLP slice of ``down_proj``) and sums the partial outputs over the group.

With one process both are plain linear layers over the whole checkpoint tensor.

Built inside ``quant.fp8_linears()``, a layer holds a float8 ``weight`` and a float32
``weight_scale`` per output channel (``quant.py``); the loaders then quantize what they
copy: a column-parallel shard's rows with their scales, a row-parallel shard with the
scales of its whole rows (every rank holds all of them), so each rank's values are
exactly those of one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zipage.distributed import PartialSum, all_reduce, partition, tp_size
from zipage.layers import quant


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, what: str = "") -> None:
    if tuple(loaded.shape) != tuple(target.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a "
                         f"parameter slice of shape {tuple(target.shape)}{what}")
    target.copy_(loaded)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with the whole weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        fp8 = quant.fp8_enabled()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=quant.FP8 if fp8 else None),
                                   requires_grad=False)
        # float32 scale per output channel of a float8 weight (a buffer: no checkpoint tensor of its own)
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32) if fp8 else None)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale is not None

    def unquantize(self, dtype: torch.dtype) -> None:
        """Hold the weight in ``dtype`` after all (a module a checkpoint leaves unquantized)."""
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=dtype, device=self.weight.device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight_scale = None

    def _store_weight(self, target: torch.Tensor, row: int, loaded: torch.Tensor, what: str = "",
                      scale: torch.Tensor | None = None) -> None:
        """Copy ``loaded`` into ``target`` (this rank's weight rows from ``row`` on); a float8 weight
        gets it quantized, with ``scale`` (else its own rows' scales) into ``weight_scale``."""
        if not self.is_fp8 or tuple(loaded.shape) != tuple(target.shape):
            copy_checked(target, loaded, what)  # (raises on a shape mismatch)
            return
        quant.store_rows(target, self.weight_scale.narrow(0, row, target.shape[0]), loaded, scale)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        if param is self.weight:
            self._store_weight(param.data, 0, loaded)
        else:
            copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_fp8:
            return quant.fp8_linear(x, self.weight, self.weight_scale, self.bias)
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """Output features split across ranks, part by part.

    ``parts`` maps a checkpoint shard name to ``(units, rows per unit)``; the fused
    weight holds this rank's units of every part, in the order given.
    """

    def __init__(self, in_features: int, parts: dict[str, tuple[int, int]], bias: bool = False):
        # shard name -> (row offset in the local weight, local rows, first row in the checkpoint tensor, its rows)
        self.shard_slices: dict[str, tuple[int, int, int, int]] = {}
        offset = 0
        for name, (units, unit_rows) in parts.items():
            first, count = partition(units, name)
            self.shard_slices[name] = (offset, count * unit_rows, first * unit_rows, units * unit_rows)
            offset += count * unit_rows
        super().__init__(in_features, offset, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        offset, rows, source, full_rows = self.shard_slices[shard]
        what = f" (shard {shard!r})"
        if loaded.shape[0] != full_rows:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} has {loaded.shape[0]} rows; "
                             f"shard {shard!r} needs {full_rows}")
        if param is self.weight:
            self._store_weight(param.data.narrow(0, offset, rows), offset, loaded.narrow(0, source, rows), what)
        else:
            copy_checked(param.data.narrow(0, offset, rows), loaded.narrow(0, source, rows), what)


class RowParallelLinear(Linear):
    """Input features split across ranks; the partial products are summed over the group.

    The bias is whole on every rank and added once, after the sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp_size = tp_size()
        first, count = partition(in_features, "in_features")
        if count * self.tp_size != in_features:
            raise ValueError(f"in_features={in_features} cannot be split over {self.tp_size} ranks")
        self.first_column = first
        super().__init__(count, out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        scale = None
        if param is self.weight and self.tp_size > 1:
            full = self.in_features * self.tp_size
            if loaded.dim() != 2 or loaded.shape[1] != full:
                raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not have the "
                                 f"{full} input columns of this layer")
            if self.is_fp8:  # the scales of the whole rows, the same on every rank
                scale = quant.row_scales(loaded)
            loaded = loaded.narrow(1, self.first_column, self.in_features)
        if param is self.weight:
            self._store_weight(param.data, 0, loaded, scale=scale)
        else:
            copy_checked(param.data, loaded)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.is_fp8:
            return quant.fp8_linear(x, self.weight, self.weight_scale, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor, reduce: bool = True):
        """The projection summed over the group; ``reduce=False`` leaves the sum to the RMSNorm that
        reads the output (a ``PartialSum``, summed in the norm's kernel), when there is no bias."""
        if self.tp_size == 1:
            return self._matmul(x, self.bias)
        if not reduce and self.bias is None:
            return PartialSum(self._matmul(x, None))
        y = all_reduce(self._matmul(x, None))
        return y if self.bias is None else y + self.bias


def qkv_linear(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool) -> ColumnParallelLinear:
    """Each rank gets ``num_heads / size`` query heads and the KV heads they use (replicated
    when there are fewer KV heads than ranks)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    parts = {"q": (num_heads, head_dim), "k": (num_kv_heads, head_dim), "v": (num_kv_heads, head_dim)}
    return ColumnParallelLinear(hidden_size, parts, bias)


def gate_up_linear(hidden_size: int, intermediate_size: int, bias: bool) -> ColumnParallelLinear:
    """Each rank gets the same slice of gate and of up, so SwiGLU runs locally."""
    return ColumnParallelLinear(hidden_size, {"gate": (intermediate_size, 1), "up": (intermediate_size, 1)}, bias)


def local_heads(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(query heads, KV heads) one rank holds."""
    return partition(num_heads, "num_heads")[1], partition(num_kv_heads, "num_kv_heads")[1]

