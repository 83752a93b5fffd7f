"""Which requests compress this step, and into which blocks.

A decoding request may hold at most N blocks. When it holds N and its last
block is full (or more than N, after a long prompt), its next token has nowhere
to go: it is compressed first, keeping k = (N-1) * block_size tokens per layer
and KV head in N-1 target blocks, and then decodes into a fresh working block.
"""

from __future__ import annotations

from dataclasses import dataclass

from zipage.config import CompressionConfig
from zipage.engine.block_manager import BlockManager
from zipage.engine.sequence import Sequence


@dataclass
class CompressionTask:
    """One request's compaction, as planned by the scheduler and executed by the runner."""

    seq: Sequence
    source_blocks: list[int]  # block table before compaction
    target_blocks: list[int]  # N-1 blocks receiving the kept tokens
    num_tokens: int  # cached tokens before compaction (n)
    keep: int  # cached tokens after (k)
    num_previous: int  # leading tokens that carry a history score from the last compression
    last_position: int  # absolute position of the newest cached token (ends the window)
    pool: bool  # max-pool the score at this compression
    protected: int  # leading cached tokens always kept (attention sink, or the prompt with keep_prompt)
    pending_release: list[int]  # source blocks to release once an asynchronous compaction is done


def needs_compression(seq: Sequence, bm: BlockManager, config: CompressionConfig) -> bool:
    n_blocks = len(seq.block_table)
    limit = config.max_blocks_per_seq
    return n_blocks > limit or (n_blocks == limit and bm.needs_block(seq))


def plan_compression(seq: Sequence, bm: BlockManager, config: CompressionConfig,
                     asynchronous: bool = False) -> CompressionTask:
    """Take target blocks for ``seq``; its cache counts as compacted from now on (``kv_len`` is
    the kept length). Its counters change only once the compaction is done (``lifecycle.py``)."""
    num_tokens = seq.kv_len
    sources, targets, pending = bm.compact(seq, config.max_blocks_per_seq - 1, defer_release=asynchronous)
    return CompressionTask(
        seq=seq, source_blocks=sources, target_blocks=targets, num_tokens=num_tokens, keep=seq.kv_len,
        pending_release=pending,
        num_previous=seq.num_scored_tokens,
        last_position=seq.num_tokens - 2,  # the newest token (last sampled) is not cached yet
        # Scores are fresh at the first compression since the cache was (re)computed: pool them.
        pool=config.pooling_width is not None and (seq.num_scored_tokens == 0 or config.pool_every_compression),
        protected=config.protected_tokens(seq.num_prompt_tokens))
