"""The sparse MLP of mixture-of-experts models (Qwen3-MoE): a router and its experts.

The router (``gate``) scores every expert for each token; the ``top_k`` best run the
token through their SwiGLU MLP, and their outputs are summed, weighted by the router's
softmax (renormalized over the chosen experts with ``norm_topk_prob``).

Every expert's gate and up projections are stacked in ``w13`` [experts, 2 * I, hidden]
and its down projection in ``w2`` [experts, hidden, I]; the checkpoint's per-expert
tensors (``experts.{e}.gate_proj.weight``...) land in their rows via ``weight_loader``.
With tensor parallelism each rank holds the same slice of every expert's intermediate
dimension, as for a dense MLP, and the partial outputs are summed over the group.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from zipage.distributed import all_reduce, partition, tp_size
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
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter), requires_grad=False)
        for param in (self.w13, self.w2):
            param.weight_loader = self.weight_loader
        self.w13.shards = [(e, part) for e in range(num_experts) for part in ("gate_proj", "up_proj")]
        self.w2.shards = [(e, "down_proj") for e in range(num_experts)]

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
            copy_checked(param.data[expert], loaded.narrow(1, self.first, self.inter), what)
        else:
            if loaded.dim() != 2 or loaded.shape[0] != self.full_inter:
                raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)}{what} does not have the "
                                 f"{self.full_inter} rows of moe_intermediate_size")
            rows = param.data[expert].narrow(0, 0 if part == "gate_proj" else self.inter, self.inter)
            copy_checked(rows, loaded.narrow(0, self.first, self.inter), what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from zipage.kernels.fused_moe import fused_moe, fused_moe_torch

        logits = self.gate(x)
        run = fused_moe if x.is_cuda else fused_moe_torch
        out = run(x, self.w13, self.w2, logits, self.top_k, self.renormalize)
        return all_reduce(out) if self.tp_size > 1 else out
