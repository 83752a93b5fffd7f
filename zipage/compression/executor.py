"""Run planned compressions on the runner's caches, one layer group at a time.

For each group of layers: gather the window queries from the query cache, score
every cached token (attention over the window, history, pooling, redundancy),
pick the kept tokens per layer and KV head, and compact keys, values and history
scores into the target blocks. The "recency" and "random" baselines replace the
scoring by positions or random draws. On CUDA the hot parts are Triton kernels; on the
CPU their PyTorch twins, which call the pure functions of ``policy.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from zipage.compression import policy
from zipage.compression.planner import CompressionTask
from zipage.config import CompressionConfig
from zipage.kernels.choose_kept import CHOOSE_MAX_TOKENS, choose_kept_torch
from zipage.runner.kv_cache import KVCache


@dataclass
class BatchInputs:
    """One compression batch on the device: R requests, W source blocks, T target blocks."""

    sources: torch.Tensor  # int32 [R, W] block tables before compaction (zero-padded)
    targets: torch.Tensor  # int32 [R, T] blocks receiving the kept tokens
    lengths: torch.Tensor  # int64 [R] cached tokens before compaction
    num_previous: torch.Tensor  # int64 [R] leading tokens with a history score
    pool: torch.Tensor  # bool [R] max-pool this request's scores
    sinks: torch.Tensor  # int64 [R] leading tokens always kept (attention sink, or the prompt)
    active: torch.Tensor  # int64 [R] 1 for a request, 0 for a padding row (compacts nothing)
    rows: torch.Tensor  # int64 [R, window] query-cache rows of the window, oldest first
    keep: int  # tokens kept per (layer, KV head)
    n_max: int  # W * block_size
    use_history: bool  # some request carries history scores
    any_pool: bool  # some request pools
    single_pass: bool  # the compaction may run in one pass (see ``compacts_in_place``)

    @classmethod
    def from_arrays(cls, tables: torch.Tensor, numbers: torch.Tensor, width: int, block_size: int, keep: int,
                    use_history: bool, any_pool: bool, single_pass: bool) -> "BatchInputs":
        """Views of the packed arrays of ``Compressor.host_inputs`` (on the device)."""
        return cls(sources=tables[:, :width], targets=tables[:, width:], lengths=numbers[:, 0],
                   num_previous=numbers[:, 1], pool=numbers[:, 2] != 0, sinks=numbers[:, 3], active=numbers[:, 4],
                   rows=numbers[:, 5:], keep=keep, n_max=width * block_size, use_history=use_history,
                   any_pool=any_pool, single_pass=single_pass)


def eager_widths(config: CompressionConfig, block_size: int, chunk_tokens: int, max_blocks: int,
                 with_graphs: bool) -> list[int]:
    """Source widths (blocks) that stand for the eager compression batches of a run: a request
    holding its budget plus up to a chunk (prompts compressed between chunks), one width per
    class of the kernels' padded length (the next power of two of its tokens); with no graphs,
    the steady-state width too."""
    first = config.max_blocks_per_seq + (0 if not with_graphs else 1)
    last = min(config.max_blocks_per_seq + -(-chunk_tokens // block_size), max_blocks)
    widths, classes = [], set()
    for width in range(first, last + 1):
        padded = 1 << (width * block_size - 1).bit_length()
        if padded not in classes:
            classes.add(padded)
            widths.append(width)
    return widths


def compacts_in_place(tasks: list[CompressionTask]) -> bool:
    """Whether every target block is its request's own source block at the same index, or a block
    that no request of the batch reads: then the compaction may run in a single pass (a synchronous
    batch may break this, when a request's released block becomes another's fresh target)."""
    read = {block for t in tasks for block in t.source_blocks}
    return all(i < len(t.source_blocks) and t.source_blocks[i] == block or block not in read
               for t in tasks for i, block in enumerate(t.target_blocks))


class Compressor:
    def __init__(self, config: CompressionConfig, kv_cache: KVCache | torch.Tensor, score_cache: torch.Tensor | None,
                 query_cache: torch.Tensor, scale: float, block_size: int, kv_scales: torch.Tensor | None = None):
        self.config = config
        if isinstance(kv_cache, torch.Tensor):  # [2, layers, ...]: keys and values of one layout
            kv_cache = KVCache(kv_cache[0], kv_cache[1])
        self.kv_cache = kv_cache  # keys and values, each [layers, blocks, block_size, kv_heads, head_dim]
        self.score_cache = score_cache  # [layers, blocks, block_size, kv_heads] float32, or None
        self.query_cache = query_cache  # [layers, slots * window + 1, heads, head_dim]
        # float8 cache: its scales [2, layers, blocks, block_size, kv_heads] float32, read with the
        # keys and moved with the tokens; None otherwise
        self.kv_scales = kv_scales
        self.scale = scale
        self.block_size = block_size
        self.num_layers = kv_cache.num_layers
        on_gpu = kv_cache.is_cuda
        from zipage.kernels import choose_kept, compact_kv, compress_scores
        self._attention = (compress_scores.paged_attention_scores if on_gpu
                           else compress_scores.paged_attention_scores_torch)
        self._redundancy = (compress_scores.paged_redundancy_sums
                            if on_gpu and block_size <= compress_scores.REDUNDANCY_MAX_BLOCK
                            else compress_scores.paged_redundancy_sums_torch)
        self._compact = compact_kv.compact_kv if on_gpu else compact_kv.compact_kv_torch
        self._choose = choose_kept.choose_kept if on_gpu else None  # None: the PyTorch twin
        self._gather_keys = compress_scores.gather_keys
        self._generator = None  # random eviction draws from its own seeded generator: repeatable runs
        if config.policy == "random":
            self._generator = torch.Generator(device=kv_cache.device).manual_seed(0)
        self.graphs = None  # CompressionGraphs for the steady-state shape (the runner sets it on CUDA)
        # Seconds per stage, accumulated when a benchmark sets this to a dict (synchronises).
        self.stage_seconds: dict[str, float] | None = None
        self._mark_time = 0.0

    def _mark(self, stage: str | None) -> None:
        """Charge the time since the last mark to ``stage`` (only when timing)."""
        if self.stage_seconds is None:
            return
        if self.kv_cache.is_cuda:
            torch.cuda.synchronize(self.kv_cache.device)
        now = time.perf_counter()
        if stage is not None:
            self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + now - self._mark_time
        self._mark_time = now

    @torch.inference_mode()
    def warm_up(self, widths: list[int]) -> None:
        """Compile now the kernels of eagerly run batches (those that no graph fits, e.g. a prompt
        compressed between its chunks, which holds the budget plus a chunk): one batch per source
        width in ``widths`` and per variant an eager batch can take (history and pooling each on or
        off where configured, compaction in one pass or two), each an inactive request of an empty
        cache that compacts nothing. Otherwise the first such batch compiles them mid-serving,
        stalling every stream for about half a second."""
        cfg, bs, device = self.config, self.block_size, self.kv_cache.device
        targets = cfg.max_blocks_per_seq - 1
        for width in widths:
            for use_history in sorted({False, cfg.global_score_decay is not None}):
                for any_pool in sorted({False, cfg.pooling_width is not None}):
                    for single_pass in (True, False):
                        tables = torch.zeros(1, width + targets, dtype=torch.int32, device=device)
                        numbers = torch.zeros(1, 5 + cfg.window, dtype=torch.int64, device=device)
                        numbers[0, 0], numbers[0, 2] = width * bs, int(any_pool)
                        self.compress(BatchInputs.from_arrays(tables, numbers, width, bs, targets * bs,
                                                              use_history, any_pool, single_pass))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def batches(self, tasks: list[CompressionTask]) -> list[list[CompressionTask]]:
        """Split tasks, in order, so that no batch reads more than ``max_blocks_per_compression``
        blocks and every batch keeps one length (requests may have budgets of their own). The
        order stays: a synchronous task's fresh target may be a block an earlier task released."""
        batches, current, blocks = [], [], 0
        for task in tasks:
            n = len(task.source_blocks)
            if current and (blocks + n > self.config.max_blocks_per_compression or task.keep != current[0].keep):
                batches.append(current)
                current, blocks = [], 0
            current.append(task)
            blocks += n
        return batches + ([current] if current else [])

    @torch.inference_mode()
    def run(self, tasks: list[CompressionTask]) -> None:
        for batch in self.batches(tasks):
            if self.graphs is not None and self.stage_seconds is None and self.graphs.fits(batch):
                self.graphs.run(batch)
            else:
                self._run_batch(batch)

    def _run_batch(self, tasks: list[CompressionTask]) -> None:
        inputs = self.batch_inputs(tasks)
        self._mark(None)
        self.compress(inputs)

    def host_inputs(self, tasks: list[CompressionTask], width: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's numbers on the host, padded to ``rows`` requests (repeating the last, marked
        inactive) and ``width`` blocks: int32 [rows, width + T] block tables (sources, then targets) and
        int64 [rows, 5 + window] (tokens, tokens with a history score, pool, protected leading tokens,
        active, then the window's query-cache rows)."""
        window = self.config.window
        padded = tasks + [tasks[-1]] * (rows - len(tasks))
        tables = torch.zeros(rows, width + len(tasks[0].target_blocks), dtype=torch.int32)
        numbers = torch.empty(rows, 5 + window, dtype=torch.int64)
        for i, t in enumerate(padded):
            tables[i, :len(t.source_blocks)] = torch.tensor(t.source_blocks, dtype=torch.int32)
            tables[i, width:] = torch.tensor(t.target_blocks, dtype=torch.int32)
            # Window rows, oldest first: the query of absolute position p sits in ring row p % window.
            numbers[i] = torch.tensor([t.num_tokens, t.num_previous, t.pool, t.protected, i < len(tasks)] + [
                t.seq.query_slot * window + (t.last_position - window + 1 + j) % window for j in range(window)])
        if self.kv_cache.is_cuda:  # pinned: the copies below do not wait for the device
            tables, numbers = tables.pin_memory(), numbers.pin_memory()
        return tables, numbers

    def batch_inputs(self, tasks: list[CompressionTask], width: int | None = None,
                     rows: int | None = None) -> BatchInputs:
        """The tensors of a batch on the device (see ``host_inputs``)."""
        cfg, device = self.config, self.kv_cache.device
        width = width or max(len(t.source_blocks) for t in tasks)
        tables, numbers = self.host_inputs(tasks, width, rows or len(tasks))
        tables, numbers = tables.to(device, non_blocking=True), numbers.to(device, non_blocking=True)
        return BatchInputs.from_arrays(
            tables, numbers, width, self.block_size, tasks[0].keep,
            use_history=cfg.global_score_decay is not None and any(t.num_previous > 0 for t in tasks),
            any_pool=cfg.pooling_width is not None and any(t.pool for t in tasks),
            single_pass=compacts_in_place(tasks))

    def compress(self, b: BatchInputs) -> None:
        """Score and compact one batch: GPU work only, no host synchronisation (graph-capturable)."""
        cfg, bs = self.config, self.block_size
        sources, targets, lengths, num_previous, rows = b.sources, b.targets, b.lengths, b.num_previous, b.rows
        keep, n_max, use_history = b.keep, b.n_max, b.use_history
        history_config = cfg if use_history else replace(cfg, global_score_decay=None)
        pool = b.pool if b.any_pool else False
        for first in range(0, self.num_layers, cfg.layer_group):
            layers = slice(first, min(first + cfg.layer_group, self.num_layers))
            kv_group = self.kv_cache.layers(layers)
            scale_group = self.kv_scales[:, layers] if self.kv_scales is not None else None
            fp8 = {} if scale_group is None else {"scale_group": scale_group}  # compaction
            key_scale = {} if scale_group is None else {"k_scale": scale_group[0]}  # scoring
            if cfg.policy in ("recency", "random"):  # baselines scored without attention
                shape = (lengths, kv_group.keys.shape[0], kv_group.keys.shape[3], n_max)
                scores = (policy.position_scores(*shape) if cfg.policy == "recency"
                          else policy.random_scores(*shape, generator=self._generator))
                kept = policy.choose_by_scores(scores, lengths, cfg, keep, b.sinks)
                self._mark("history and top-k")
                self._compact(kv_group, None, kept, None, sources, targets, single_pass=b.single_pass,
                              active=b.active, **fp8)
                self._mark("compaction")
                continue
            queries = self.query_cache[layers][:, rows].transpose(0, 1).contiguous()  # [R, L, w, Hq, d]
            attention = self._attention(queries, kv_group[0], sources, lengths, self.scale, n_max, **key_scale)
            self._mark("attention")
            rsum = None
            if cfg.redundancy == "lightning":
                rsum = self._redundancy(kv_group[0], sources, lengths, cfg.similarity_threshold, n_max, **key_scale)
            elif cfg.redundancy == "raw":  # all pairs, divided by the length: PyTorch only
                keys = self._gather_keys(kv_group[0], sources, lengths, n_max, **key_scale)
                rsum = policy.redundancy_sums(keys, lengths, cfg.similarity_threshold)
            self._mark("redundancy")
            score_group = self.score_cache[layers] if self.score_cache is not None else None
            fused = self._choose is not None and cfg.redundancy != "raw" and n_max <= CHOOSE_MAX_TOKENS
            kept, new_scores = (self._choose if fused else choose_kept_torch)(
                attention, rsum, lengths, num_previous, pool, b.sinks, score_group if use_history else None,
                sources, history_config, keep, bs, write_scores=score_group is not None,
                divide_by_length=cfg.redundancy == "raw")
            self._mark("history and top-k")
            self._compact(kv_group, score_group, kept, new_scores, sources, targets, single_pass=b.single_pass,
                          active=b.active, **fp8)
            self._mark("compaction")
