"""The sparse MLP of mixture-of-experts models (Qwen3-MoE): a router and its experts.

The router (``gate``) scores every expert for each token; the ``top_k`` best run the
token through their SwiGLU MLP, and their outputs are summed, weighted by the router's
softmax (renormalized over the chosen experts with ``norm_topk_prob``).

Every expert's gate and up projections are stacked in ``w13`` [experts, 2 * I, hidden]
and its down projection in ``w2`` [experts, hidden, I]; the checkpoint's per-expert
tensors (``experts.{e}.gate_proj.weight``...) land in their rows via ``weight_loader``.
With tensor parallelism each rank holds the same slice of every expert's intermediate
dimension, as for a dense MLP, and the partial outputs are summed over the group.

Built inside ``quant.fp8_linears()`` (``quantization="fp8"``, or a block-wise FP8 checkpoint),
the experts hold float8 e4m3 weights with a float32 scale per output row of each expert
(``w13_scale`` [E, 2I], ``w2_scale`` [E, H]), quantized as each checkpoint tensor arrives,
as the dense layers are (``quant.py``). A row of ``w2`` is split over the ranks, so its scale
is taken over the whole row before the split, the same on every rank. The router stays in
the model's dtype.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from zipage.distributed import all_reduce, partition, tp_size
from zipage.layers import quant
from zipage.layers.linear import Linear, copy_checked

EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp_size = tp_size()
        self.first, self.inter = partition(intermediate_size, "moe_intermediate_size")
        self.full_inter = intermediate_size
        self.gate = Linear(hidden_size, num_experts)
        fp8 = quant.fp8_enabled()
        dtype = quant.FP8 if fp8 else None
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter, dtype=dtype), requires_grad=False)
        # float32 scales per output row of float8 experts (buffers: no checkpoint tensors of their own)
        self.register_buffer("w13_scale", torch.ones(num_experts, 2 * self.inter, dtype=torch.float32) if fp8 else None)
        self.register_buffer("w2_scale", torch.ones(num_experts, hidden_size, dtype=torch.float32) if fp8 else None)
        self._init_params()

    def _init_params(self) -> None:
        for param in (self.w13, self.w2):
            param.weight_loader = self.weight_loader
        self.w13.shards = [(e, part) for e in range(self.num_experts) for part in ("gate_proj", "up_proj")]
        self.w2.shards = [(e, "down_proj") for e in range(self.num_experts)]

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale is not None

    def unquantize(self, dtype: torch.dtype) -> None:
        """Hold the experts in ``dtype`` after all (a checkpoint's ``modules_to_not_convert``)."""
        for name in ("w13", "w2"):
            shape, device = getattr(self, name).shape, getattr(self, name).device
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False))
        self.w13_scale = self.w2_scale = None
        self._init_params()

    @staticmethod
    def checkpoint_target(name: str) -> tuple[str, tuple[int, str]] | None:
        """(parameter name, shard) of a checkpoint tensor of one expert, or None for any other name."""
        found = EXPERT_TENSOR.search(name)
        if found is None:
            return None
        expert, part = int(found.group(1)), found.group(2)
        param = "w2" if part == "down_proj" else "w13"
        return f"{name[:found.start()]}.{param}", (expert, part)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, str]) -> None:
        expert, part = shard
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint expert {expert} is outside the config's {self.num_experts} experts")
        what = f" (expert {expert}, {part})"
        if part == "down_proj":
            if loaded.dim() != 2 or loaded.shape[1] != self.full_inter:
                raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)}{what} does not have the "
                                 f"{self.full_inter} input columns of moe_intermediate_size")
            # the scales of the whole rows, the same on every rank
            scale = quant.row_scales(loaded) if self.is_fp8 else None
            self._store(param.data[expert], self.w2_scale, expert, 0, loaded.narrow(1, self.first, self.inter),
                        what, scale)
        else:
            if loaded.dim() != 2 or loaded.shape[0] != self.full_inter:
                raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)}{what} does not have the "
                                 f"{self.full_inter} rows of moe_intermediate_size")
            first_row = 0 if part == "gate_proj" else self.inter
            self._store(param.data[expert].narrow(0, first_row, self.inter), self.w13_scale, expert, first_row,
                        loaded.narrow(0, self.first, self.inter), what)

    def _store(self, target: torch.Tensor, scales: torch.Tensor | None, expert: int, row: int,
               loaded: torch.Tensor, what: str, scale: torch.Tensor | None = None) -> None:
        """Copy ``loaded`` into ``target`` (rows of one expert from ``row`` on); float8 experts get
        it quantized per row, with ``scale`` (else its own rows') into ``scales[expert]``."""
        if not self.is_fp8 or tuple(loaded.shape) != tuple(target.shape):
            copy_checked(target, loaded, what)  # (raises on a shape mismatch)
            return
        quant.store_rows(target, scales[expert].narrow(0, row, target.shape[0]), loaded, scale)

    def _store_weight(self, target: torch.Tensor, row: int, loaded: torch.Tensor) -> None:
        """All experts of ``w13`` or ``w2`` at once from ``loaded`` [E, rows, columns] (random
        weights in a named shape: ``loader.init_dummy_weights``)."""
        scales = self.w13_scale if target.data_ptr() == self.w13.data_ptr() else self.w2_scale
        if tuple(loaded.shape) != tuple(target.shape) or row != 0:
            raise ValueError(f"random experts of shape {tuple(loaded.shape)} do not fit {tuple(target.shape)}")
        quant.store_rows(target.view(-1, target.shape[-1]), scales.view(-1), loaded.reshape(-1, loaded.shape[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from zipage.kernels.fused_moe import fused_moe, fused_moe_torch

        logits = self.gate(x)
        run = fused_moe if x.is_cuda else fused_moe_torch
        out = run(x, self.w13, self.w2, logits, self.top_k, self.renormalize, w13_scale=self.w13_scale,
                  w2_scale=self.w2_scale)
        return all_reduce(out) if self.tp_size > 1 else out
