"""Hybrid scheduling of Compressed PagedAttention, driven by a fake engine (no model).

``HybridEngine.step`` mirrors ``LLMEngine.step`` minus the model: collect a finished
asynchronous compression batch (through the scheduler's ``Compressions``, for which
the harness is the runner), ``schedule()``, and
when that yields nothing while a batch is in flight wait for it and schedule
again; launch the step's compressions (asynchronous: remembered as the in-flight
batch, done after a number of steps the test picks; synchronous: applied at once),
"run" the forward, then set ``kv_len``, register full blocks, append the sampled
token and finish requests at ``max_tokens``.

The simulated runner keeps:

- a KV store: every cache slot holds what the forward wrote there. An entry of a
  request whose cache is a token prefix is ``("tok", position, prefix)``: the same
  in every request with that prefix, which is what the prefix cache may share.
  After a compaction a request's new tokens see a compressed history, so they are
  written as ``("ctok", request, incarnation, position, token)``: never shareable.
  A compaction keeps a deterministic subset of a request's entries; it reads its
  source blocks when it is launched and writes the targets when it completes, and
  nothing else may write those blocks (or hand them out) in between;
- the query cache: ring row ``slot * window + position % window`` holds the query
  of (request, incarnation, position) written by a slot holder's forward. Every
  compaction must find its whole window there, from launch to completion.

Every step checks the scheduler's rules (see ``zipage/engine/scheduler.py``) and
the block accounting against this simulation.
"""

from __future__ import annotations

import itertools
import os
import random
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zipage.compression.planner import needs_compression
from zipage.config import CompressionConfig, SchedulerConfig
from zipage.engine.block_manager import BlockManager, chain_hash
from zipage.engine.scheduler import Scheduler
from zipage.engine.sequence import Sequence, SequenceStatus
from zipage.sampling_params import SamplingParams

# random workloads of the hybrid-scheduling property test (ZIPAGE_PROPERTY_EXAMPLES for a longer run)
EXAMPLES = int(os.environ.get("ZIPAGE_PROPERTY_EXAMPLES", "0")) or 500


def fake_token(request_id: str, position: int, vocab: int = 3) -> int:
    """The fake model's output at ``position``: a fixed function of the request and position."""
    return (sum(map(ord, request_id)) * 7 + position * 5 + position * position) % vocab


