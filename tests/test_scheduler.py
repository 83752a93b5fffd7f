"""Tests of the scheduler, driven by a fake engine loop (no model).

``FakeEngine.step`` mirrors ``LLMEngine.step``: schedule, "run" the batch (write
the KV of the computed positions into a simulated cache), then for each sequence
set ``kv_len`` (prefill: ``num_tokens``; decode: ``+1``), register full blocks,
append the sampled token and finish it when it reaches ``max_tokens``. The fake
model's token depends only on (request, position), as a greedy model's would, so a
preempted and recomputed request must produce exactly the same outputs.
"""

from __future__ import annotations

import itertools

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zipage.config import SchedulerConfig
from zipage.engine.block_manager import BlockManager
from zipage.engine.scheduler import Scheduler
from zipage.engine.sequence import Sequence, SequenceStatus
from zipage.sampling_params import SamplingParams


def fake_token(request_id: str, position: int, vocab: int = 3) -> int:
    """The fake model's output at ``position``: a fixed function of the request and position."""
    return (sum(map(ord, request_id)) * 7 + position * 5 + position * position) % vocab


class FakeEngine:
    def __init__(self, num_blocks, block_size, max_num_seqs, max_model_len, max_num_batched_tokens=None,
                 prefix_caching=True, chunked=False, attention_span=None):
        """``chunked``: chunked prefill (the engine's default); the structural checks of the steps
        below are those of whole-prompt prefills unless it is set."""
        assert max_model_len <= num_blocks * block_size  # as LLMEngine guarantees
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 max_model_len=max_model_len, enable_chunked_prefill=chunked,
                                 prefill_attention_span=attention_span)
        config.resolve(max_model_len)
        self.config = config
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(config, self.bm)
        self.slots = {b: [None] * block_size for b in range(num_blocks)}  # simulated KV cache
        self.requests: dict[str, Sequence] = {}
        self.finished: list[Sequence] = []
        self.batches = []  # (is_prefill, [request ids], [preempted ids], tokens computed), at schedule time

    # -- requests ---------------------------------------------------------
    def add(self, request_id: str, prompt, max_tokens: int) -> Sequence:
        max_len = self.config.max_model_len
        assert 1 <= len(prompt) < max_len
        max_tokens = min(max_tokens, max_len - len(prompt))  # as LLMEngine.prepare_request
        seq = Sequence(request_id, None, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                       max_tokens, seed=0)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    # -- the loop ---------------------------------------------------------
    def step(self):
        sched, bm = self.scheduler, self.bm
        running_before, waiting_before = list(sched.running), list(sched.waiting)
        free_before = bm.num_free_blocks
        needing = sum(1 for s in running_before if bm.needs_block(s))
        head_fits = bool(waiting_before) and bm.can_allocate(waiting_before[0])
        batch = sched.schedule()
        if batch is None:
            return None
        assert len({id(s) for s in batch.seqs}) == len(batch.seqs), "a sequence twice in one batch"
        assert len(sched.running) <= self.config.max_num_seqs
        if self.config.enable_chunked_prefill:
            self._check_mixed(batch, running_before)
        elif batch.is_prefill:
            self._check_prefill(batch, waiting_before, running_before)
        else:
            # Decode only when admission is impossible (prefill goes first).
            assert not head_fits or len(running_before) >= self.config.max_num_seqs
            self._check_decode(batch, running_before, waiting_before, free_before, needing)
        self.batches.append((batch.is_prefill, [s.request_id for s in batch.seqs],
                             [s.request_id for s in batch.preempted], batch.num_tokens))
        self._run(batch)
        for seq in batch.seqs:  # LLMEngine.step's order
            bm.cache_step(seq)
            if not seq.samples:
                continue  # an earlier chunk of its prompt: no token
            bm.register_computed(seq, seq.kv_len)
            seq.token_ids.append(fake_token(seq.request_id, seq.num_tokens))
            if seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq, "length")
                self.finished.append(seq)
        self.check_state()
        return batch

    def run(self, arrivals=(), max_steps=None):
        """Step until done; ``arrivals`` = [(step, request_id, prompt, max_tokens)] added before that step."""
        pending = sorted(arrivals, key=lambda a: a[0])
        budget = max_steps if max_steps is not None else 10_000
        for step in itertools.count():
            while pending and pending[0][0] <= step:
                self.add(*pending.pop(0)[1:])
            if not self.scheduler.has_unfinished():
                if not pending:
                    break
                continue
            assert step < budget, f"no progress after {step} steps"
            assert self.step() is not None, "schedule() returned None while work remains"
        return self

    # -- the simulated runner --------------------------------------------
    def _write(self, seq: Sequence, position: int) -> None:
        bs = self.bm.block_size
        block = seq.block_table[position // bs]
        # A prefix hit is never recomputed; blocks computed this step may already be shared
        # with requests admitted beside this one (``_check_kv`` proves what they read).
        assert position >= seq.num_prefix_hit_tokens, f"{seq} recomputes cached position {position}"
        if position % bs == 0:
            self.slots[block] = [None] * bs
        self.slots[block][position % bs] = seq.token_ids[position]

    def _run(self, batch) -> None:
        # As in a forward: every layer stores the whole step's KV before attention reads it.
        for seq in batch.seqs:
            if seq.chunk is not None:
                start, n = seq.chunk
                for pos in range(start, start + n):
                    self._write(seq, pos)
            else:
                self._write(seq, seq.kv_len)
        for seq in batch.seqs:
            if seq.chunk is not None:
                self._check_kv(seq, sum(seq.chunk))  # the prefix cache and earlier chunks served real content

    # -- checks -------------------------------------------------------------
    def _check_kv(self, seq: Sequence, upto: int) -> None:
        bs = self.bm.block_size
        for pos in range(upto):
            block = seq.block_table[pos // bs]
            assert self.slots[block][pos % bs] == seq.token_ids[pos], f"{seq}: wrong KV at position {pos}"

    def _check_prefill(self, batch, waiting_before, running_before) -> None:
        bs = self.bm.block_size
        n = len(batch.seqs)
        assert batch.seqs == waiting_before[:n], "admission is first come, first served"
        assert self.scheduler.running == running_before + batch.seqs
        assert list(self.scheduler.waiting) == waiting_before[n:]
        assert not batch.preempted
        new_tokens = [s.num_tokens - s.num_prefix_hit_tokens for s in batch.seqs]
        assert batch.num_tokens == sum(new_tokens)
        assert n == 1 or batch.num_tokens <= self.config.max_num_batched_tokens
        for seq in batch.seqs:
            assert seq.status is SequenceStatus.RUNNING
            assert seq.chunk == (seq.num_prefix_hit_tokens, seq.num_tokens - seq.num_prefix_hit_tokens)
            assert seq.kv_len == seq.num_prefix_hit_tokens and len(seq.block_table) == -(-seq.num_tokens // bs)
            assert seq.num_prefix_hit_tokens % bs == 0 and seq.num_prefix_hit_tokens < seq.num_tokens

    def _check_decode(self, batch, running_before, waiting_before, free_before, needing) -> None:
        bs = self.bm.block_size
        preempted = batch.preempted
        # Newest first: the victims are the tail of the running list, newest first.
        assert preempted == running_before[::-1][:len(preempted)]
        assert batch.seqs == [s for s in running_before if s not in preempted]
        assert self.scheduler.running == batch.seqs
        # Each victim went to the front of the line (so the oldest victim is first).
        assert list(self.scheduler.waiting) == preempted[::-1] + waiting_before
        if preempted:
            assert needing > free_before, "preempted although every request had room"
        for seq in preempted:
            assert seq.status is SequenceStatus.WAITING and len(seq.block_table) == 0 and seq.kv_len == 0
        for seq in batch.seqs:
            assert seq.kv_len == seq.num_tokens - 1
            assert len(seq.block_table) * bs >= seq.kv_len + 1, "no slot for the next token"

    def _check_mixed(self, batch, running_before) -> None:
        """Chunked prefill: decodes first, then chunks within the token budget, each going on
        from where its prompt stopped; every running request not prefilling decodes unless it
        waits for blocks."""
        bs, budget = self.bm.block_size, self.config.max_num_batched_tokens
        decodes = [s for s in batch.seqs if s.chunk is None]
        chunks = batch.seqs[len(decodes):]
        assert batch.seqs[:len(decodes)] == decodes, "decodes come before prompt chunks"
        assert batch.is_prefill == bool(chunks)
        assert not chunks or batch.num_tokens <= max(budget, len(decodes)), "chunks beyond the token budget"
        for seq in chunks:
            start, n = seq.chunk
            assert n >= 1 and start + n == seq.num_computed <= len(seq.token_ids)
            assert start >= seq.num_prefix_hit_tokens and seq.kv_len == start
            assert seq.prefilling == (seq.num_computed < len(seq.token_ids))
            assert len(seq.block_table) == -(-seq.num_tokens // bs), "blocks for the whole prompt at admission"
        for seq in decodes:
            assert not seq.prefilling and seq.kv_len == seq.num_tokens - 1
        # What the step spent of the budget: a token per decode, each chunk at its cost.
        costs = [self.scheduler._chunk_cost(s.chunk[1], s.chunk[0]) for s in chunks]
        spent = len(decodes) + sum(costs)
        # (A chunk gets at least one token while budget is left: only a last one of one token
        # may overshoot.)
        assert not chunks or spent <= budget or chunks[-1].chunk[1] == 1 and spent - costs[-1] < budget, \
            "chunks beyond the budget"
        started = [s for s in running_before if s.prefilling and s.status is SequenceStatus.RUNNING]
        if started and spent < budget:  # prompts already started go on before new ones
            assert all(s in chunks for s in started)

    def check_state(self) -> None:
        bm, sched = self.bm, self.scheduler
        running, waiting = sched.running, list(sched.waiting)
        assert not {id(s) for s in running} & {id(s) for s in waiting}
        assert len({id(s) for s in running}) == len(running)
        assert len({id(s) for s in waiting}) == len(waiting)
        holders = [0] * bm.num_blocks
        for seq in running:
            assert seq.status is SequenceStatus.RUNNING
            if seq.prefilling:
                assert seq.kv_len == seq.num_computed < seq.num_tokens
            else:
                assert seq.kv_len == seq.num_tokens - 1
            assert len(seq.block_table) * bm.block_size >= seq.kv_len
            table = list(seq.block_table)
            assert len(set(table)) == len(table)
            for b in table:
                holders[b] += 1
            self._check_kv(seq, seq.kv_len)
        for seq in waiting:
            assert seq.status is SequenceStatus.WAITING and len(seq.block_table) == 0
        for seq in self.finished:
            assert seq.status is SequenceStatus.FINISHED and len(seq.block_table) == 0
        assert bm.ref_counts == holders, "ref counts differ from the running requests' block tables"
        assert set(bm.free_blocks) == {b for b in range(bm.num_blocks) if holders[b] == 0}
        for h, b in bm.hash_to_block.items():
            assert bm.block_hash[b] == h
        assert sum(h is not None for h in bm.block_hash) == len(bm.hash_to_block)

    def check_done(self) -> None:
        assert not self.scheduler.has_unfinished()
        assert len(self.finished) == len(self.requests)
        for rid, seq in self.requests.items():
            assert seq.is_finished and seq.finish_reason == "length"
            expected = [fake_token(rid, seq.num_prompt_tokens + i) for i in range(seq.max_tokens)]
            assert seq.output_token_ids == expected, f"request {rid}"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.ref_counts == [0] * self.bm.num_blocks
        assert self.scheduler.schedule() is None


# -- preemption -----------------------------------------------------------------------------------
def test_preemption_newest_first_then_recompute():
    eng = FakeEngine(num_blocks=6, block_size=4, max_num_seqs=3, max_model_len=24)
    a = eng.add("A", [10, 11, 12, 13, 14, 15, 16], 6)
    b = eng.add("B", [20, 21, 22, 23, 24, 25, 26], 6)
    c = eng.add("C", [30, 31, 32, 33, 34, 35, 36], 6)
    d = eng.add("D", [40, 41, 42], 2)

    batch = eng.step()  # A, B, C take all six blocks; D waits (max_num_seqs)
    assert batch.is_prefill and batch.seqs == [a, b, c] and eng.batches[-1][3] == 21
    assert eng.bm.num_free_blocks == 0 and list(eng.scheduler.waiting) == [d]
    batch = eng.step()  # position 7 still fits in each second block
    assert not batch.is_prefill and batch.seqs == [a, b, c] and not batch.preempted
    batch = eng.step()  # position 8 needs a third block each: C (newest) makes room for A and B
    assert not batch.is_prefill and batch.seqs == [a, b] and batch.preempted == [c]
    assert list(eng.scheduler.waiting) == [c, d], "the preempted request goes first in line"
    assert c.status is SequenceStatus.WAITING and c.metrics.num_preemptions == 1
    assert eng.scheduler.num_preemptions == 1
    assert c.num_output_tokens == 2 and c.kv_len == 0 and len(c.block_table) == 0

    eng.run()
    eng.check_done()
    # C stays first in line (D waits behind it) until A and B finish, then both are prefilled.
    later_prefills = [ids for prefill, ids, _, _ in eng.batches[3:] if prefill]
    assert later_prefills == [["C", "D"]]
    assert c.metrics.num_preemptions == 1 and len(c.output_token_ids) == 6


def test_recompute_prefills_the_whole_token_list():
    eng = FakeEngine(num_blocks=6, block_size=4, max_num_seqs=3, max_model_len=24, prefix_caching=False)
    eng.add("A", list(range(7)), 6)
    eng.add("B", list(range(10, 17)), 6)
    c = eng.add("C", list(range(20, 27)), 6)
    eng.step(), eng.step()
    assert eng.step().preempted == [c]
    tokens_at_preemption = list(c.token_ids)
    while True:
        batch = eng.step()
        if batch.is_prefill:
            break
    assert batch.seqs == [c] and c.num_prefix_hit_tokens == 0
    assert eng.batches[-1][3] == len(tokens_at_preemption) == 9
    assert c.token_ids[:9].tolist() == tokens_at_preemption and c.num_output_tokens == 3
    eng.run()
    eng.check_done()


def test_newest_request_preempts_itself():
    eng = FakeEngine(num_blocks=3, block_size=4, max_num_seqs=4, max_model_len=12)
    a = eng.add("A", [1, 2, 3, 4, 5], 4)  # 2 blocks, its next slot (5) is inside block 2
    b = eng.add("B", [6, 7, 8, 9], 4)  # 1 block, full: its next slot needs a new block
    assert eng.step().seqs == [a, b]
    assert eng.bm.num_free_blocks == 0
    batch = eng.step()
    assert batch.seqs == [a] and batch.preempted == [b]
    assert list(eng.scheduler.waiting) == [b]
    eng.run()
    eng.check_done()


def test_preemption_of_several_requests_in_one_step():
    # Four 4-token prompts fill 4 of 5 blocks; the decode needs 4 new blocks but only 1 is free.
    eng = FakeEngine(num_blocks=5, block_size=4, max_num_seqs=4, max_model_len=20, prefix_caching=False)
    seqs = [eng.add(name, [i * 10 + j for j in range(4)], 5) for i, name in enumerate("ABCD")]
    assert eng.step().seqs == seqs
    batch = eng.step()
    # A takes the free block; B needs one: D goes; C needs one: it is newest now and goes itself.
    assert batch.preempted == [seqs[3], seqs[2]]
    assert batch.seqs == seqs[:2]
    assert list(eng.scheduler.waiting) == [seqs[2], seqs[3]]
    eng.run()
    eng.check_done()


# -- budgets ----------------------------------------------------------------------------------
def test_prefill_token_budget_and_max_num_seqs():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=3, max_model_len=20, max_num_batched_tokens=20)
    lengths = [8, 8, 5, 19, 1, 2, 12, 12, 3, 7, 15, 4]
    for i, n in enumerate(lengths):
        eng.add(f"r{i}", [(i * 13 + j) % 50 + 3 for j in range(n)], 4)
    eng.run()
    eng.check_done()
    prefills = [(ids, n) for prefill, ids, _, n in eng.batches if prefill]
    # 8 + 8 fit, 5 more would exceed 20: the first prefill stops at the head of the line.
    assert prefills[0] == (["r0", "r1"], 16)
    assert all(len(ids) <= 3 and n <= 20 for ids, n in prefills)
    # Every request was prefilled once (no preemption with this much memory), in arrival order.
    order = [rid for ids, _ in prefills for rid in ids]
    assert order == [f"r{i}" for i in range(len(lengths))]
    assert eng.scheduler.num_preemptions == 0


def test_max_num_seqs_caps_running_requests():
    eng = FakeEngine(num_blocks=64, block_size=2, max_num_seqs=2, max_model_len=16)
    for i in range(5):
        eng.add(str(i), [i + 1, i + 2], 3)
    first = eng.step()
    assert [s.request_id for s in first.seqs] == ["0", "1"] and len(eng.scheduler.waiting) == 3
    eng.run()
    eng.check_done()
    assert all(len(ids) <= 2 for _, ids, _, _ in eng.batches)


def test_prefix_hits_count_only_new_tokens_against_the_budget():
    eng = FakeEngine(num_blocks=32, block_size=4, max_num_seqs=8, max_model_len=20, max_num_batched_tokens=20)
    shared = list(range(100, 116))
    eng.add("first", shared + [1, 2], 1)
    eng.step()
    assert eng.batches[-1][3] == 18  # registers the four shared blocks
    for i in range(5):
        eng.add(f"s{i}", shared + [i, i], 2)
    batch = eng.step()
    # 18 tokens each, but 16 come from the cache: all five fit a budget of 20 (2 new tokens each).
    assert batch.is_prefill and len(batch.seqs) == 5 and eng.batches[-1][3] == 10
    assert all(s.num_prefix_hit_tokens == 16 for s in batch.seqs)
    assert all(eng.bm.ref_counts[b] == 5 for b in list(batch.seqs[0].block_table)[:4])
    eng.run()
    eng.check_done()


# -- finish and idle ------------------------------------------------------------------------------
def test_finish_waiting_and_running_requests():
    eng = FakeEngine(num_blocks=8, block_size=4, max_num_seqs=1, max_model_len=16)
    a = eng.add("A", [1, 2, 3], 5)
    b = eng.add("B", [4, 5, 6], 5)
    eng.step()
    eng.scheduler.finish(b, "abort")  # still waiting
    assert b.is_finished and b.finish_reason == "abort" and not eng.scheduler.waiting
    eng.scheduler.finish(a, "abort")  # running: its blocks come back
    assert a.is_finished and not eng.scheduler.running
    assert eng.bm.num_free_blocks == 8 and eng.bm.ref_counts == [0] * 8
    assert eng.scheduler.schedule() is None and not eng.scheduler.has_unfinished()


def test_schedule_is_none_without_work():
    eng = FakeEngine(num_blocks=2, block_size=2, max_num_seqs=1, max_model_len=4)
    assert eng.scheduler.schedule() is None


# -- property test ------------------------------------------------------------------------------
@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(1, 10))
    capacity = num_blocks * block_size
    # Mostly close to the capacity, so that memory runs out and preemption happens.
    max_model_len = draw(st.integers(max(2, capacity // 2), min(capacity, 24)) if capacity >= 2 else st.just(2))
    if capacity < 2:
        num_blocks = -(-2 // block_size)
        max_model_len = 2
    max_num_seqs = draw(st.integers(1, 4))
    chunked = draw(st.booleans())
    max_num_batched_tokens = draw(st.integers(1 if chunked else max_model_len, 2 * max_model_len))
    prefix_caching = draw(st.booleans())
    attention_span = draw(st.sampled_from([None, 3, 20])) if chunked else None
    prefixes = [draw(st.lists(st.integers(0, 2), min_size=1, max_size=max_model_len - 1)) for _ in range(2)]
    requests = []
    for i in range(draw(st.integers(1, 8))):
        if draw(st.booleans()):
            base = draw(st.sampled_from(prefixes))
            prompt = base[:draw(st.integers(1, len(base)))] + draw(st.lists(st.integers(0, 2), max_size=4))
        else:
            prompt = draw(st.lists(st.integers(0, 2), min_size=1, max_size=max_model_len - 1))
        prompt = prompt[:max_model_len - 1]
        room = max_model_len - len(prompt)
        max_tokens = draw(st.one_of(st.just(room), st.integers(1, room)))
        arrival = draw(st.one_of(st.just(0), st.integers(0, 6)))
        requests.append((arrival, f"q{i}", prompt, max_tokens))
    return dict(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                prefix_caching=prefix_caching, chunked=chunked, attention_span=attention_span), requests


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_without_deadlock(workload):
    engine_args, requests = workload
    eng = FakeEngine(**engine_args)
    # Without chunks every step produces at least one token and none is ever lost (recompute
    # keeps them), so the loop ends within sum(max_tokens) busy steps plus the idle ones before
    # arrivals. A step of chunks alone produces no token; each prefill takes at most as many
    # chunks as it has tokens, and a request is prefilled at most once per token it produces.
    bound = sum(r[3] for r in requests) + max(r[0] for r in requests) + 1
    if engine_args["chunked"]:
        bound += sum((len(r[2]) + r[3]) * (r[3] + 1) for r in requests)
    eng.run(requests, max_steps=bound)
    eng.check_done()


def test_chunk_cost_counts_attention_to_what_came_before():
    config = SchedulerConfig(max_num_batched_tokens=512, max_model_len=100_000, prefill_attention_span=1000)
    config.resolve(100_000)
    sched = Scheduler(config, BlockManager(8, 16))
    for cached in (0, 100, 1000, 10_000, 100_000):
        n = sched._chunk_tokens(512, cached)
        cost = n * (1 + (cached + n / 2) / 1000)
        assert sched._chunk_cost(n, cached) == math.ceil(cost)
        assert n == 1 or sched._chunk_cost(n, cached) <= 512 < sched._chunk_cost(n + 1, cached)
    # n (1 + n / 2000) <= 512 from the start; deep into a prompt far fewer; never none.
    assert sched._chunk_tokens(512, 0) == 422
    assert sched._chunk_tokens(512, 10_000) == 46
    assert sched._chunk_tokens(512, 10 ** 9) == 1 and sched._chunk_tokens(1, 0) == 1
    config.prefill_attention_span = 0  # a chunk costs its tokens
    assert sched._chunk_tokens(512, 10 ** 9) == 512 and sched._chunk_cost(512, 10 ** 9) == 512


def test_chunks_shrink_as_a_long_prompt_advances():
    """One long prompt beside a decoding request: each chunk gets what its cost leaves of the
    budget, fewer tokens the more of the prompt is cached, and the prompt still finishes."""
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=2, max_model_len=250, max_num_batched_tokens=24,
                     chunked=True, attention_span=40)
    schedule, sizes = eng.scheduler.schedule, []

    def recording():
        batch = schedule()
        sizes.extend(s.chunk[1] for s in (batch.seqs if batch else []) if s.request_id == "long" and s.chunk)
        return batch

    eng.scheduler.schedule = recording
    eng.run([(0, "short", [1, 2], 30), (1, "long", [1, 2, 0] * 70, 5)], max_steps=400)
    eng.check_done()
    body = sizes[:-1]  # (the last chunk is what is left of the prompt)
    assert sum(sizes) == 210 and len(body) > 10
    assert body == sorted(body, reverse=True) and body[0] > 2 * body[-1]


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_heavy_contention_stays_consistent(prefix_caching, chunk):
    """Many long requests with a shared prefix on a pool that fits barely one of them
    (whole prompts, or chunks of 3 tokens)."""
    eng = FakeEngine(num_blocks=6, block_size=2, max_num_seqs=4, max_model_len=12, prefix_caching=prefix_caching,
                     max_num_batched_tokens=chunk, chunked=chunk is not None)
    shared = [1, 2, 1, 2]
    arrivals = [(i % 3, f"h{i}", shared + [i % 3] * (i % 4 + 1), 12) for i in range(10)]
    eng.run(arrivals, max_steps=(sum(12 - len(a[2]) for a in arrivals) + 10) * (1 if chunk is None else 12))
    eng.check_done()
    # (With chunks of 3 the decodes leave little budget for admissions: fewer requests contend.)
    assert chunk is not None or eng.scheduler.num_preemptions > 0


def test_prompts_compressed_between_chunks_never_deadlock_on_blocks():
    """Two prompts compressed between chunks hold every block, each below its budget and at a
    block boundary: neither a compression nor a chunk can run, so the newer is preempted and the
    older goes on; it is recomputed later."""
    from zipage.config import CompressionConfig

    comp = CompressionConfig(kv_budget_tokens=8, window=2, prefill_compression="always", asynchronous=False)
    comp.resolve(4)  # N = 3 blocks of 4
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    config.resolve(64)
    bm = BlockManager(4, 4, True, min_recomputed_tokens=2)
    sched = Scheduler(config, bm, comp, num_query_slots=2)
    a, b = (Sequence(name, None, list(range(10 * i + 3, 10 * i + 33)), SamplingParams(temperature=0.0), 4, 0)
            for i, name in enumerate("ab"))
    sched.add(a), sched.add(b)
    assert a.compress_prefill and b.compress_prefill
    # As admitted with a first chunk of 8 tokens each (2 blocks), so that they hold all 4 blocks.
    # (A prompt already started goes before an admission, so the scheduler alone does not reach
    # this state with these sizes; decodes holding blocks in between can.)
    for seq in (a, b):
        sched.waiting.popleft()
        bm.allocate(seq, 8)
        bm.schedule_chunk(seq, 8)
        bm.cache_step(seq)
        seq.status, seq.query_slot = SequenceStatus.RUNNING, sched.free_query_slots.pop()
        sched.running.append(seq)
    assert bm.num_free_blocks == 0
    assert all(s.kv_len == 8 < 12 and s.kv_len == len(s.block_table) * 4 for s in (a, b))
    batch = sched.schedule()
    assert batch.preempted == [b] and batch.seqs == [a] and a.chunk == (8, 8)
    assert b.status is SequenceStatus.WAITING and len(b.block_table) == 0 and b.query_slot is None


@pytest.mark.parametrize("chunked", [True, False])
def test_a_request_with_a_token_in_flight_waits_to_be_readmitted(chunked):
    """A request preempted while a launched step still holds its next token (asynchronous
    scheduling) is prefilled again only once that token is on the host: a prefill reads every
    token from the host."""
    eng = FakeEngine(num_blocks=8, block_size=4, max_num_seqs=2, max_model_len=16, chunked=chunked)
    seq = eng.add("A", [1, 2, 3, 4, 5], 4)
    seq.num_pending = 1  # as after a preemption, its sampled token not yet read back
    assert eng.scheduler.schedule() is None and seq.status is SequenceStatus.WAITING
    seq.num_pending = 0
    batch = eng.scheduler.schedule()
    assert batch.seqs == [seq] and seq.status is SequenceStatus.RUNNING
