"""What runs each step: admission (prefill), decode, preemption.

The scheduler decides *which* requests run; the block manager decides *where*
their KV lives. A step is either one batched prefill of newly admitted requests
or one decode step of every running request (prefill goes first, as in vLLM's
default scheduling without chunked prefill).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from zipage.compression.planner import CompressionTask, needs_compression, plan_compression
from zipage.config import CompressionConfig, SchedulerConfig
from zipage.engine.block_manager import BlockManager
from zipage.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool
    preempted: list[Sequence] = field(default_factory=list)
    compressions: list[CompressionTask] = field(default_factory=list)  # run before the forward

    @property
    def num_tokens(self) -> int:
        """Tokens this step computes."""
        if not self.is_prefill:
            return len(self.seqs)
        return sum(s.num_tokens - s.num_prefix_hit_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 compression: CompressionConfig | None = None):
        self.config = config
        self.block_manager = block_manager
        self.compression = compression
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: newest last
        self.num_preemptions = 0
        # Query-cache rows: every running request saves its window queries.
        self.free_query_slots = list(range(config.max_num_seqs)) if compression else []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's batch, or ``None`` when nothing is left to run."""
        batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        return batch if batch.seqs else None

    def _schedule_prefill(self) -> ScheduledBatch | None:
        bm, budget = self.block_manager, self.config.max_num_batched_tokens
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            new_tokens = seq.num_tokens - bm.cached_prefix_tokens(seq)
            if (new_tokens > budget and admitted) or not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            budget -= new_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if self.compression is not None:
                seq.query_slot = self.free_query_slots.pop()
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            admitted.append(seq)
        return ScheduledBatch(admitted, is_prefill=True) if admitted else None

    def _schedule_decode(self) -> ScheduledBatch:
        bm, compression = self.block_manager, self.compression
        batch, preempted = [], []
        tasks: dict[Sequence, CompressionTask] = {}

        def make_room(seq, has_room) -> bool:
            """Preempt the newest requests until ``has_room()``; False if ``seq`` itself went."""
            while not has_room():
                victim = self.running[-1]  # recompute the newest request later
                self.preempt(victim)
                preempted.append(victim)
                tasks.pop(victim, None)  # its planned compaction must not run
                if victim is seq:
                    return False
            return True

        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if compression is not None and needs_compression(seq, bm, compression):
                if not make_room(seq, lambda: bm.can_compact(seq, compression.max_blocks_per_seq - 1)):
                    continue
                tasks[seq] = plan_compression(seq, bm, compression)
            if make_room(seq, lambda: bm.can_append(seq)):
                bm.append_slot(seq)
                batch.append(seq)
        return ScheduledBatch(batch, is_prefill=False, preempted=preempted,
                              compressions=list(tasks.values()))

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it first in line; it is recomputed on readmission."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._release_query_slot(seq)
        seq.num_scored_tokens = 0  # recomputed from its tokens: no history survives
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Mark ``seq`` finished and release its blocks (running or waiting)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._release_query_slot(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.metrics.finished_time = time.perf_counter()

    def _release_query_slot(self, seq: Sequence) -> None:
        if seq.query_slot is not None:
            self.free_query_slots.append(seq.query_slot)
            seq.query_slot = None
