"""Where KV lives: the block pool, reference counts, block tables and the prefix cache.

The block manager is the only writer of a request's block table and of ``kv_len``
(the tokens whose keys and values sit in its blocks).

Full blocks are identified by a chained hash of their token ids (each block's
hash covers every token before it too), so equal hashes mean equal prefixes. A
prefill's full blocks are cached as soon as it is scheduled, so that requests
admitted in the same step share them; those entries are provisional until the step
is known to have run: a failed step withdraws them (``withdraw``) before any later
step can hit them. A block that decoding fills is cached only once the step that
wrote its last token's KV has been read back. A freed block keeps its hash and
contents until the pool hands it out again; a later request with the same prefix
takes it back without recomputing it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from zipage.engine.sequence import Sequence


def chain_hash(previous: int | None, token_ids) -> int:
    """128-bit hash of one block's tokens, chained to the hash of the block before."""
    h = xxhash.xxh3_128()
    if previous is not None:
        h.update(previous.to_bytes(16, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 min_recomputed_tokens: int = 1):
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # A prefill always computes at least this many trailing tokens: the last one for its
        # logits, with compression the whole observation window for its queries.
        self.min_recomputed_tokens = min_recomputed_tokens
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Free blocks, least recently freed first: reuse evicts the oldest cached content.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_hit_tokens = 0  # lifetime counters, for statistics
        self.prefix_query_tokens = 0
        self.new_entries: list[tuple[int, int]] = []  # (hash, block) cached by prefills since the last take

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    # -- prefix cache -----------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Chained hashes of the first ``num_full_blocks`` blocks of ``seq.token_ids``."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else None, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_full_blocks]

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding a leading run of ``seq``'s full blocks.

        The last ``min_recomputed_tokens`` tokens are always recomputed (the last
        one's logits are needed), so a fully cached prompt still leaves its last
        block to compute. A request that wants its prompt's log probabilities needs the
        logits of every prompt token: it gets no cached prefix.
        """
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        blocks = []
        for h in self._block_hashes(seq, max(0, seq.num_tokens - self.min_recomputed_tokens) // self.block_size):
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """How many of ``seq``'s tokens the prefix cache would serve now."""
        return len(self._cached_prefix(seq)) * self.block_size

    def register_computed(self, seq: Sequence, num_computed: int) -> None:
        """Enter in the prefix cache the full blocks among ``seq``'s first ``num_computed`` tokens,
        whose KV is known to be written (the steps that computed it were read back)."""
        self._register(seq, min(num_computed, seq.kv_len) // self.block_size)

    def take_new_entries(self) -> list[tuple[int, int]]:
        """The provisional entries of the prefills scheduled since the last call."""
        entries, self.new_entries = self.new_entries, []
        return entries

    def withdraw(self, entries: list[tuple[int, int]]) -> None:
        """Remove prefix-cache entries whose KV was never computed (their step failed)."""
        for h, block_id in entries:
            if self.hash_to_block.get(h) == block_id:
                del self.hash_to_block[h]
                self.block_hash[block_id] = None

    def _register(self, seq: Sequence, num_full: int, provisional: bool = False) -> None:
        if (not self.enable_prefix_caching or not seq.kv_is_token_prefix
                or num_full <= seq.num_registered_blocks):
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block_id = seq.block_table[i]
            if hashes[i] not in self.hash_to_block and self.block_hash[block_id] is None:
                self.hash_to_block[hashes[i]] = block_id
                self.block_hash[block_id] = hashes[i]
                if provisional:
                    self.new_entries.append((hashes[i], block_id))
        seq.num_registered_blocks = num_full

    # -- allocation -------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        stale = self.block_hash[block_id]
        if stale is not None:  # its old contents are about to be overwritten
            del self.hash_to_block[stale]
            self.block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``seq`` (waiting) can get blocks for all its tokens now."""
        return self.allocatable_tokens(seq) >= seq.num_tokens

    def allocatable_tokens(self, seq: Sequence) -> int:
        """How many leading tokens of ``seq`` (waiting) could get blocks now: its cached prefix
        and what the free pool holds beyond the cached blocks it would take back."""
        cached = self._cached_prefix(seq)
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)  # cached but in the free pool
        return (len(cached) + self.num_free_blocks - revived) * self.block_size

    def allocate(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Give ``seq`` blocks for its first ``num_tokens`` tokens (default: all), reusing cached
        prefix blocks."""
        assert len(seq.block_table) == 0, f"{seq} already holds blocks"
        seq.kv_is_token_prefix = True
        cached = self._cached_prefix(seq)
        for block_id in cached:
            if self.ref_counts[block_id] == 0:
                del self.free_blocks[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        upto = seq.num_tokens if num_tokens is None else num_tokens
        for _ in range(self._blocks_for(upto) - len(cached)):
            seq.block_table.append(self._take_free_block())
        seq.num_prefix_hit_tokens = len(cached) * self.block_size
        seq.num_registered_blocks = len(cached)
        seq.kv_len = seq.num_computed = seq.num_prefix_hit_tokens
        seq.prefilling = True
        self.prefix_hit_tokens += seq.num_prefix_hit_tokens
        self.prefix_query_tokens += seq.num_tokens

    def room(self, seq: Sequence) -> int:
        """Tokens ``seq`` could cache beyond ``kv_len`` now: the rest of its blocks and the free pool."""
        return (len(seq.block_table) + self.num_free_blocks) * self.block_size - seq.kv_len

    def extend(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` the blocks its next ``num_tokens`` tokens need (a prompt taken chunk by chunk)."""
        for _ in range(self._blocks_for(seq.kv_len + num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())

    def schedule_chunk(self, seq: Sequence, num_tokens: int) -> None:
        """The step being built computes the next ``num_tokens`` of ``seq``'s prompt (allocated).

        The full blocks the chunk completes are cached now, so that requests admitted in the
        same step share them: every layer stores the step's KV before attention reads it. Blocks
        of later chunks are not: their KV does not exist yet."""
        start = seq.num_computed
        assert 0 < num_tokens <= len(seq.token_ids) - start, f"{seq}: a chunk of {num_tokens} tokens from {start}"
        seq.chunk = (start, num_tokens)
        seq.num_computed = start + num_tokens
        seq.prefilling = seq.num_computed < len(seq.token_ids)
        self._register(seq, seq.num_computed // self.block_size, provisional=True)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; unreferenced blocks return to the pool."""
        # Tail first, so the pool reuses a request's tail before its (shareable) head.
        self.release(seq.block_table.array().tolist()[::-1])
        seq.block_table.clear()
        seq.kv_len = seq.num_computed = 0
        seq.num_registered_blocks = 0
        seq.prefilling, seq.chunk = False, None

    def needs_block(self, seq: Sequence) -> bool:
        """Whether the next token of ``seq`` starts a new block."""
        return seq.kv_len == len(seq.block_table) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        return not self.needs_block(seq) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room in ``seq``'s block table for its next token."""
        if self.needs_block(seq):
            seq.block_table.append(self._take_free_block())

    def cache_step(self, seq: Sequence) -> None:
        """A step that computes ``seq``'s tokens was launched: count their KV as cached
        (a prefill chunk's tokens, or a decode's one input token)."""
        seq.kv_len += seq.chunk[1] if seq.chunk is not None else 1

    # -- compaction (compression) -----------------------------------------
    def _fresh_targets_needed(self, seq: Sequence, num_targets: int) -> int:
        return sum(1 for b in seq.block_table.array()[:num_targets].tolist() if self.ref_counts[b] > 1)

    def can_compact(self, seq: Sequence, num_targets: int) -> bool:
        """Whether the pool has fresh blocks for every shared block among the targets."""
        return self._fresh_targets_needed(seq, num_targets) <= self.num_free_blocks

    def compact(self, seq: Sequence, num_targets: int, defer_release: bool = False):
        """Give ``seq`` ``num_targets`` blocks to compact its kept tokens into.

        A shared leading block is never written: it is swapped for a fresh block and
        the request drops its reference, so others keep reading it. Private blocks are
        reused in place (their prefix-cache entry is dropped, their contents change);
        the rest are released. The compaction must read the sources before anything
        writes a released block: a synchronous compaction runs before the step's
        forward, so its blocks are released at once; an asynchronous one overlaps
        other requests' decoding, so with ``defer_release`` the request keeps its
        references until ``release`` is called when the compaction has finished.
        Returns (source blocks, target blocks, blocks still to release).
        """
        sources = seq.block_table.array().tolist()
        targets = []
        for block_id in sources[:num_targets]:
            if self.ref_counts[block_id] > 1:
                targets.append(self._take_free_block())
            else:
                stale = self.block_hash[block_id]
                if stale is not None:
                    del self.hash_to_block[stale]
                    self.block_hash[block_id] = None
                targets.append(block_id)
        kept = set(targets)
        dropped = [b for b in sources if b not in kept]
        seq.block_table.replace(targets)
        seq.kv_len = num_targets * self.block_size
        seq.kv_is_token_prefix = False
        seq.num_registered_blocks = 0
        if defer_release:
            return sources, targets, dropped
        self.release(dropped)
        return sources, targets, []

    def finish_compaction(self, seq: Sequence, pending: list[int]) -> None:
        """An asynchronous compaction of ``seq`` is done: release the blocks it still read.

        If ``seq``'s next token needs a new block, one of those (a private one) becomes that
        block instead of going back to the pool, where the next admission could take it and
        force a preemption to find ``seq`` another. Its old contents are dead: its
        prefix-cache entry is dropped.
        """
        if self.needs_block(seq):
            for i, block_id in enumerate(pending):
                if self.ref_counts[block_id] == 1:  # only seq's deferred reference
                    stale = self.block_hash[block_id]
                    if stale is not None:
                        del self.hash_to_block[stale]
                        self.block_hash[block_id] = None
                    seq.block_table.append(block_id)
                    pending = pending[:i] + pending[i + 1:]
                    break
        self.release(pending)

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; unreferenced blocks return to the pool."""
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                self.free_blocks[block_id] = None
