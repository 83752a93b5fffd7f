"""Tests of the block pool: allocation, reference counts and the chained-hash prefix cache.

Sequences are driven the way the engine drives them: a prefill sets
``kv_len = num_tokens`` then registers full blocks, then the sampled token is
appended; a decode step makes room (``append_slot``), sets ``kv_len += 1``,
registers, then appends. A simulated KV store records which token each slot
holds, so a prefix hit is checked against what was really "computed" there.
"""

from __future__ import annotations

import copy
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zipage.engine.block_manager import BlockManager, chain_hash
from zipage.engine.sequence import Sequence
from zipage.sampling_params import SamplingParams

_ids = itertools.count()


def make_seq(tokens) -> Sequence:
    return Sequence(f"s{next(_ids)}", None, list(tokens), SamplingParams(max_tokens=None), 10_000, 0)


class KVStore:
    """What each slot of each physical block holds, as written by simulated forwards."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.slots: dict[int, list] = {b: [None] * bm.block_size for b in range(bm.num_blocks)}

    def write(self, seq: Sequence, position: int) -> None:
        bs = self.bm.block_size
        block = seq.block_table[position // bs]
        # A prefix hit is never recomputed. Blocks computed in this step may already be
        # shared with requests admitted beside this one; ``check`` proves what they read.
        assert position >= seq.num_prefix_hit_tokens, f"recomputing cached position {position}"
        if position % bs == 0:
            self.slots[block] = [None] * bs  # a fresh block: old contents are gone
        self.slots[block][position % bs] = seq.token_ids[position]

    def check(self, seq: Sequence) -> None:
        """The cache holds ``seq``'s tokens at every position below ``kv_len``."""
        bs = self.bm.block_size
        for pos in range(seq.kv_len):
            block = seq.block_table[pos // bs]
            assert self.slots[block][pos % bs] == seq.token_ids[pos], (
                f"{seq}: position {pos} in block {block} holds {self.slots[block][pos % bs]}, "
                f"not {seq.token_ids[pos]}")


def prefill(bm: BlockManager, seq: Sequence, next_token: int, kv: KVStore | None = None) -> None:
    """Allocate and run the prefill of ``seq`` as the engine does (one chunk)."""
    bm.allocate(seq)
    bm.schedule_chunk(seq, seq.num_tokens - seq.num_prefix_hit_tokens)
    if kv is not None:
        for pos in range(seq.num_prefix_hit_tokens):
            block = seq.block_table[pos // bm.block_size]
            assert kv.slots[block][pos % bm.block_size] == seq.token_ids[pos], "prefix hit with wrong content"
        for pos in range(seq.num_prefix_hit_tokens, seq.num_tokens):
            kv.write(seq, pos)
    seq.kv_len = seq.num_tokens
    bm.register_computed(seq, seq.kv_len)
    seq.token_ids.append(next_token)


def decode(bm: BlockManager, seq: Sequence, next_token: int, kv: KVStore | None = None) -> None:
    """One decode step of ``seq`` as the scheduler and engine do it (room must exist)."""
    assert bm.can_append(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) * bm.block_size >= seq.kv_len + 1
    if kv is not None:
        kv.write(seq, seq.kv_len)
    seq.kv_len += 1
    bm.register_computed(seq, seq.kv_len)
    seq.token_ids.append(next_token)


def check_invariants(bm: BlockManager, live) -> None:
    holders = [0] * bm.num_blocks
    for seq in live:
        table = list(seq.block_table)
        assert len(set(table)) == len(table), f"{seq} holds a block twice: {table}"
        for b in table:
            holders[b] += 1
    assert bm.ref_counts == holders, "ref counts differ from the live block tables"
    assert set(bm.free_blocks) == {b for b in range(bm.num_blocks) if holders[b] == 0}
    assert bm.num_free_blocks == sum(1 for h in holders if h == 0)
    for h, b in bm.hash_to_block.items():
        assert bm.block_hash[b] == h
    registered = [b for b in range(bm.num_blocks) if bm.block_hash[b] is not None]
    assert len(registered) == len(bm.hash_to_block)
    for b in registered:
        assert bm.hash_to_block[bm.block_hash[b]] == b


# -- allocation and free --------------------------------------------------------------------------
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_allocate_and_free_return_every_block(prefix_caching):
    bm = BlockManager(10, 4, prefix_caching)
    seqs = [make_seq(range(100 * i, 100 * i + n)) for i, n in enumerate([1, 4, 5, 9])]
    for seq in seqs:
        assert bm.can_allocate(seq)
        bm.allocate(seq)
    assert [len(s.block_table) for s in seqs] == [1, 1, 2, 3]
    used = [b for s in seqs for b in s.block_table]
    assert len(set(used)) == 7 and bm.num_free_blocks == 3
    assert all(bm.ref_counts[b] == 1 for b in used)
    check_invariants(bm, seqs)
    for i, seq in enumerate(seqs):
        bm.free(seq)
        assert len(seq.block_table) == 0 and seq.kv_len == 0
        check_invariants(bm, seqs[i + 1:])
    assert bm.num_free_blocks == 10 and bm.ref_counts == [0] * 10


def test_can_allocate_exact_capacity():
    bm = BlockManager(4, 4)
    assert bm.can_allocate(make_seq(range(16)))
    assert not bm.can_allocate(make_seq(range(17)))
    seq = make_seq(range(5))
    bm.allocate(seq)
    assert bm.can_allocate(make_seq(range(100, 108)))
    assert not bm.can_allocate(make_seq(range(100, 109)))


def test_double_free_is_caught():
    bm = BlockManager(4, 4)
    a = make_seq(range(6))
    bm.allocate(a)
    twin = make_seq(range(6))
    twin.block_table.replace(a.block_table)  # a stale second owner of the same blocks
    bm.free(a)
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(twin)
    # Freeing a sequence that holds nothing is a no-op.
    bm2 = BlockManager(2, 4)
    empty = make_seq([1])
    bm2.free(empty)
    assert bm2.num_free_blocks == 2 and bm2.ref_counts == [0, 0]


def test_allocate_twice_is_refused():
    bm = BlockManager(4, 4)
    seq = make_seq(range(3))
    bm.allocate(seq)
    with pytest.raises(AssertionError):
        bm.allocate(seq)


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)


# -- prefix cache ---------------------------------------------------------------------------------
def test_shared_prefix_is_shared_from_allocation():
    bm = BlockManager(16, 4)
    a = make_seq(range(10))  # blocks [0..3], [4..7], [8, 9]
    b = make_seq(list(range(8)) + [50, 51, 52])
    assert bm.cached_prefix_tokens(b) == 0
    bm.allocate(a)
    assert a.num_registered_blocks == 0 and bm.cached_prefix_tokens(b) == 0  # no KV scheduled yet
    bm.schedule_chunk(a, a.num_tokens)
    # a's full blocks are cached once its prefill is scheduled: a request admitted in the
    # same step reads them after that step's forward has stored them.
    assert a.num_registered_blocks == 2
    assert bm.cached_prefix_tokens(b) == 8
    bm.allocate(b)
    bm.schedule_chunk(b, b.num_tokens - b.num_prefix_hit_tokens)
    assert b.num_prefix_hit_tokens == 8 and b.num_registered_blocks == 2
    assert list(b.block_table)[:2] == list(a.block_table)[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    assert bm.ref_counts[b.block_table[2]] == 1
    check_invariants(bm, [a, b])
    # Freeing one owner keeps the shared blocks live for the other.
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table] == [1, 1, 1]
    assert not set(b.block_table) & set(bm.free_blocks)
    check_invariants(bm, [b])
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(16, 4)
    a = make_seq(range(8))  # exactly two blocks
    prefill(bm, a, 99)
    assert a.num_registered_blocks == 2
    same = make_seq(range(8))
    assert bm.cached_prefix_tokens(same) == 4  # the last block is recomputed for its logits
    bm.allocate(same)
    assert same.num_prefix_hit_tokens == 4
    assert same.block_table[0] == a.block_table[0] and same.block_table[1] != a.block_table[1]
    longer = make_seq(list(range(8)) + [7])
    assert bm.cached_prefix_tokens(longer) == 8
    one_block = make_seq(range(4))
    assert bm.cached_prefix_tokens(one_block) == 0
    assert bm.cached_prefix_tokens(make_seq([0])) == 0


def test_freed_cached_block_is_revived_by_a_hit():
    bm = BlockManager(6, 4)
    a = make_seq(range(9))
    prefill(bm, a, 99)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 6
    assert all(bm.block_hash[b] is not None for b in a_blocks[:2])  # contents kept while free
    b = make_seq(list(range(8)) + [40, 41])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert list(b.block_table)[:2] == a_blocks[:2]
    assert b.num_prefix_hit_tokens == 8
    assert all(bm.ref_counts[x] == 1 for x in b.block_table)
    assert not set(b.block_table) & set(bm.free_blocks)
    assert bm.num_free_blocks == 6 - 3
    check_invariants(bm, [b])


def test_reused_block_is_no_longer_a_hit():
    bm = BlockManager(3, 4)
    a = make_seq(range(9))  # takes blocks 0, 1, 2; registers 0 and 1
    prefill(bm, a, 99)
    assert list(a.block_table) == [0, 1, 2]
    bm.free(a)  # tail first: the pool reuses 2, then 1, then 0
    assert list(bm.free_blocks) == [2, 1, 0]
    first = make_seq([70])
    bm.allocate(first)
    assert list(first.block_table) == [2]  # a's unregistered tail
    assert bm.cached_prefix_tokens(make_seq(range(9))) == 8
    second = make_seq([71])
    bm.allocate(second)  # evicts a's second block
    assert list(second.block_table) == [1]
    assert bm.block_hash[1] is None and len(bm.hash_to_block) == 1
    assert bm.cached_prefix_tokens(make_seq(range(9))) == 4
    third = make_seq([72])
    bm.allocate(third)
    assert bm.hash_to_block == {} and bm.block_hash == [None] * 3
    assert bm.cached_prefix_tokens(make_seq(range(9))) == 0
    check_invariants(bm, [first, second, third])


def test_can_allocate_counts_revived_free_blocks():
    bm = BlockManager(4, 4)
    a = make_seq(range(9))
    prefill(bm, a, 99)
    bm.free(a)  # 4 free, 2 of them cached
    # 16 tokens = 4 blocks: 2 revived from the free pool plus 2 new ones = the whole pool.
    b = make_seq(list(range(8)) + list(range(20, 28)))
    assert bm.can_allocate(b)
    holder = make_seq([60])
    bm.allocate(holder)  # takes a's unregistered tail block; 3 free (2 cached)
    assert bm.num_free_blocks == 3 and bm.cached_prefix_tokens(b) == 8
    # Needs 2 new blocks + revives 2 cached ones: 4 > 3 free.
    assert not bm.can_allocate(b)
    with pytest.raises(KeyError):
        copy.deepcopy(bm).allocate(copy.deepcopy(b))
    # 12 tokens = 3 blocks: 2 revived + 1 new = 3: fits exactly.
    c = make_seq(list(range(8)) + [20, 21, 22, 23])
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert bm.num_free_blocks == 0
    check_invariants(bm, [holder, c])


def test_can_allocate_with_live_shared_blocks():
    bm = BlockManager(4, 4)
    a = make_seq(range(9))
    prefill(bm, a, 99)  # 3 blocks live, 1 free
    b = make_seq(list(range(8)) + [30, 31, 32])  # 3 blocks: 2 shared with a (live), 1 new
    assert bm.can_allocate(b)
    c = make_seq(list(range(8)) + list(range(30, 35)))  # 4 blocks: 2 shared, 2 new > 1 free
    assert not bm.can_allocate(c)
    bm.allocate(b)
    assert bm.num_free_blocks == 0
    check_invariants(bm, [a, b])


def test_chained_hash_needs_equal_earlier_blocks():
    bm = BlockManager(16, 4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    prefill(bm, a, 99)
    # Same second block after a different first block: not a hit.
    b = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert bm.cached_prefix_tokens(b) == 0
    prefill(bm, b, 99)
    assert b.num_prefix_hit_tokens == 0
    assert len(bm.hash_to_block) == 4  # b's second block has its own chained hash
    assert b.block_table[1] != a.block_table[1]
    # A different first block ends the hit even when the rest matches.
    assert bm.cached_prefix_tokens(make_seq([1, 2, 3, 0, 5, 6, 7, 8, 0])) == 0
    assert bm.cached_prefix_tokens(make_seq([1, 2, 3, 4, 5, 6, 7, 0, 0])) == 4
    assert chain_hash(None, [5, 6, 7, 8]) != chain_hash(chain_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert chain_hash(None, [1, 2]) == chain_hash(None, [1, 2])
    check_invariants(bm, [a, b])


def test_a_chunk_caches_only_the_blocks_it_completes():
    """A prompt prefilled in chunks: a block enters the prefix cache with the chunk that computes
    its last token, never before (a request admitted meanwhile would read KV not yet written)."""
    bm = BlockManager(16, 4)
    a, b = make_seq(range(13)), make_seq(list(range(12)) + [99])
    bm.allocate(a)
    assert a.kv_len == a.num_computed == 0 and a.prefilling and len(a.block_table) == 4
    bm.schedule_chunk(a, 6)  # tokens 0-5: block 0 complete, block 1 not
    assert a.chunk == (0, 6) and a.num_computed == 6 and a.prefilling and a.num_registered_blocks == 1
    assert bm.cached_prefix_tokens(b) == 4
    bm.cache_step(a)
    assert a.kv_len == 6
    bm.schedule_chunk(a, 7)  # the rest: blocks 1 and 2 complete, the 13th token alone in block 3
    assert a.chunk == (6, 7) and not a.prefilling and a.num_registered_blocks == 3
    assert bm.cached_prefix_tokens(b) == 12  # b's own 13th token is computed
    with pytest.raises(AssertionError):
        bm.schedule_chunk(a, 1)  # nothing left to prefill
    bm.free(a)
    assert not a.prefilling and a.chunk is None and a.kv_len == a.num_computed == 0


def test_identical_prompts_in_one_batch_share_blocks():
    bm = BlockManager(8, 2)
    a, b = make_seq([1, 2, 3, 4, 5]), make_seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    bm.schedule_chunk(a, a.num_tokens)
    bm.allocate(b)  # same step: b reads the two full blocks a computes in it
    bm.schedule_chunk(b, b.num_tokens - b.num_prefix_hit_tokens)
    assert list(b.block_table)[:2] == list(a.block_table)[:2]
    assert b.block_table[2] != a.block_table[2]  # the last token is always computed
    assert b.num_prefix_hit_tokens == 4
    assert len(bm.hash_to_block) == 2
    for seq in (a, b):
        seq.kv_len = seq.num_tokens
        bm.register_computed(seq, seq.kv_len)
    assert len(bm.hash_to_block) == 2
    check_invariants(bm, [a, b])
    a_blocks = list(a.block_table)
    bm.free(a)
    c = make_seq([1, 2, 3, 4, 5])
    bm.allocate(c)
    assert list(c.block_table)[:2] == a_blocks[:2]  # still held by b, so still hits
    check_invariants(bm, [b, c])


def test_prefix_caching_disabled():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq(range(9))
    prefill(bm, a, 99)
    assert bm.hash_to_block == {} and a.num_registered_blocks == 0
    b = make_seq(range(9))
    assert bm.cached_prefix_tokens(b) == 0
    bm.allocate(b)
    assert b.num_prefix_hit_tokens == 0 and not set(a.block_table) & set(b.block_table)


# -- decode growth --------------------------------------------------------------------------------
def test_append_slot_and_needs_block_follow_kv_len():
    bm = BlockManager(3, 4)
    kv = KVStore(bm)
    seq = make_seq([10, 11, 12])
    prefill(bm, seq, 13, kv)  # kv_len 3, 4 tokens, 1 block
    assert (seq.kv_len, seq.num_tokens, len(seq.block_table)) == (3, 4, 1)
    assert not bm.needs_block(seq)
    decode(bm, seq, 14, kv)  # writes position 3, the block's last slot
    assert len(seq.block_table) == 1 and seq.kv_len == 4
    assert seq.num_registered_blocks == 1  # the first block filled up during decode
    assert bm.needs_block(seq)
    decode(bm, seq, 15, kv)  # position 4 starts a new block
    assert len(seq.block_table) == 2 and not bm.needs_block(seq)
    for token in range(16, 19):
        decode(bm, seq, token, kv)
    assert seq.kv_len == 8 and len(seq.block_table) == 2 and bm.needs_block(seq)
    assert seq.num_registered_blocks == 2
    kv.check(seq)
    # A request reaching those tokens now hits both blocks filled by decode.
    other = make_seq(list(range(10, 18)) + [0])
    assert bm.cached_prefix_tokens(other) == 8
    # The last free block goes to the next decode; then no more room.
    decode(bm, seq, 19, kv)
    assert bm.num_free_blocks == 0
    for token in range(20, 23):
        decode(bm, seq, token, kv)
    assert bm.needs_block(seq) and not bm.can_append(seq)
    with pytest.raises(KeyError):
        bm.append_slot(seq)
    kv.check(seq)


def test_prefill_of_block_multiple_needs_block_at_first_decode():
    bm = BlockManager(4, 4)
    seq = make_seq(range(8))
    prefill(bm, seq, 8)
    assert len(seq.block_table) == 2 and bm.needs_block(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) == 3 and not bm.needs_block(seq)
    bm.append_slot(seq)  # idempotent until kv_len moves
    assert len(seq.block_table) == 3


# -- property test --------------------------------------------------------------------------------
# Prompts from a tiny alphabet, mostly extending a few shared bases, so prefixes collide often.
BASES = ([0, 1, 1, 0, 1, 0, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0, 1, 0], [0] * 10)
TOKENS = st.one_of(
    st.lists(st.integers(0, 1), min_size=1, max_size=11),
    st.builds(lambda base, n, tail: (base[:n] + tail) or [0], st.sampled_from(BASES), st.integers(0, 10),
              st.lists(st.integers(0, 1), max_size=3)),
)


class Harness:
    """Random allocate / decode / free / recompute over colliding prompts and a tiny pool."""

    def __init__(self, num_blocks, block_size, prefix_caching):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.kv = KVStore(self.bm)
        self.live: list[Sequence] = []
        self.freed: list[list[int]] = []  # token lists of freed requests, to recompute
        self.stats = {"admitted": 0, "hits": 0, "revived": 0, "no room": 0, "decodes": 0}

    def admit(self, tokens, next_token):
        seq = make_seq(tokens)
        if not self.bm.can_allocate(seq):
            self.stats["no room"] += 1
            # can_allocate is exact: allocation really fails.
            with pytest.raises(KeyError):
                copy.deepcopy(self.bm).allocate(copy.deepcopy(seq))
            return
        free_before = self.bm.num_free_blocks
        expected_hit = self.bm.cached_prefix_tokens(seq)
        revived = sum(1 for b in self.bm._cached_prefix(seq) if self.bm.ref_counts[b] == 0)
        prefill(self.bm, seq, next_token, self.kv)
        assert seq.num_prefix_hit_tokens == expected_hit
        assert seq.num_prefix_hit_tokens <= seq.num_tokens - 2  # the prompt's last token is computed
        shared = sum(1 for b in seq.block_table if self.bm.ref_counts[b] > 1)
        assert free_before - self.bm.num_free_blocks == len(seq.block_table) - shared
        self.live.append(seq)
        self.stats["admitted"] += 1
        self.stats["hits"] += expected_hit > 0
        self.stats["revived"] += revived > 0

    def recompute(self, index, next_token):
        """Readmit a freed (preempted) request with its whole token list."""
        if self.freed:
            self.admit(self.freed[index % len(self.freed)], next_token)

    def grow(self, index, next_token):
        if not self.live:
            return
        seq = self.live[index % len(self.live)]
        if not self.bm.can_append(seq):
            assert self.bm.needs_block(seq) and self.bm.num_free_blocks == 0
            return
        decode(self.bm, seq, next_token, self.kv)
        self.stats["decodes"] += 1

    def free(self, index):
        if not self.live:
            return
        seq = self.live.pop(index % len(self.live))
        self.freed.append(list(seq.token_ids))
        self.bm.free(seq)

    def check(self):
        check_invariants(self.bm, self.live)
        for seq in self.live:
            assert seq.num_tokens == seq.kv_len + 1
            assert len(seq.block_table) * self.bm.block_size >= seq.kv_len
            assert not set(seq.block_table) & set(self.bm.free_blocks)
            self.kv.check(seq)
        for b in range(self.bm.num_blocks):
            if self.bm.block_hash[b] is not None:
                assert None not in self.kv.slots[b], "a registered block is not full"

    def free_all(self):
        while self.live:
            self.free(0)
            self.check()
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.ref_counts == [0] * self.bm.num_blocks
        check_invariants(self.bm, [])


INDEX = st.integers(0, 63)
OPERATIONS = st.lists(st.one_of(
    st.tuples(st.just("admit"), TOKENS, st.integers(0, 1)),
    st.tuples(st.just("recompute"), INDEX, st.integers(0, 1)),
    st.tuples(st.just("grow"), INDEX, st.integers(0, 1)),
    st.tuples(st.just("grow"), INDEX, st.integers(0, 1)),
    st.tuples(st.just("free"), INDEX),
), min_size=20, max_size=60)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4]), prefix_caching=st.booleans(),
       operations=OPERATIONS)
def test_block_manager_invariants_under_random_operations(num_blocks, block_size, prefix_caching, operations):
    harness = Harness(num_blocks, block_size, prefix_caching)
    for name, *args in operations:
        getattr(harness, name)(*args)
        harness.check()
    harness.free_all()


def test_finished_asynchronous_compaction_keeps_one_private_block_as_the_working_block():
    from zipage.engine.block_manager import BlockManager

    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(16)))
    bm.allocate(seq)  # 4 full blocks, the full ones registered in the prefix cache
    seq.kv_len = 16
    sources, targets, pending = bm.compact(seq, 3, defer_release=True)
    seq.kv_len = 12
    assert len(targets) == 3 and len(pending) == 1 and bm.num_free_blocks == 4
    bm.finish_compaction(seq, pending)
    assert seq.block_table.array().tolist() == targets + pending  # next token goes into the reused block
    assert bm.block_hash[pending[0]] is None and bm.num_free_blocks == 4 and not bm.needs_block(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 8 and bm.ref_counts == [0] * 8
