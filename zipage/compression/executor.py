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
from dataclasses import replace

import torch

from zipage.compression import policy
from zipage.compression.planner import CompressionTask
from zipage.config import CompressionConfig


class Compressor:
    def __init__(self, config: CompressionConfig, kv_cache: torch.Tensor, score_cache: torch.Tensor | None,
                 query_cache: torch.Tensor, scale: float, block_size: int):
        self.config = config
        self.kv_cache = kv_cache  # [2, layers, blocks, block_size, kv_heads, head_dim]
        self.score_cache = score_cache  # [layers, blocks, block_size, kv_heads] float32, or None
        self.query_cache = query_cache  # [layers, slots * window + 1, heads, head_dim]
        self.scale = scale
        self.block_size = block_size
        self.num_layers = kv_cache.shape[1]
        on_gpu = kv_cache.is_cuda
        from zipage.kernels import compact_kv, compress_scores
        self._attention = (compress_scores.paged_attention_scores if on_gpu
                           else compress_scores.paged_attention_scores_torch)
        self._redundancy = (compress_scores.paged_redundancy_sums
                            if on_gpu and block_size <= compress_scores.REDUNDANCY_MAX_BLOCK
                            else compress_scores.paged_redundancy_sums_torch)
        self._compact = compact_kv.compact_kv if on_gpu else compact_kv.compact_kv_torch
        self._gather_keys = compress_scores.gather_keys
        self._generator = None  # random eviction draws from its own seeded generator: repeatable runs
        if config.policy == "random":
            self._generator = torch.Generator(device=kv_cache.device).manual_seed(0)
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

    def batches(self, tasks: list[CompressionTask]) -> list[list[CompressionTask]]:
        """Split tasks so that no batch reads more than ``max_blocks_per_compression`` blocks."""
        batches, current, blocks = [], [], 0
        for task in tasks:
            n = len(task.source_blocks)
            if current and blocks + n > self.config.max_blocks_per_compression:
                batches.append(current)
                current, blocks = [], 0
            current.append(task)
            blocks += n
        return batches + ([current] if current else [])

    @torch.inference_mode()
    def run(self, tasks: list[CompressionTask]) -> None:
        for batch in self.batches(tasks):
            self._run_batch(batch)

    def _run_batch(self, tasks: list[CompressionTask]) -> None:
        cfg, bs, device = self.config, self.block_size, self.kv_cache.device
        window = cfg.window
        keep = tasks[0].keep
        width = max(len(t.source_blocks) for t in tasks)
        n_max = width * bs
        sources = torch.zeros(len(tasks), width, dtype=torch.int32)
        for i, t in enumerate(tasks):
            sources[i, :len(t.source_blocks)] = torch.tensor(t.source_blocks, dtype=torch.int32)
        sources = sources.to(device)
        targets = torch.tensor([t.target_blocks for t in tasks], dtype=torch.int32, device=device)
        lengths = torch.tensor([t.num_tokens for t in tasks], dtype=torch.int64, device=device)
        num_previous = torch.tensor([t.num_previous for t in tasks], dtype=torch.int64, device=device)
        pool = torch.tensor([t.pool for t in tasks], dtype=torch.bool, device=device)
        # Window rows, oldest first: the query of absolute position p sits in ring row p % window.
        rows = torch.tensor([[t.seq.query_slot * window + (t.last_position - window + 1 + i) % window
                              for i in range(window)] for t in tasks], dtype=torch.int64, device=device)
        use_history = cfg.global_score_decay is not None and any(t.num_previous > 0 for t in tasks)
        history_config = cfg if use_history else replace(cfg, global_score_decay=None)
        any_pool = cfg.pooling_width is not None and any(t.pool for t in tasks)
        self._mark(None)

        for first in range(0, self.num_layers, cfg.layer_group):
            layers = slice(first, min(first + cfg.layer_group, self.num_layers))
            kv_group = self.kv_cache[:, layers]
            if cfg.policy in ("recency", "random"):  # baselines scored without attention
                shape = (lengths, kv_group.shape[1], kv_group.shape[4], n_max)
                scores = (policy.position_scores(*shape) if cfg.policy == "recency"
                          else policy.random_scores(*shape, generator=self._generator))
                kept = policy.choose_by_scores(scores, lengths, cfg, keep)
                self._mark("history and top-k")
                self._compact(kv_group, None, kept, None, sources, targets)
                self._mark("compaction")
                continue
            queries = self.query_cache[layers][:, rows].transpose(0, 1).contiguous()  # [R, L, w, Hq, d]
            attention = self._attention(queries, kv_group[0], sources, lengths, self.scale, n_max)
            self._mark("attention")
            redundancy = None
            if cfg.redundancy == "lightning":
                rsum = self._redundancy(kv_group[0], sources, lengths, cfg.similarity_threshold, n_max)
                redundancy = policy.normalise_redundancy(rsum, lengths, cfg.redundancy_temperature, bs)
            elif cfg.redundancy == "raw":
                keys = self._gather_keys(kv_group[0], sources, lengths, n_max)
                redundancy = policy.redundancy_scores(keys, lengths, cfg.similarity_threshold,
                                                      cfg.redundancy_temperature)
            self._mark("redundancy")
            previous = None
            if use_history:
                previous = self._gather_keys(self.score_cache[layers].unsqueeze(-1), sources, num_previous,
                                             n_max).squeeze(-1)
            kept, history = policy.choose_tokens(attention, redundancy, lengths, previous, num_previous,
                                                 history_config, keep, pool if any_pool else False)
            new_scores = history.gather(-1, kept) if self.score_cache is not None else None
            self._mark("history and top-k")
            score_group = self.score_cache[layers] if self.score_cache is not None else None
            self._compact(kv_group, score_group, kept, new_scores, sources, targets)
            self._mark("compaction")
