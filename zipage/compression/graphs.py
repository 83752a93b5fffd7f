"""Steady-state compactions replayed as CUDA graphs.

Almost every compression has the same shape: a decoding request holding N full
blocks keeps (N-1) blocks' worth of tokens. Launched op by op, one such batch is
a few hundred small kernels and costs milliseconds of host time, during which
the host cannot launch decode steps (so even a side stream overlaps nothing).
Captured once per batch-size bucket, it is one launch.

A batch is padded to its bucket by repeating its last request, marked inactive:
it is scored again and its compaction skipped. Batches of another shape (a long
prompt's first compression), batches whose compaction needs two passes (see
``compacts_in_place``) and baseline policies run eagerly.
"""

from __future__ import annotations

import torch

from zipage.compression.executor import BatchInputs, Compressor, compacts_in_place
from zipage.compression.planner import CompressionTask

MAX_GRAPH_REQUESTS = 32  # larger batches run as several replays (bounds the graphs' scratch memory)


def graph_bucket_sizes(max_requests: int) -> list[int]:
    sizes, size = [], 1
    while size < max_requests:
        sizes.append(size)
        size *= 2
    return sizes + [max_requests]


class CompressionGraphs:
    def __init__(self, compressor: Compressor, max_requests: int):
        cfg = compressor.config
        self.compressor = compressor
        self.width = cfg.max_blocks_per_seq  # N source blocks
        self.num_tokens = self.width * compressor.block_size
        self.keep = (self.width - 1) * compressor.block_size
        self.buckets = graph_bucket_sizes(max(1, min(max_requests, MAX_GRAPH_REQUESTS)))
        device = compressor.kv_cache.device
        n, window = self.buckets[-1], cfg.window
        self.tables = torch.zeros(n, 2 * self.width - 1, dtype=torch.int32, device=device)
        self.numbers = torch.zeros(n, 5 + window, dtype=torch.int64, device=device)
        self.numbers[:, 0] = self.num_tokens  # for the warm-up and capture (inactive: compacts nothing)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _inputs(self, size: int) -> BatchInputs:
        cfg, tables, numbers = self.compressor.config, self.tables[:size], self.numbers[:size]
        # History and pooling always on: with num_previous = 0 and pool = False they change nothing.
        return BatchInputs.from_arrays(tables, numbers, self.width, self.compressor.block_size, self.keep,
                                       use_history=cfg.global_score_decay is not None,
                                       any_pool=cfg.pooling_width is not None, single_pass=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per bucket (at start-up: the warm-up writes into block 0 of an empty cache)."""
        pool = None
        stream = torch.cuda.Stream(self.tables.device)  # capture needs a non-default stream
        stream.wait_stream(torch.cuda.current_stream(self.tables.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.buckets):
                self.compressor.compress(self._inputs(size))  # compiles the kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.compressor.compress(self._inputs(size))
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.current_stream(self.tables.device).wait_stream(stream)
        torch.cuda.synchronize(self.tables.device)

    def fits(self, tasks: list[CompressionTask]) -> bool:
        return all(len(t.source_blocks) == self.width and t.num_tokens == self.num_tokens and t.keep == self.keep
                   for t in tasks) and compacts_in_place(tasks)

    def run(self, tasks: list[CompressionTask]) -> None:
        """Replay graphs for ``tasks`` (which ``fits``) on the current stream."""
        largest = self.buckets[-1]
        for start in range(0, len(tasks), largest):
            chunk = tasks[start:start + largest]
            size = next(s for s in self.buckets if s >= len(chunk))
            tables, numbers = self.compressor.host_inputs(chunk, self.width, size)
            self.tables[:size].copy_(tables, non_blocking=True)
            self.numbers[:size].copy_(numbers, non_blocking=True)
            graph = self.graphs.get(size)
            if graph is not None:
                graph.replay()
            else:  # not captured (the CPU, in tests): the same work on the same buffers, eagerly
                self.compressor.compress(self._inputs(size))
