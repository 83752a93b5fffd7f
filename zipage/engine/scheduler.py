"""What runs each step: admission (prefill), decode, compression, preemption.

The scheduler decides *which* requests run; the block manager decides *where*
their KV lives. With chunked prefill (the default) a step first decodes every running
request that can, then spends what is left of ``max_num_batched_tokens`` on prompt
chunks: the prompts already started, oldest first, then newly admitted requests. A
request is admitted with blocks for its whole prompt; each chunk caches the full blocks
it completes in the prefix cache. Only a prompt's last chunk samples a token. Without
chunked prefill a step is either one batched prefill of whole prompts or one decode step
(prefill goes first, as in vLLM's scheduling without chunked prefill).

A prompt compressed between its chunks (``CompressionConfig.prefill_compression``; by
default only a prompt too long to be cached whole) needs a query slot to be admitted,
takes its blocks chunk by chunk, and before each chunk compresses once it holds N full
blocks, as a decoding request does (the observation window: the last ``window`` prompt
tokens computed), so it never holds more than N blocks plus one chunk.

With asynchronous compression a step carries either prompt chunks or prompt compactions,
not both: a compaction of the budget plus a chunk costs the device about what a chunk does,
and a step with both took one and a half times as long as one with a chunk, every stream
waiting on it.

A chunk's cost against the token budget may count its attention too
(``SchedulerConfig.prefill_attention_span``, off by default): a chunk deep into a long
prompt attends to all that came before it, so it then gets fewer tokens, and a step that
carries one takes about as long as one that starts a prompt.

With compression, a decode step also plans compactions (``compression/planner.py``)
and follows the hybrid scheduling of Compressed PagedAttention:

- ``M`` query slots save window queries. Free slots go to running requests in
  admission order. A request without one decodes only while its next token lies
  before the window of its next compression; past that it waits for a slot.
- When no slot is free, a waiting request is admitted only if it can decode
  without one.
- A request being compressed asynchronously skips decode steps until its
  compaction is done; at most one compression batch is in flight.
- When blocks run out, the newest running request that holds no slot, is not
  being compressed and is not already placed in the step being built is preempted
  (recomputed later). With no such request the one
  that needed a block waits this step ("restricted" mode). Should no request at
  all make progress in a step (slot holders all waiting on blocks that only
  another slot holder could free, as when they share a long prompt's blocks), the
  step is planned again with slot holders allowed as victims.
- Only a request whose tokens fit the cache when recomputed is ever preempted.

Without hybrid scheduling every running request holds a slot (at most M run), and
preemption takes the newest running request not being compressed nor placed in the
step, possibly the requester itself.

Budgets are per request (``Sequence.max_blocks``, from ``SamplingParams.kv_budget_tokens``
and ``compression``): a request with a smaller budget compresses at its own N and
may go without a slot only below its own limit; a full-KV request (``compression=False``)
never compresses, never takes a slot, may always run without one, and is preempted like
any request without a slot.

A compression's state lives in ``Compressions`` (``compression/lifecycle.py``); the
scheduler plans through it and asks it which requests are being compressed.
"""

from __future__ import annotations

import math

import time
from collections import deque
from dataclasses import dataclass, field

from zipage.compression.lifecycle import Compressions
from zipage.compression.planner import CompressionTask, needs_compression, request_max_blocks
from zipage.config import CompressionConfig, SchedulerConfig
from zipage.engine.block_manager import BlockManager
from zipage.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool
    preempted: list[Sequence] = field(default_factory=list)
    compressions: list[CompressionTask] = field(default_factory=list)  # launched before the forward
    cache_entries: list = field(default_factory=list)  # provisional prefix-cache entries of its prefill

    @property
    def num_tokens(self) -> int:
        """Tokens this step computes."""
        if not self.is_prefill:
            return len(self.seqs)
        return sum(s.chunk[1] if s.chunk is not None else 1 for s in self.seqs)

    @property
    def num_decodes(self) -> int:
        """Requests that decode in this step (the others compute prompt chunks)."""
        if not self.is_prefill:
            return len(self.seqs)
        return sum(s.chunk is None for s in self.seqs)

    @property
    def sampled(self) -> list[Sequence]:
        """The requests the step samples a token for, in order (read before the next schedule)."""
        if not self.is_prefill:
            return self.seqs
        return [s for s in self.seqs if s.samples]