class CheckedBlockManager(BlockManager):
    """A ``BlockManager`` that checks every block it hands out fresh (allocate, append, targets)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.referenced = Counter  # set by the engine: references it knows of, independently of ref_counts

    def _take_free_block(self) -> int:
        block_id = next(iter(self.free_blocks))  # the block the pool hands out next
        assert self.ref_counts[block_id] == 0, f"block {block_id} is referenced but in the free pool"
        assert block_id not in self.referenced(), f"block {block_id} is handed out while still in use"
        taken = super()._take_free_block()
        assert taken == block_id
        return taken


class NoProgress(AssertionError):
    """``schedule()`` returned None with work left and no compression in flight (the engine raises)."""


class HybridEngine:
    def __init__(self, *, num_blocks: int, block_size: int, max_blocks_per_seq: int, window: int,
                 max_num_seqs: int, num_query_slots: int | None = None, hybrid: bool = True,
                 asynchronous: bool = True, prefix_caching: bool = True, max_model_len: int = 1024,
                 max_num_batched_tokens: int | None = None, max_blocks_per_compression: int = 600,
                 delays=(0,)):
        comp = CompressionConfig(max_blocks_per_seq=max_blocks_per_seq, window=window, hybrid=hybrid,
                                 asynchronous=asynchronous, max_blocks_per_compression=max_blocks_per_compression)
        comp.resolve(block_size)
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, enable_chunked_prefill=False,
                                 max_num_batched_tokens=max_num_batched_tokens)
        config.resolve(max_model_len)
        # Without hybrid scheduling every running request holds a slot (as the engine sizes it).
        # As the engine sizes it: M slots, at most max_num_seqs (hybrid or not).
        self.M = min(num_query_slots, max_num_seqs) if num_query_slots is not None else max_num_seqs
        self.config, self.comp = config, comp
        self.bs, self.N, self.w = block_size, max_blocks_per_seq, window
        self.hybrid, self.asynchronous = hybrid, asynchronous
        self.slotless_limit = comp.slotless_limit(block_size)
        self.bm = CheckedBlockManager(num_blocks, block_size, prefix_caching, min_recomputed_tokens=window)
        self.bm.referenced = self._referenced
        self.sched = Scheduler(config, self.bm, comp, num_query_slots=self.M)
        self.delays = list(delays)
        self.num_launches = 0
        self.step_no = 0
        self.store = {b: [None] * block_size for b in range(num_blocks)}  # simulated KV cache
        self.qcache: dict[tuple[int, int], tuple] = {}  # (slot, ring row) -> (request, incarnation, position)
        self.expect: dict[str, list | None] = {}  # what each request's cache holds (None: being compacted)
        self.in_flight = None  # the asynchronous compression batch: dict, see _launch
        self.requests: dict[str, Sequence] = {}
        self.finished: list[Sequence] = []
        self.log = []  # one entry per step: (kind, request ids run, preempted ids, compressed ids)
        self.stats = Counter()
        self._hash_memo: dict[tuple, int] = {}

    # -- requests ---------------------------------------------------------
    def add(self, request_id: str, prompt, max_tokens: int) -> Sequence:
        assert 1 <= len(prompt) and len(prompt) + max_tokens <= self.config.max_model_len
        seq = Sequence(request_id, None, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                       max_tokens, seed=0)
        self.requests[request_id] = seq
        self.expect[request_id] = []
        self.sched.add(seq)
        return seq

    # -- helpers ------------------------------------------------------------
    def _referenced(self) -> Counter:
        refs = Counter()
        for seq in self.sched.running:
            refs.update(seq.block_table)
        if self.in_flight is not None:
            for task in self.in_flight["tasks"]:
                refs.update(task.pending_release)
        return refs

    @staticmethod
    def _inc(seq: Sequence) -> int:
        return seq.metrics.num_preemptions  # incarnation: a recomputed request starts afresh

    def _entry(self, seq: Sequence, position: int):
        if seq.kv_is_token_prefix:
            return ("tok", position, tuple(seq.token_ids[:position + 1]))
        return ("ctok", seq.request_id, self._inc(seq), position, seq.token_ids[position])

    def _compressing(self, seq: Sequence) -> bool:
        return self.sched.compressions.is_compressing(seq)

    def _in_flight_seqs(self) -> set[int]:
        return {id(t.seq) for t in self.in_flight["tasks"]} if self.in_flight is not None else set()

    # -- the loop ---------------------------------------------------------
    def step(self):
        """One engine step; returns the batch (None when idle)."""
        self.step_no += 1
        self._collect(wait=False)
        batch = self._schedule()
        if batch is None and self.in_flight is not None:
            self._collect(wait=True)  # nothing else can run until the compaction is done
            self.stats["waited"] += 1
            batch = self._schedule()
        if batch is None:
            if self.sched.has_unfinished():
                raise NoProgress(f"scheduler made no progress: running={self.sched.running}, "
                                 f"waiting={list(self.sched.waiting)}, free={self.bm.num_free_blocks}")
            return None
        if batch.compressions:
            self._launch(batch.compressions)
        self._forward(batch)
        sched, bm = self.sched, self.bm
        for seq in batch.seqs:  # LLMEngine.step's order
            bm.cache_step(seq)
            seq.token_ids.append(fake_token(seq.request_id, seq.num_tokens))
            bm.register_computed(seq, len(seq.token_ids) - 1)
            if seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq, "length")
                self.expect[seq.request_id] = []
                self.finished.append(seq)
        self.log.append(("prefill" if batch.is_prefill else "decode", [s.request_id for s in batch.seqs],
                         [s.request_id for s in batch.preempted], [t.seq.request_id for t in batch.compressions]))
        self.check_state()
        return batch

    def run(self, arrivals=(), max_steps: int = 10_000):
        """Step until done; ``arrivals`` = [(step, request_id, prompt, max_tokens)] added before that step."""
        pending = sorted(arrivals, key=lambda a: a[0])
        for step in itertools.count():
            while pending and pending[0][0] <= step:
                self.add(*pending.pop(0)[1:])
            if not self.sched.has_unfinished():
                assert self.in_flight is None
                if not pending:
                    break
                continue
            assert step < max_steps, f"no progress after {step} steps"
            self.step()
        return self

    # -- scheduling, with the checks of its rules ----------------------------
    def _schedule(self):
        sched, bm = self.sched, self.bm
        pre_running, pre_waiting = list(sched.running), list(sched.waiting)
        pre = {id(s): SimpleNamespace(kv_len=s.kv_len, table=list(s.block_table), slot=s.query_slot,
                                      needs=needs_compression(s, bm), num_tokens=s.num_tokens)
               for s in pre_running}
        in_flight = self._in_flight_seqs()
        assert sched.compressions.busy == (self.in_flight is not None)
        batch = sched.schedule()
        self._check_slots(after_schedule=True)
        for seq in sched.running:  # a compressing request stays running
            assert id(seq) not in in_flight or self._compressing(seq)
        # Preemptions, also those of a step that ends up with nothing to run (schedule() returns None).
        preempted = [s for s in pre_running if s.status is SequenceStatus.WAITING]
        if batch is not None:
            assert sorted(map(id, batch.preempted)) == sorted(map(id, preempted))
            preempted = batch.preempted
        seqs = batch.seqs if batch is not None else []
        for seq in preempted:
            assert id(seq) not in in_flight and not self._compressing(seq), f"{seq} preempted while being compressed"
            assert seq not in seqs and seq in sched.waiting
            assert len(seq.block_table) == 0 and seq.kv_len == 0 and seq.query_slot is None
            last_resort = self.hybrid and pre[id(seq)].slot is not None
            if last_resort:  # a slot holder goes only when otherwise no request could move this step
                assert batch is None or not [s for s in batch.seqs if s is not seq and pre[id(s)].slot is None]
            assert pre[id(seq)].num_tokens <= sched.max_recompute_tokens, f"{seq} cannot be recomputed"
            # The victim is the newest request that may go: every newer one still running may not.
            for newer in pre_running[pre_running.index(seq) + 1:]:
                if newer.status is SequenceStatus.RUNNING:
                    assert (self._compressing(newer) or newer.num_tokens > sched.max_recompute_tokens
                            or (self.hybrid and newer.query_slot is not None and not last_resort)), \
                        f"preempted {seq} although {newer} is newer"
            self.expect[seq.request_id] = []
            self.stats["preempted"] += 1
        if batch is None:
            return None
        assert len({id(s) for s in seqs}) == len(seqs), "a sequence twice in one batch"
        assert len(sched.running) <= self.config.max_num_seqs
        for seq in seqs:
            assert seq.status is SequenceStatus.RUNNING and seq in sched.running
            assert not self._compressing(seq) and id(seq) not in in_flight, f"{seq} runs while being compressed"
        if batch.is_prefill:
            n = len(seqs)
            assert seqs == pre_waiting[:n], "admission is first come, first served"
            assert not batch.preempted and not batch.compressions
            slotless_seen = False
            for seq in seqs:
                assert seq.kv_len == seq.num_prefix_hit_tokens and len(seq.block_table) == -(-seq.num_tokens // self.bs)
                if seq.query_slot is None:
                    # Admitted without a free slot: only if it can decode without one.
                    assert self.hybrid and seq.num_tokens < self.slotless_limit, f"{seq} admitted without a slot"
                    slotless_seen = True
                    self.stats["admitted slotless"] += 1
                else:
                    assert not slotless_seen, "a slot was free but an earlier admission got none"
            return batch
        # -- decode --
        assert all(s in pre for s in map(id, seqs))
        order = {id(s): i for i, s in enumerate(pre_running)}
        assert [order[id(s)] for s in seqs] == sorted(order[id(s)] for s in seqs)
        for seq in seqs:
            assert len(seq.block_table) <= self.N, f"{seq} decodes with more than N={self.N} blocks"
            assert seq.kv_len < len(seq.block_table) * self.bs, f"{seq} has no slot for its next token"
            if seq.query_slot is None:
                assert seq.kv_len < self.slotless_limit
        planned = {id(t.seq) for t in batch.compressions}
        for seq in pre_running:
            if pre[id(seq)].needs and id(seq) not in planned:
                assert seq not in seqs, f"{seq} decodes although it needed compression"
            if (seq.status is SequenceStatus.RUNNING and seq not in seqs and id(seq) not in planned
                    and id(seq) not in in_flight):
                self.stats["slot holder waited" if seq.query_slot is not None else "slotless waited"] += 1
        if batch.compressions:
            assert not in_flight, "a second compression batch while one is in flight"
            if self.asynchronous:
                blocks = sum(len(t.source_blocks) for t in batch.compressions)
                assert blocks <= self.comp.max_blocks_per_compression or len(batch.compressions) == 1, \
                    f"the batch reads {blocks} blocks > max_blocks_per_compression (and is not one request)"
        for task in batch.compressions:
            seq, info = task.seq, pre[id(task.seq)]
            assert info.needs and seq.status is SequenceStatus.RUNNING and seq in sched.running
            assert seq.query_slot is not None and info.slot == seq.query_slot
            assert task.source_blocks == info.table and task.num_tokens == info.kv_len
            assert task.keep == self.comp.kv_budget_tokens == (self.N - 1) * self.bs
            assert len(task.target_blocks) == self.N - 1 and seq.kv_len == task.keep
            # plus the working block of a synchronously compressed request decoding in this step
            assert list(seq.block_table) == task.target_blocks + list(seq.block_table)[self.N - 1:]
            assert len(seq.block_table) == self.N - 1 + (seq in seqs)
            assert not seq.kv_is_token_prefix
            assert task.last_position == seq.num_tokens - 2
            if self.asynchronous:
                assert self._compressing(seq) and seq not in seqs
                assert task.pending_release == [b for b in task.source_blocks if b not in task.target_blocks]
            else:
                assert not self._compressing(seq) and task.pending_release == []
        return batch

    def _check_slots(self, after_schedule: bool) -> None:
        sched = self.sched
        held = [s.query_slot for s in sched.running if s.query_slot is not None]
        assert len(set(held)) == len(held), "two requests hold one query slot"
        assert sorted(held + sched.free_query_slots) == list(range(self.M)), "query slots leaked"
        for seq in sched.waiting:
            assert seq.query_slot is None and not self._compressing(seq)
        slotless = [s for s in sched.running if s.query_slot is None]
        if not self.hybrid:
            assert not slotless, "without hybrid scheduling every running request holds a slot"
        if after_schedule and slotless:
            assert not sched.free_query_slots, "a free slot was not handed to a running request"
        # Slots go out in admission order: the slot holders come first in the running list.
        seen_slotless = False
        for seq in sched.running:
            if seq.query_slot is None:
                seen_slotless = True
            else:
                assert not seen_slotless, f"{seq} holds a slot that an older running request lacks"

    # -- the simulated runner --------------------------------------------
    def _write(self, seq: Sequence, index: int, entry, prefill_batch=()) -> None:
        bm = self.bm
        block = seq.block_table[index // self.bs]
        if seq.query_slot is None:
            assert index < self.slotless_limit, \
                f"{seq} caches index {index} without a query slot (limit {self.slotless_limit})"
        if self.in_flight is not None:
            assert block not in self.in_flight["blocks"], f"{seq} writes block {block} of an in-flight compaction"
        if bm.ref_counts[block] > 1:  # only blocks this prefill computes may already be shared (same batch)
            sharers = [s for s in self.sched.running if block in list(s.block_table)]
            assert all(s in prefill_batch for s in sharers), f"{seq} writes shared block {block}"
        self.store[block][index % self.bs] = entry

    def _save_query(self, seq: Sequence, position: int) -> None:
        if seq.query_slot is None:
            return
        if self.in_flight is not None:
            assert seq.query_slot not in self.in_flight["slots"], \
                "a window query of an in-flight compaction is overwritten"
        self.qcache[(seq.query_slot, position % self.w)] = (seq.request_id, self._inc(seq), position)

    def _forward(self, batch) -> None:
        # As in a forward: every layer stores the whole step's KV before attention reads it.
        for seq in batch.seqs:
            rid = seq.request_id
            if batch.is_prefill:
                start, end = seq.num_prefix_hit_tokens, seq.num_tokens
                assert start % self.bs == 0 and start <= max(0, end - self.w), "the window must be recomputed"
                for pos in range(start, end):
                    self._write(seq, pos, self._entry(seq, pos), batch.seqs)
                for pos in range(max(start, end - self.w), end):
                    self._save_query(seq, pos)
                self.expect[rid] = [self._entry(seq, pos) for pos in range(end)]
                if start:
                    self.stats["prefix hits"] += 1
            else:
                assert len(self.expect[rid]) == seq.kv_len
                pos = seq.num_tokens - 1
                entry = self._entry(seq, pos)
                self._write(seq, seq.kv_len, entry)
                self._save_query(seq, pos)
                self.expect[rid].append(entry)
                if seq.query_slot is None:
                    self.stats["slotless decodes"] += 1
        if batch.is_prefill:
            for seq in batch.seqs:  # the prefix cache served (and the batch computed) the real content
                self._check_kv(seq, seq.num_tokens)

    def _window_ok(self, task) -> None:
        seq = task.seq
        for i in range(self.w):
            p = task.last_position - self.w + 1 + i
            got = self.qcache.get((seq.query_slot, p % self.w))
            assert got == (seq.request_id, self._inc(seq), p), \
                f"{seq}: the query of position {p} is not in its slot (found {got})"

    def _launch(self, tasks) -> None:
        """``LLMEngine``'s launch: through the scheduler's ``Compressions``, with this harness as runner."""
        assert self.sched.compressions.planned == list(tasks)
        self.sched.compressions.launch(self)

    def _read_sources(self, tasks) -> list:
        """Read every source now (the compaction runs after all work already queued)."""
        bs = self.bs
        reads = []
        for i, task in enumerate(tasks):
            seq, rid = task.seq, task.seq.request_id
            self._window_ok(task)
            old = [self.store[task.source_blocks[j // bs]][j % bs] for j in range(task.num_tokens)]
            assert old == self.expect[rid], f"{seq}: the compaction reads other content than its cache"
            rng = random.Random(f"{rid}/{self._inc(seq)}/{seq.metrics.num_compressions}")
            kept = [old[j] for j in sorted(rng.sample(range(task.num_tokens), task.keep))]
            reads.append((task, old, kept))
            self.expect[rid] = None
            # A later task may take a block this one released as a fresh target (this one has read
            # it first), never the other way round.
            for later in tasks[i + 1:]:
                assert not set(task.target_blocks) & set(later.source_blocks)
        self.stats["compressions"] += len(tasks)
        return reads

    # the runner methods ``Compressions`` calls
    def compress(self, tasks) -> None:
        assert not self.asynchronous
        self._commit(self._read_sources(tasks))

    def start_compression(self, tasks):
        assert self.asynchronous and self.in_flight is None
        reads = self._read_sources(tasks)
        delay = self.delays[self.num_launches % len(self.delays)]
        self.num_launches += 1
        blocks = set()
        for task in tasks:
            blocks.update(task.source_blocks)
            blocks.update(task.target_blocks)
        self.in_flight = dict(tasks=list(tasks), reads=reads, launched=self.step_no, delay=delay, blocks=blocks,
                              slots={t.seq.query_slot for t in tasks})
        return self.in_flight

    def compression_done(self, handle, wait: bool = False) -> bool:
        assert handle is self.in_flight
        if not wait and self.step_no - handle["launched"] - 1 < handle["delay"]:
            return False
        self._commit(handle["reads"])
        self.in_flight = None  # the compaction is done: its sources may be written from now on
        return True

    def _commit(self, reads) -> None:
        bs = self.bs
        for task, old, _ in reads:  # nothing wrote the sources (nor the window queries) meanwhile
            self._window_ok(task)
            assert [self.store[task.source_blocks[j // bs]][j % bs] for j in range(task.num_tokens)] == old
        for task, _, kept in reads:
            for j, entry in enumerate(kept):
                self.store[task.target_blocks[j // bs]][j % bs] = entry
            self.expect[task.seq.request_id] = list(kept)

    def _collect(self, wait: bool) -> None:
        """``LLMEngine._poll_compressions``: finish the in-flight batch if it is done (or wait for it)."""
        flight = self.in_flight
        if flight is None:
            return
        tasks = flight["tasks"]
        for task in tasks:
            assert self._compressing(task.seq) and task.seq.status is SequenceStatus.RUNNING
            assert list(task.seq.block_table) == task.target_blocks and task.seq.kv_len == task.keep
        refs_before = list(self.bm.ref_counts)
        if not self.sched.compressions.poll(self, wait):
            assert not wait and self.in_flight is flight
            return
        assert self.in_flight is None
        released = Counter(b for t in tasks for b in t.pending_release)
        reused = Counter()  # a private pending block may become the request's next working block
        for task in tasks:
            table = list(task.seq.block_table)
            if len(table) > len(task.target_blocks):
                assert len(table) == len(task.target_blocks) + 1 and table[-1] in task.pending_release
                # (it may have been shared with another task of the batch, which released it first)
                assert self.bm.ref_counts[table[-1]] == 1 and task.seq.kv_len == len(task.target_blocks) * self.bs
                reused[table[-1]] += 1
        for b in range(self.bm.num_blocks):
            assert self.bm.ref_counts[b] == refs_before[b] - released[b] + reused[b]
        for task in tasks:
            assert not self._compressing(task.seq)
            assert task.seq.num_scored_tokens == task.keep  # the counters change once it is done
        assert not self.sched.compressions.busy

    # -- checks -------------------------------------------------------------
    def _check_kv(self, seq: Sequence, upto: int) -> None:
        bs = self.bs
        expect = self.expect[seq.request_id]
        assert len(expect) == upto
        for pos in range(upto):
            got = self.store[seq.block_table[pos // bs]][pos % bs]
            assert got == expect[pos], f"{seq}: wrong KV at cache index {pos}: {got} != {expect[pos]}"

    def _prefix_hash(self, tokens: tuple, num_blocks: int) -> int:
        key = tokens[:num_blocks * self.bs]
        h = self._hash_memo.get(key)
        if h is None:
            prev = None if num_blocks == 1 else self._prefix_hash(tokens, num_blocks - 1)
            h = chain_hash(prev, list(key[(num_blocks - 1) * self.bs:]))
            self._hash_memo[key] = h
        return h

    def check_state(self) -> None:
        bm, sched, bs = self.bm, self.sched, self.bs
        running, waiting = sched.running, list(sched.waiting)
        assert not {id(s) for s in running} & {id(s) for s in waiting}
        assert len({id(s) for s in running}) == len(running) and len({id(s) for s in waiting}) == len(waiting)
        in_flight = self._in_flight_seqs()
        assert sched.compressions.busy == (self.in_flight is not None)
        holders = Counter()
        for seq in running:
            assert seq.status is SequenceStatus.RUNNING
            table = list(seq.block_table)
            assert len(set(table)) == len(table)
            holders.update(table)
            assert self._compressing(seq) == (id(seq) in in_flight)
            assert seq.kv_len <= seq.num_tokens - 1 and len(table) * bs >= seq.kv_len
            if seq.kv_is_token_prefix:
                assert seq.kv_len == seq.num_tokens - 1
            else:  # compacted: none of its blocks may be (or become) a prefix-cache entry
                assert seq.num_registered_blocks == 0
                assert all(bm.block_hash[b] is None for b in table), f"{seq} holds a registered block"
            if seq.query_slot is None:
                assert seq.kv_len <= self.slotless_limit
            if self._compressing(seq):
                assert self.expect[seq.request_id] is None
            else:
                assert len(table) <= max(self.N, -(-seq.num_tokens // bs))
                self._check_kv(seq, seq.kv_len)
        for seq in waiting:
            assert seq.status is SequenceStatus.WAITING and len(seq.block_table) == 0 and seq.kv_len == 0
        for seq in self.finished:
            assert seq.status is SequenceStatus.FINISHED and len(seq.block_table) == 0
            assert seq.query_slot is None and not self._compressing(seq)
        if self.in_flight is not None:
            for task in self.in_flight["tasks"]:
                holders.update(task.pending_release)
        assert bm.ref_counts == [holders[b] for b in range(bm.num_blocks)], \
            "ref counts differ from the block tables plus the in-flight compactions' pending releases"
        assert set(bm.free_blocks) == {b for b in range(bm.num_blocks) if holders[b] == 0}
        self._check_slots(after_schedule=False)
        # The prefix cache: every registered block holds the token-prefix KV its hash names.
        assert sum(h is not None for h in bm.block_hash) == len(bm.hash_to_block)
        for h, b in bm.hash_to_block.items():
            assert bm.block_hash[b] == h
            entries = self.store[b]
            last = entries[-1]
            assert last is not None and last[0] == "tok", f"registered block {b} holds {last}"
            _, pos, prefix = last
            index = pos // bs
            assert pos % bs == bs - 1
            for o, entry in enumerate(entries):
                assert entry == ("tok", index * bs + o, prefix[:index * bs + o + 1]), \
                    f"registered block {b} holds {entry}"
            assert self._prefix_hash(prefix, index + 1) == h, f"block {b} is registered under another prefix"

    def check_done(self) -> None:
        sched, bm = self.sched, self.bm
        assert not sched.has_unfinished() and self.in_flight is None and not sched.compressions.busy
        assert len(self.finished) == len(self.requests)
        for rid, seq in self.requests.items():
            assert seq.is_finished and seq.finish_reason == "length"
            expected = [fake_token(rid, seq.num_prompt_tokens + i) for i in range(seq.max_tokens)]
            assert seq.output_token_ids == expected, f"request {rid}"
        assert bm.num_free_blocks == bm.num_blocks and bm.ref_counts == [0] * bm.num_blocks
        assert sorted(sched.free_query_slots) == list(range(self.M))
        assert sched.schedule() is None


# -- (a) a slotless request decodes up to its limit, then waits for a slot ----------------------
@pytest.mark.parametrize("asynchronous", [False, True])
def test_slotless_request_waits_at_its_limit_for_a_slot(asynchronous):
    # N=3 blocks of 4, window 2: a request without a slot may cache indices < 3 * 4 - 2 = 10.
    eng = HybridEngine(num_blocks=16, block_size=4, max_blocks_per_seq=3, window=2, max_num_seqs=2,
                       num_query_slots=1, asynchronous=asynchronous)
    a = eng.add("A", [1, 2, 3], 14)
    b = eng.add("B", [2, 2, 1], 20)
    batch = eng.step()
    assert batch.is_prefill and batch.seqs == [a, b]
    assert a.query_slot == 0 and b.query_slot is None
    limit = eng.slotless_limit
    assert limit == 10
    b_decodes = []
    while b.query_slot is None:
        batch = eng.step()
        if b in batch.seqs:
            b_decodes.append(b.kv_len)  # cached tokens after the step
        if a.is_finished:
            break
    # B decoded (one cached token per step) until its cache reached the limit, then waited.
    assert b_decodes == list(range(4, limit + 1))
    assert b.kv_len == limit and b.metrics.num_compressions == 0
    waiting_steps = [entry for entry in eng.log if entry[0] == "decode" and "B" not in entry[1]]
    assert waiting_steps, "B should have waited for a slot"
    assert a.is_finished and b.query_slot is None  # A's slot goes to B at the next schedule
    batch = eng.step()
    assert b.query_slot == 0 and b in batch.seqs and b.kv_len == limit + 1
    eng.run()
    eng.check_done()
    assert b.metrics.num_compressions > 0 and eng.sched.num_preemptions == 0


# -- (b) admission without a free slot ------------------------------------------------------------
def test_admission_without_a_free_slot_needs_a_prompt_before_the_window():
    eng = HybridEngine(num_blocks=32, block_size=4, max_blocks_per_seq=3, window=3, max_num_seqs=4,
                       num_query_slots=1)
    limit = eng.slotless_limit  # 12 - 3 = 9
    a = eng.add("A", [0] * 5, 30)
    eng.step()
    assert a.query_slot == 0 and not eng.sched.free_query_slots
    long = eng.add("L", [1] * limit, 4)  # num_tokens == limit: its first decode would cache index 9
    short = eng.add("S", [2] * (limit - 1), 4)
    batch = eng.step()
    assert not batch.is_prefill and batch.seqs == [a], "a prompt reaching into the window needs a slot"
    assert list(eng.sched.waiting) == [long, short], "first come, first served: S waits behind L"
    # A prompt one token shorter is admitted without a slot.
    eng2 = HybridEngine(num_blocks=32, block_size=4, max_blocks_per_seq=3, window=3, max_num_seqs=4,
                        num_query_slots=1)
    a2 = eng2.add("A", [0] * 5, 30)
    eng2.step()
    short2 = eng2.add("S", [2] * (limit - 1), 4)
    batch = eng2.step()
    assert batch.is_prefill and batch.seqs == [short2] and short2.query_slot is None
    assert a2.query_slot == 0
    eng2.run()
    eng2.check_done()
    eng.run()  # L gets A's slot once A finishes, then S follows
    eng.check_done()
    assert long.metrics.first_scheduled_time > a.metrics.first_scheduled_time


def test_admission_refuses_a_long_prompt_until_a_slot_frees():
    eng = HybridEngine(num_blocks=32, block_size=4, max_blocks_per_seq=2, window=2, max_num_seqs=3,
                       num_query_slots=1, asynchronous=False)
    a = eng.add("A", [5, 6], 3)
    eng.step()
    long = eng.add("L", list(range(3)) * 4, 2)  # 12 tokens > N * block_size: compressed at once
    while not a.is_finished:
        batch = eng.step()
        assert long not in batch.seqs
    batch = eng.step()
    assert batch.is_prefill and batch.seqs == [long] and long.query_slot == 0
    batch = eng.step()
    assert [t.seq for t in batch.compressions] == [long] and batch.seqs == [long]
    eng.run()
    eng.check_done()


# -- (c) preemption victims and restricted mode -------------------------------------------------------
def test_preemption_takes_the_newest_slotless_request():
    # N=3 blocks of 4, window 4: a slotless request may cache indices < 8.
    eng = HybridEngine(num_blocks=5, block_size=4, max_blocks_per_seq=3, window=4, max_num_seqs=4,
                       num_query_slots=1, asynchronous=False, prefix_caching=False)
    s = eng.add("S", [0, 1, 2, 0, 1, 2, 0, 1], 8)  # slot holder: two full blocks, its next token needs a third
    x = eng.add("X", [1, 1, 1], 4)  # slotless, one block each, room for one more token
    y = eng.add("Y", [2, 2, 2], 4)
    z = eng.add("Z", [0, 0, 0], 4)
    batch = eng.step()
    assert batch.seqs == [s, x, y, z] and s.query_slot == 0
    assert (x.query_slot, y.query_slot, z.query_slot) == (None, None, None)
    assert eng.bm.num_free_blocks == 0
    batch = eng.step()
    # S needs a block: the newest slotless request (Z) goes; X and Y decode inside their block.
    assert batch.preempted == [z] and batch.seqs == [s, x, y]
    assert list(eng.sched.waiting) == [z] and z.metrics.num_preemptions == 1
    batch = eng.step()
    # X needs a block (Z's went to S): Y, the newest slotless request, makes room; never S.
    assert batch.preempted == [y] and batch.seqs == [s, x]
    assert list(eng.sched.waiting) == [y, z], "a victim goes first in line"
    eng.run()
    eng.check_done()
    assert s.metrics.num_preemptions == 0


@pytest.mark.parametrize("hybrid", [True, False])
def test_restricted_mode_never_preempts_a_slot_holder(hybrid):
    # Both requests hold a slot (M = max_num_seqs = 2); the pool (3 blocks) is full after the prefill.
    eng = HybridEngine(num_blocks=3, block_size=4, max_blocks_per_seq=3, window=2, max_num_seqs=2,
                       num_query_slots=2, hybrid=hybrid, asynchronous=False, prefix_caching=False)
    a = eng.add("A", [0, 1, 2, 0], 4)  # one full block: its first decode needs a second
    b = eng.add("B", [1, 2, 0, 1, 2], 3)  # two blocks, room for three more tokens
    batch = eng.step()
    assert batch.seqs == [a, b] and (a.query_slot, b.query_slot) == (0, 1) and eng.bm.num_free_blocks == 0
    batch = eng.step()
    if not hybrid:  # the newest request goes, slot or not
        assert batch.preempted == [b] and batch.seqs == [a]
        eng.run()
        eng.check_done()
        return
    # Restricted mode: A waits for a block, B (the newest, but a slot holder) is not preempted.
    assert batch.seqs == [b] and not batch.preempted and a.kv_len == 4
    batch = eng.step()
    assert batch.seqs == [b] and b.is_finished  # B's blocks come back...
    batch = eng.step()
    assert batch.seqs == [a] and a.kv_len == 5  # ... and A proceeds
    eng.run()
    eng.check_done()
    assert eng.sched.num_preemptions == 0


def test_slotless_requests_wait_at_their_limit_while_slot_holders_compress():
    eng = HybridEngine(num_blocks=6, block_size=4, max_blocks_per_seq=2, window=4, max_num_seqs=4,
                       num_query_slots=2, asynchronous=False, prefix_caching=False)
    a = eng.add("A", [0, 1, 2, 0], 10)  # slot holders with full first blocks
    b = eng.add("B", [1, 0, 2, 1], 10)
    x = eng.add("X", [1, 1], 10)  # slotless: they may cache indices < 2 * 4 - 4 = 4
    y = eng.add("Y", [2, 2], 10)
    batch = eng.step()
    assert batch.seqs == [a, b, x, y] and (a.query_slot, b.query_slot) == (0, 1)
    assert x.query_slot is None and y.query_slot is None and eng.bm.num_free_blocks == 2
    batch = eng.step()  # A and B take the two free blocks
    assert batch.seqs == [a, b, x, y] and not batch.preempted
    batch = eng.step()
    assert batch.seqs == [a, b, x, y] and x.kv_len == y.kv_len == 4  # X and Y reached their limit
    while a.kv_len < 8:
        batch = eng.step()
        assert batch.seqs == [a, b] and not batch.preempted
    batch = eng.step()  # A and B compress (keeping one block) and decode on
    assert batch.seqs == [a, b] and [t.seq for t in batch.compressions] == [a, b] and not batch.preempted
    eng.run()
    eng.check_done()
    assert eng.sched.num_preemptions == 0
    assert x.metrics.num_compressions > 0 and y.metrics.num_compressions > 0  # with A's and B's slots


def test_restricted_mode_slot_holder_proceeds_when_a_compression_releases_blocks():
    # B (older) and A are both slot holders; only they run, and the pool is empty.
    eng = HybridEngine(num_blocks=3, block_size=4, max_blocks_per_seq=2, window=2, max_num_seqs=2,
                       num_query_slots=2, asynchronous=True, prefix_caching=False, delays=(1,))
    b = eng.add("B", [1, 2, 0, 1], 3)  # one full block: its first decode needs a second
    a = eng.add("A", [2, 0, 1, 2, 0, 1, 2, 0], 3)  # N full blocks: compressed at its first decode
    batch = eng.step()
    assert batch.seqs == [b, a] and (b.query_slot, a.query_slot) == (0, 1) and eng.bm.num_free_blocks == 0
    batch = eng.step()
    # B needs a block and there is no victim (both hold slots): it waits, not preempted.
    # A's compaction is launched; the block it drops is released only when it is done.
    assert batch.seqs == [] and not batch.preempted and [t.seq for t in batch.compressions] == [a]
    assert eng._compressing(a) and b.status is SequenceStatus.RUNNING and b.kv_len == 4
    assert eng.bm.num_free_blocks == 0
    batch = eng.step()  # still running (delay 1) and nothing else can run: the engine waits for it
    assert eng.stats["waited"] == 1 and not eng._compressing(a)
    # A keeps the block its compaction released as its working block and decodes; B waits on.
    assert batch.seqs == [a] and not batch.preempted and b.kv_len == 4
    assert b.status is SequenceStatus.RUNNING and b.query_slot == 0
    eng.run()
    eng.check_done()
    assert eng.sched.num_preemptions == 0


def test_a_compressing_request_is_never_a_victim():
    # Without hybrid scheduling the newest request goes, unless it is being compressed.
    eng = HybridEngine(num_blocks=6, block_size=4, max_blocks_per_seq=3, window=2, max_num_seqs=3,
                       hybrid=False, asynchronous=True, prefix_caching=False, delays=(3,))
    d = eng.add("D", [2], 6)  # one block, room for three more tokens
    a = eng.add("A", [1, 2, 0, 1, 2], 6)  # two blocks, room for three more tokens
    c = eng.add("C", [2, 0, 1] * 4, 6)  # N full blocks: compressed at its first decode
    assert eng.step().seqs == [d, a, c] and eng.bm.num_free_blocks == 0
    batch = eng.step()
    assert batch.seqs == [d, a] and [t.seq for t in batch.compressions] == [c] and eng._compressing(c)
    for _ in range(2):
        assert eng.step().seqs == [d, a]
    # D and A need a block each: C is the newest but being compressed, so A goes (for D).
    batch = eng.step()
    assert eng._compressing(c) and batch.preempted == [a] and batch.seqs == [d]
    assert c.status is SequenceStatus.RUNNING and c.metrics.num_preemptions == 0
    eng.run()
    eng.check_done()


# -- (d) an asynchronous compaction ----------------------------------------------------------------
def test_asynchronous_compaction_skips_decodes_and_defers_release():
    eng = HybridEngine(num_blocks=16, block_size=4, max_blocks_per_seq=3, window=2, max_num_seqs=2,
                       num_query_slots=2, asynchronous=True, prefix_caching=True, delays=(2,))
    a = eng.add("A", [0, 1, 2] * 4, 6)  # 12 tokens = N full blocks
    b = eng.add("B", [2, 2, 1], 6)
    eng.step()
    sources = list(a.block_table)
    batch = eng.step()
    (task,) = batch.compressions
    assert task.seq is a and eng._compressing(a) and batch.seqs == [b] and eng.sched.compressions.busy
    assert task.source_blocks == sources and task.target_blocks == sources[:2]  # private: in place
    assert task.pending_release == sources[2:] and list(a.block_table) == sources[:2] and a.kv_len == 8
    for _ in range(2):  # delay 2: two more steps without A, its dropped block still held
        batch = eng.step()
        assert batch.seqs == [b] and not batch.compressions and eng._compressing(a)
        assert eng.bm.ref_counts[sources[2]] == 1 and sources[2] not in eng.bm.free_blocks
    batch = eng.step()  # collected before scheduling: A rejoins at once
    assert not eng._compressing(a) and not eng.sched.compressions.busy
    assert a in batch.seqs and a.kv_len == 9 and list(a.block_table)[:2] == sources[:2]
    assert sources[2] in eng.bm.free_blocks or sources[2] in list(a.block_table) + list(b.block_table)
    eng.run()
    eng.check_done()


def test_scheduler_alone_keeps_a_compressing_request_out_until_its_compaction_is_done():
    comp = CompressionConfig(max_blocks_per_seq=2, window=2, asynchronous=True)
    comp.resolve(4)
    config = SchedulerConfig(max_num_seqs=2, max_model_len=64, enable_chunked_prefill=False)
    config.resolve(64)
    bm = BlockManager(8, 4, True, min_recomputed_tokens=2)
    sched = Scheduler(config, bm, comp, num_query_slots=2)
    compressions = sched.compressions
    runner = SimpleNamespace(start_compression=lambda tasks: "handle",
                             compression_done=lambda handle, wait: handle == "handle" and wait)
    a = Sequence("A", None, [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0), 8, 0)
    b = Sequence("B", None, [3, 3], SamplingParams(temperature=0.0), 8, 0)
    sched.add(a), sched.add(b)
    batch = sched.schedule()
    for seq in batch.seqs:
        bm.cache_step(seq)
        seq.token_ids.append(0)
        bm.register_computed(seq, len(seq.token_ids) - 1)
    source = list(a.block_table)
    batch = sched.schedule()
    (task,) = batch.compressions
    assert compressions.is_compressing(a) and not compressions.busy  # planned, not launched
    assert compressions.launch(runner) == [task] and compressions.busy
    assert batch.seqs == [b] and compressions.is_compressing(a) and task.pending_release == [source[1]]
    assert a.metrics.num_compressions == 0 and a.num_scored_tokens == 0  # counted once it is done
    free_before = bm.num_free_blocks
    for _ in range(3):
        for seq in batch.seqs:
            bm.cache_step(seq)
            seq.token_ids.append(0)
        batch = sched.schedule()
        assert batch.seqs == [b] and not batch.compressions
        assert bm.ref_counts[source[1]] == 1 and source[1] not in bm.free_blocks
        assert compressions.poll(runner, wait=False) == []  # not done yet
    assert bm.num_free_blocks <= free_before
    assert compressions.poll(runner, wait=True) == [task]
    assert not compressions.is_compressing(a) and not compressions.busy
    assert a.metrics.num_compressions == 1 and a.num_scored_tokens == task.keep == 4
    # A's next token starts a block: the released source block becomes it (not back to the pool).
    assert bm.ref_counts[source[1]] == 1 and list(a.block_table) == [source[0], source[1]]
    assert source[1] not in bm.free_blocks
    batch = sched.schedule()
    assert a in batch.seqs


# -- regressions found by the property test ------------------------------------------------------
def test_long_prompt_beyond_the_compression_batch_cap_is_compressed():
    # resolve() only requires the cap to hold N blocks; a prompt of 3 blocks never fits a batch of 2.
    eng = HybridEngine(num_blocks=8, block_size=4, max_blocks_per_seq=2, window=2, max_num_seqs=1,
                       asynchronous=True, max_blocks_per_compression=2)
    eng.add("L", list(range(12)), 2)
    eng.run(max_steps=20)
    eng.check_done()


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("prompts", [
    ([0] * 9, [0] * 9),  # found by the property test with num_blocks = M * N
    ([0, 1, 2, 0, 1, 2, 0, 1, 2, 2, 2, 2], [0, 1, 2, 0, 1, 2, 0, 1, 1, 1, 1, 1]),  # a shared "system prompt"
], ids=["same-prompt", "shared-prefix"])
def test_slot_holders_sharing_a_long_prefix_make_progress(prompts, asynchronous):
    # M * N = 2 * 2 = 4 blocks: what the engine derives for two query slots (plan_cache).
    eng = HybridEngine(num_blocks=4, block_size=4, max_blocks_per_seq=2, window=1, max_num_seqs=2,
                       num_query_slots=2, asynchronous=asynchronous, prefix_caching=True)
    eng.add("A", prompts[0], 2)  # 3 blocks each, the first 2 shared: all 4 blocks in use
    eng.add("B", prompts[1], 2)
    eng.run(max_steps=50)
    eng.check_done()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_requests_too_long_to_recompute_are_never_preempted(asynchronous):
    # 6 blocks of 4 = 24 tokens. Once compressed, L's history (prompt + outputs) outgrows the
    # cache: preempting it then would mean recomputing more than the cache holds, forever.
    # Two slots are forced (query_slots), beyond the M * N = 4 blocks per slot the engine derives.
    eng = HybridEngine(num_blocks=6, block_size=4, max_blocks_per_seq=4, window=1, max_num_seqs=2,
                       num_query_slots=2, hybrid=False, asynchronous=asynchronous, prefix_caching=False)
    eng.add("A", [0], 20)
    eng.step()
    eng.add("L", [1] * 20, 10)  # compressed at its first decode
    eng.run(max_steps=200)  # the step checks that no victim exceeds max_recompute_tokens
    eng.check_done()


# -- property test ------------------------------------------------------------------------------
@st.composite
def hybrid_workloads(draw):
    bs = draw(st.sampled_from([4, 8]))
    N = draw(st.integers(2, 4))
    window = draw(st.integers(1, bs))
    max_num_seqs = draw(st.integers(1, 6))
    hybrid = draw(st.booleans())
    M = draw(st.integers(1, max_num_seqs))
    asynchronous = draw(st.booleans())
    prefix_caching = draw(st.booleans())
    k = (N - 1) * bs
    tok = st.integers(0, 2)
    prefixes = [draw(st.lists(tok, min_size=bs + 1, max_size=(N + 1) * bs)) for _ in range(2)]
    requests = []
    for i in range(draw(st.integers(2, 6))):
        kind = draw(st.sampled_from(["shared", "shared", "short", "long"]))
        if kind == "shared":
            base = draw(st.sampled_from(prefixes))
            cut = draw(st.one_of(st.just(len(base)), st.integers(1, len(base))))
            prompt = base[:cut] + draw(st.lists(tok, max_size=bs))
        elif kind == "long":  # compressed at its first decode
            prompt = draw(st.lists(tok, min_size=N * bs, max_size=(N + 2) * bs))
        else:
            prompt = draw(st.lists(tok, min_size=1, max_size=N * bs))
        max_tokens = draw(st.one_of(st.integers(1, 3 * k), st.integers(k, 3 * k)))
        arrival = draw(st.one_of(st.just(0), st.integers(0, 3), st.integers(0, 12)))
        requests.append((arrival, f"q{i}", prompt, max_tokens))
    delays = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))

    def blocks(n):
        return -(-n // bs)

    max_model_len = max(len(p) + m for _, _, p, m in requests)
    prompt_blocks = max(blocks(len(p)) for _, _, p, _ in requests)
    # Every request can run alone (a long prompt is compressed at its first decode), and M
    # requests at full budget fit (the engine derives M from memory so that they do).
    low = max(N + 1, prompt_blocks + 1, M * N)
    num_blocks = low + draw(st.one_of(st.just(0), st.integers(0, 2), st.integers(0, 2 * N * max_num_seqs)))
    cap = N + draw(st.one_of(st.just(0), st.integers(0, 3 * N)))  # a lone larger request still compresses
    engine_args = dict(num_blocks=num_blocks, block_size=bs, max_blocks_per_seq=N, window=window,
                       max_num_seqs=max_num_seqs, num_query_slots=M, hybrid=hybrid, asynchronous=asynchronous,
                       prefix_caching=prefix_caching, max_model_len=max_model_len,
                       max_num_batched_tokens=draw(st.integers(max_model_len, 2 * max_model_len)),
                       max_blocks_per_compression=cap, delays=delays)
    return engine_args, requests


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hybrid_workloads())
def test_random_hybrid_workloads(workload):
    engine_args, requests = workload
    eng = HybridEngine(**engine_args)
    total_tokens = sum(len(p) + m for _, _, p, m in requests)
    eng.run(requests, max_steps=20 * total_tokens + max(r[0] for r in requests) + 10)
    eng.check_done()


# -- guards of the step being built and of plan-time bookkeeping -------------------------------------
def _running(sched: Scheduler, bm: BlockManager, request_id: str, num_tokens: int, kv_len: int, blocks: int):
    """A running request placed by hand: ``blocks`` private blocks, ``kv_len`` cached tokens."""
    seq = Sequence(request_id, None, [1] * num_tokens, SamplingParams(temperature=0.0), 64, 0)
    for _ in range(blocks):
        bm.append_slot(seq) if bm.needs_block(seq) else None
        seq.kv_len = len(seq.block_table) * bm.block_size  # (by hand: fill the block just taken)
    seq.kv_len = kv_len
    seq.kv_is_token_prefix = False
    seq.status = SequenceStatus.RUNNING
    sched.running.append(seq)
    return seq


def test_a_request_already_placed_in_the_step_is_never_preempted():
    # C and A (older) are placed first; B, the newest, needs a block and cannot itself be
    # recomputed (compacted, more tokens than the cache holds). Without another victim it waits:
    # preempting A, already in the step, would run A's forward on freed blocks.
    comp = CompressionConfig(max_blocks_per_seq=3, window=2, hybrid=False, asynchronous=False)
    comp.resolve(4)
    config = SchedulerConfig(max_num_seqs=3, max_model_len=64, enable_chunked_prefill=False)
    config.resolve(64)
    bm = BlockManager(3, 4, False, min_recomputed_tokens=2)
    sched = Scheduler(config, bm, comp, num_query_slots=3)
    c = _running(sched, bm, "C", num_tokens=3, kv_len=2, blocks=1)
    a = _running(sched, bm, "A", num_tokens=2, kv_len=1, blocks=1)
    b = _running(sched, bm, "B", num_tokens=30, kv_len=4, blocks=1)
    assert bm.num_free_blocks == 0 and b.num_tokens > sched.max_recompute_tokens
    batch = sched.schedule()
    assert batch.seqs == [c, a] and batch.preempted == []
    assert a.status is SequenceStatus.RUNNING and len(a.block_table) == 1


def test_counters_count_compressions_that_ran_and_a_recompute_pools_its_first_compression():
    # Synchronous compression in a tiny cache, so that requests are preempted and recomputed.
    # A recomputed request's KV is fresh: its next compression is its first, max-pooled.
    eng = HybridEngine(num_blocks=5, block_size=4, max_blocks_per_seq=2, window=2, max_num_seqs=4,
                       hybrid=False, asynchronous=False, prefix_caching=False)
    ran = []
    compress = eng.compress

    def recording(tasks):
        ran.extend((t.seq.request_id, t.seq.metrics.num_preemptions, t.pool, t.num_previous) for t in tasks)
        compress(tasks)

    eng.compress = recording
    for i, length in enumerate((5, 3, 8)):
        eng.add(f"R{i}", [(i + j) % 3 for j in range(length)], 14)
    eng.run()
    eng.check_done()
    for _, _, pool, num_previous in ran:
        assert pool == (num_previous == 0)  # pooled exactly at each incarnation's first compression
    # R2 compressed, was preempted, and compressed again after its recompute.
    r2 = [(preemptions, pool) for rid, preemptions, pool, _ in ran if rid == "R2"]
    assert (0, True) in r2 and any(preemptions > 0 and pool for preemptions, pool in r2)
    for rid, seq in eng.requests.items():  # counters: only the compressions that ran
        assert seq.metrics.num_compressions == sum(1 for r in ran if r[0] == rid)
