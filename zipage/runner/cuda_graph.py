"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket.

A graph bakes in tensor addresses, so every input lives in a static buffer sized
for the largest bucket; a step copies its inputs in, pads the rest (slot -1 and
context length 0 make padding rows write nothing and read nothing), and replays
the smallest graph that fits. Block tables span ``max_table_blocks`` columns, so
a graph stays valid whatever blocks requests hold later.
"""

from __future__ import annotations

import torch

from zipage.attention.metadata import AttentionMetadata, attention_metadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    sizes = [s for s in sizes if s < max_num_seqs] + [max_num_seqs]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model, max_num_seqs: int, max_table_blocks: int, device: torch.device,
                 no_query_row: int | None = None):
        self.model = model
        self.no_query_row = no_query_row  # compression: padding rows write their query here
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        n = max_num_seqs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_table_blocks, dtype=torch.int32, device=device)
        self.query_slots = None
        if no_query_row is not None:
            self.query_slots = torch.full((n,), no_query_row, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:bs],
                                 context_lens=self.context_lens[:bs], block_tables=self.block_tables[:bs],
                                 max_seqlen_k=self.block_tables.shape[1],
                                 query_slots=None if self.query_slots is None else self.query_slots[:bs])

    def _forward(self, bs: int) -> torch.Tensor:
        with attention_metadata(self._metadata(bs)):
            hidden = self.model(self.input_ids[:bs], self.positions[:bs])
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first: later graphs reuse its memory
            self._forward(bs)  # warm-up: compiles kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1]

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        b = input_ids.shape[0]
        bs = next(s for s in self.batch_sizes if s >= b)
        width = meta.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.slot_mapping[b:bs].fill_(-1)
        self.context_lens[:b].copy_(meta.context_lens)
        self.context_lens[b:bs].zero_()
        self.block_tables[:b, :width].copy_(meta.block_tables)
        if self.query_slots is not None:
            self.query_slots[:b].copy_(meta.query_slots)
            self.query_slots[b:bs].fill_(self.no_query_row)
        self.graphs[bs].replay()
        return self.logits[bs][:b]