def model_attention_span(hf_config) -> int:
    """The default ``SchedulerConfig.prefill_attention_span`` of a model: the keys whose
    attention costs as many FLOPs (4 * heads * head_dim a key and layer: QK^T and PV) as one
    token's linear layers (2 per weight of a layer's projections and MLP; a mixture of experts
    counts the experts a token goes to). Qwen3-8B: 23,552; Qwen3-30B-A3B: 6,912."""
    c = getattr(hf_config, "text_config", None) or hf_config
    hidden, heads = c.hidden_size, c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    if getattr(c, "num_experts", 0) and getattr(c, "moe_intermediate_size", 0):
        mlp = 3 * hidden * c.moe_intermediate_size * c.num_experts_per_tok
    else:
        mlp = 3 * hidden * c.intermediate_size
    weights = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + mlp
    return max(1, round(2 * weights / (4 * heads * head_dim)))


class WaitingQueue:
    """Requests waiting for admission, in line. Removing one is O(1): a finished request is
    only counted out, and passed over once it reaches the head of the line."""

    def __init__(self):
        self._queue: deque[Sequence] = deque()
        self._len = 0

    def append(self, seq: Sequence) -> None:
        self._queue.append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        self._queue.appendleft(seq)
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        """Count ``seq`` out; the caller marks it finished, which makes it skipped."""
        self._len -= 1

    def _trim(self) -> None:
        while self._queue and self._queue[0].status is not SequenceStatus.WAITING:
            self._queue.popleft()

    def first(self) -> Sequence:
        self._trim()
        return self._queue[0]

    def popleft(self) -> Sequence:
        self._trim()
        self._len -= 1
        return self._queue.popleft()

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        return (seq for seq in self._queue if seq.status is SequenceStatus.WAITING)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 compression: CompressionConfig | None = None, num_query_slots: int = 0):
        self.config = config
        self.block_manager = block_manager
        # A preempted request is recomputed from all its tokens: it must fit the cache alone.
        self.max_recompute_tokens = block_manager.num_blocks * block_manager.block_size
        self.compression = compression
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []  # in admission order: newest last
        self.num_preemptions = 0
        self.free_query_slots = list(range(num_query_slots))[::-1]
        self.compressions: Compressions | None = None
        self.released: list[Sequence] = []  # preempted or finished since the engine last took them
        if compression is not None:
            self.hybrid = compression.hybrid
            self.asynchronous = compression.asynchronous
            self.compressions = Compressions(block_manager, compression, compression.asynchronous)

    def add(self, seq: Sequence) -> None:
        seq.max_blocks = request_max_blocks(self.compression, self.block_manager.block_size, seq.sampling_params)
        seq.compress_prefill = self._compresses_prefill(seq)
        self.waiting.append(seq)

    def _compresses_prefill(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prompt is compressed between its chunks (see the module's docstring)."""
        if seq.max_blocks is None or not self.config.enable_chunked_prefill:
            return False
        mode = self.compression.prefill_compression
        # "long": a prompt the cache cannot hold whole (the engine's limit for whole prompts).
        return mode == "always" or (mode == "long" and seq.num_prompt_tokens > self.max_whole_prompt_tokens)

    @property
    def max_whole_prompt_tokens(self) -> int:
        """The longest prompt cached whole before it is compressed: the cache less one block."""
        return self.max_recompute_tokens - self.block_manager.block_size

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's work, or ``None`` when nothing can run this step."""
        self._hand_out_query_slots()
        chunked = self.config.enable_chunked_prefill
        batch = None if chunked else self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
            chunks = self._schedule_chunks(self.config.max_num_batched_tokens - len(batch.seqs)) if chunked else []
            if self.compressions is not None:  # with those planned before prompt chunks
                batch.compressions = self.compressions.planned
            if (not batch.seqs and not chunks and not batch.compressions and self.compression is not None
                    and not self.compressions.busy and self.running and self.hybrid):
                earlier = batch.preempted  # nobody could move: slot holders may go too
                batch = self._schedule_decode(last_resort=True)
                batch.preempted = earlier + batch.preempted
            if chunked and not batch.seqs and not chunks and not batch.compressions:
                chunks = self._unblock_prompts(batch)
            batch.seqs += chunks  # decodes first, then prompt chunks
            batch.is_prefill = bool(chunks)
        return batch if batch.seqs or batch.compressions else None

    # -- query slots ----------------------------------------------------------
    def _hand_out_query_slots(self) -> None:
        if self.compression is None:
            return
        for seq in self.running:
            if not self.free_query_slots:
                return
            if seq.query_slot is None and seq.max_blocks is not None:  # full KV never needs one
                seq.query_slot = self.free_query_slots.pop()

    def _release_query_slot(self, seq: Sequence) -> None:
        if seq.query_slot is not None:
            self.free_query_slots.append(seq.query_slot)
            seq.query_slot = None

    def _may_run_without_slot(self, seq: Sequence, kv_len: int) -> bool:
        """Whether ``seq`` with ``kv_len`` cached tokens can cache the next one without a slot."""
        if seq.max_blocks is None:
            return True  # full KV: never compressed, so no window to save
        return self.hybrid and kv_len < self.compression.slotless_limit(self.block_manager.block_size, seq.max_blocks)

    # -- prefill --------------------------------------------------------------
    def _can_admit(self, seq: Sequence) -> bool:
        """Whether the request at the head of the line can be admitted now (with all its blocks)."""
        if seq.num_pending or not self.block_manager.can_allocate(seq):
            return False  # (a request this schedule preempted may still have a token in flight)
        # A prompt that reaches into a compression window needs a slot.
        return (self.compression is None or bool(self.free_query_slots)
                or self._may_run_without_slot(seq, seq.num_tokens))

    def _admit(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Give the head of the line blocks for its first ``num_tokens`` tokens (default: all), and a
        query slot if one is free: it runs."""
        self.block_manager.allocate(seq, num_tokens)
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        if self.compression is not None and self.free_query_slots and seq.max_blocks is not None:
            seq.query_slot = self.free_query_slots.pop()
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.perf_counter()
        self.running.append(seq)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        """Without chunked prefill: whole prompts, as many as the token budget holds (at least one)."""
        bm, budget = self.block_manager, self.config.max_num_batched_tokens
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.first()
            new_tokens = seq.num_tokens - bm.cached_prefix_tokens(seq)
            if (new_tokens > budget and admitted) or not self._can_admit(seq):
                break
            self._admit(seq)
            bm.schedule_chunk(seq, new_tokens)
            budget -= new_tokens
            admitted.append(seq)
        return ScheduledBatch(admitted, is_prefill=True) if admitted else None

    def _chunk_tokens(self, budget: int, cached: int) -> int:
        """The most tokens of a chunk after ``cached`` tokens whose cost (``_chunk_cost``) fits
        ``budget``; at least one, so that a prompt deep into a long context still advances."""
        span = self.config.prefill_attention_span
        if not span:
            return budget
        # n * (1 + (cached + n / 2) / span) <= budget, solved for n.
        a = 1.0 + cached / span
        n = int(span * (math.sqrt(a * a + 2.0 * budget / span) - a))
        while n > 1 and self._chunk_cost(n, cached) > budget:  # rounding
            n -= 1
        return max(1, min(n, budget))

    def _chunk_cost(self, n: int, cached: int) -> int:
        """What a chunk of ``n`` tokens after ``cached`` ones costs of max_num_batched_tokens."""
        span = self.config.prefill_attention_span
        return n if not span else math.ceil(n * (1.0 + (cached + n / 2) / span))

    def _schedule_chunks(self, budget: int) -> list[Sequence]:
        """Chunked prefill: ``budget`` of prompts' chunks (each at its ``_chunk_cost``), those
        started first (oldest first), then newly admitted requests."""
        bm, chunks = self.block_manager, []
        for seq in self.running:
            if not seq.prefilling or seq.status is not SequenceStatus.RUNNING or self._compressing(seq):
                continue  # decoding, preempted by this schedule, or being compressed
            if seq.compress_prefill and needs_compression(seq, bm):
                if self.asynchronous and chunks:
                    continue  # a step with a prompt chunk compacts no prompt: this one waits a step
                if not self._plan_prefill_compression(seq):
                    continue  # its next chunk waits for room to plan the compaction
                if self.asynchronous:
                    budget = 0  # nor does a step that compacts a prompt carry another one's chunk
                    continue  # its next chunk waits for the compaction
            if budget <= 0:
                continue
            cached = seq.kv_len
            n = min(self._chunk_tokens(budget, cached), len(seq.token_ids) - seq.num_computed)
            if seq.compress_prefill:  # its blocks come chunk by chunk
                n = min(n, bm.room(seq))
                if n <= 0:
                    continue  # waits for blocks
                bm.extend(seq, n)
            bm.schedule_chunk(seq, n)
            chunks.append(seq)
            budget -= self._chunk_cost(n, cached)
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.first()
            if seq.compress_prefill:
                # Blocks for its first chunk only; it needs a slot to compress between chunks.
                if seq.num_pending or not self.free_query_slots:
                    break
                start = bm.cached_prefix_tokens(seq)
                n = min(self._chunk_tokens(budget, start), len(seq.token_ids) - start,
                        bm.allocatable_tokens(seq) - start)
                if n <= 0:
                    break
                self._admit(seq, start + n)
            elif self._can_admit(seq):
                self._admit(seq)
                start = seq.num_computed
                n = min(self._chunk_tokens(budget, start), len(seq.token_ids) - start)
            else:
                break
            bm.schedule_chunk(seq, n)
            chunks.append(seq)
            budget -= self._chunk_cost(n, start)
        return chunks

    def _unblock_prompts(self, batch: ScheduledBatch) -> list[Sequence]:
        """Nothing could run: when prompts compressed between chunks hold every block, each
        below its budget and at a block boundary (so neither compressing nor another chunk
        frees or finds room), the newest of them is preempted and the others go on."""
        if self.compressions is not None and self.compressions.busy:
            return []  # the compaction in flight frees blocks
        stuck = [s for s in self.running if s.prefilling and s.compress_prefill and not self._compressing(s)]
        if len(stuck) < 2:
            return []
        self.preempt(stuck[-1])
        batch.preempted.append(stuck[-1])
        return self._schedule_chunks(self.config.max_num_batched_tokens)

    def _joins_compression_batch(self, seq: Sequence) -> bool:
        """Whether ``seq``'s compaction may be planned now: asynchronously, one batch is in flight
        at a time, and the batch being formed stays within ``max_blocks_per_compression`` source
        blocks (a lone request always fits)."""
        if not self.asynchronous:
            return True
        if self.compressions.busy:
            return False
        planned = sum(len(task.source_blocks) for task in self.compressions.planned)
        return not planned or planned + len(seq.block_table) <= self.compression.max_blocks_per_compression

    def _plan_prefill_compression(self, seq: Sequence) -> bool:
        """Plan the compaction of a prompt between two chunks, as decoding requests are planned
        (without preempting others for its targets); False if it must wait."""
        if not self._joins_compression_batch(seq) or not self.block_manager.can_compact(seq, seq.max_blocks - 1):
            return False
        self.compressions.plan(seq)
        return True

    # -- decode ---------------------------------------------------------------
    def _compressing(self, seq: Sequence) -> bool:
        return self.compressions is not None and self.compressions.is_compressing(seq)

    def _victim(self, last_resort: bool, placed: set[Sequence]) -> Sequence | None:
        """The request to preempt: the newest that may be recomputed and is not in the step."""
        for seq in reversed(self.running):
            if seq in placed or self._compressing(seq) or seq.num_tokens > self.max_recompute_tokens:
                continue  # already in this step, its blocks are being compacted, or never readmittable
            if self.compression is not None and self.hybrid and seq.query_slot is not None and not last_resort:
                continue  # slot holders are the ones the budget is reserved for
            return seq
        return None

    def _schedule_decode(self, last_resort: bool = False) -> ScheduledBatch:
        bm, compression, compressions = self.block_manager, self.compression, self.compressions
        batch, preempted = [], []
        placed: set[Sequence] = set()  # in this step's batch: never a victim

        def make_room(seq, has_room) -> bool:
            """Preempt until ``has_room()``; False if ``seq`` must wait (or was itself preempted)."""
            while not has_room():
                victim = self._victim(last_resort, placed)
                if victim is None:
                    return False  # restricted mode: wait for blocks to come back
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    return False
            return True

        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.prefilling or self._compressing(seq):
                continue  # preempted earlier in this loop, still prefilling, or being compressed
            if compression is not None and needs_compression(seq, bm):
                if seq.query_slot is None:
                    continue  # a guard: without a slot a request stops before this point
                if not self._joins_compression_batch(seq):
                    continue  # waits for the next compression batch
                if not make_room(seq, lambda: bm.can_compact(seq, seq.max_blocks - 1)):
                    continue
                compressions.plan(seq)
                if self.asynchronous:
                    continue  # rejoins decoding once its compaction is done
            elif compression is not None and seq.query_slot is None and not self._may_run_without_slot(seq, seq.kv_len):
                continue  # its next token is in a compression window: waits for a slot
            if make_room(seq, lambda: bm.can_append(seq)):
                bm.append_slot(seq)
                seq.chunk = None  # it decodes in this step
                batch.append(seq)
                placed.add(seq)
        tasks = compressions.planned if compressions is not None else []
        return ScheduledBatch(batch, is_prefill=False, preempted=preempted, compressions=tasks)

    # -- lifecycle ------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it first in line; it is recomputed on readmission."""
        assert not self._compressing(seq), f"{seq} is being compressed"
        if self.compressions is not None and not self.asynchronous:
            self.compressions.drop(seq)  # a planned synchronous compaction of its blocks must not run
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._release_query_slot(seq)
        seq.num_scored_tokens = 0  # recomputed from its tokens: no history survives
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.released.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Mark ``seq`` finished and release its blocks (running or waiting)."""
        assert not self._compressing(seq), f"{seq} is being compressed"
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
        self.released.append(seq)

    def take_released(self) -> list[Sequence]:
        """The requests preempted or finished since the last call (their per-request state elsewhere may go)."""
        released, self.released = self.released, []
        return released
