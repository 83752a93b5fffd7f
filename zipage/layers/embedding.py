"""Token embedding and the language-model head (logits of the last tokens only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = _copy_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = _copy_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(vocab_size), requires_grad=False)
            self.bias.weight_loader = _copy_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight, self.bias)


def _copy_loader(param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a "
                         f"parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded)
