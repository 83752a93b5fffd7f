"""Token embedding and the language-model head (logits of the last tokens only).

Under tensor parallelism both split the vocabulary: rank r holds rows
``[r * per_rank, (r + 1) * per_rank)`` (the last rank's tail padded with zeros when
the vocabulary does not divide). The embedding looks up the ids it holds, zeroes
the others and sums over the group; the head computes its slice of the logits and
gathers the full vocabulary on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zipage.distributed import all_gather, all_reduce, tp_rank, tp_size
from zipage.layers.linear import copy_checked


class VocabParallel(nn.Module):
    """This rank's rows of a ``[vocab_size, ...]`` table and their loader."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size, self.tp_size = vocab_size, tp_size()
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = tp_rank() * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        if self.tp_size == 1:
            copy_checked(param.data, loaded)
            return
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not have the "
                             f"{self.vocab_size} vocabulary rows of this layer")
        rows = self.vocab_end - self.vocab_start
        param.data.zero_()  # padding rows past the vocabulary
        copy_checked(param.data[:rows], loaded[self.vocab_start:self.vocab_end])


class VocabEmbedding(VocabParallel):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = torch.where(outside, 0, input_ids - self.vocab_start)
        hidden = F.embedding(local, self.weight).masked_fill_(outside[:, None], 0.0)
        return all_reduce(hidden)


class LMHead(VocabParallel):
    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False):
        super().__init__(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.rows_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight, self.bias)
        if self.tp_size == 1:
            return logits
        return all_gather(logits, dim=-1)[:, :self.vocab_size]
