"""Which requests compress this step, and into which blocks.

A decoding request may hold at most N blocks (its own: a request may ask for a smaller
budget than the engine's, or for full KV, see ``request_max_blocks``). When it holds N and its last
block is full (or more than N, after a long prompt), its next token has nowhere
to go: it is compressed first, keeping k = (N-1) * block_size tokens per layer
and KV head in N-1 target blocks, and then decodes into a fresh working block.
"""

from __future__ import annotations

from dataclasses import dataclass

from zipage.config import CompressionConfig
from zipage.engine.block_manager import BlockManager
from zipage.engine.sequence import Sequence
from zipage.sampling_params import ParameterError, SamplingParams


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


def request_max_blocks(config: CompressionConfig | None, block_size: int, params: SamplingParams) -> int | None:
    """N for one request: the most blocks its budget lets it hold while decoding (kept blocks plus
    the working block), or None for full KV (``compression=False``, or an engine without
    compression). A budget must be a multiple of ``block_size``, hold the window (and attention
    sink), and be at most the engine's: ``ParameterError`` (a ``ValueError``) names the value and
    the allowed range."""
    budget = params.kv_budget_tokens
    if config is None:
        if budget is not None:
            raise ParameterError("kv_budget_tokens", f"kv_budget_tokens={budget}: this engine runs without "
                                 "compression (full KV), so a request cannot ask for a budget; start it with a "
                                 "CompressionConfig (--kv-budget-tokens)")
        return None
    if not params.compression:
        return None
    if budget is None:
        return config.max_blocks_per_seq
    low = max(1, -(-(config.window + config.attention_sink) // block_size)) * block_size
    high = config.kv_budget_tokens
    if budget % block_size or not low <= budget <= high:
        raise ParameterError("kv_budget_tokens", f"kv_budget_tokens={budget} must be a multiple of "
                                 f"block_size={block_size} in [{low}, {high}] (at most the engine's budget)")
    return budget // block_size + 1


def needs_compression(seq: Sequence, bm: BlockManager) -> bool:
    """Whether ``seq``'s next token has nowhere to go within its budget (never for full KV)."""
    limit = seq.max_blocks
    if limit is None:
        return False
    n_blocks = len(seq.block_table)
    return n_blocks > limit or (n_blocks == limit and bm.needs_block(seq))


def plan_compression(seq: Sequence, bm: BlockManager, config: CompressionConfig,
                     asynchronous: bool = False) -> CompressionTask:
    """Take target blocks for ``seq``; its cache counts as compacted from now on (``kv_len`` is
    the kept length). Its counters change only once the compaction is done (``lifecycle.py``)."""
    num_tokens = seq.kv_len
    num_targets = seq.max_blocks - 1
    sources, targets, pending = bm.compact(seq, num_targets, defer_release=asynchronous)
    return CompressionTask(
        seq=seq, source_blocks=sources, target_blocks=targets, num_tokens=num_tokens, keep=seq.kv_len,
        pending_release=pending,
        num_previous=seq.num_scored_tokens,
        # The newest cached token: a prompt's last computed one between chunks; while decoding the
        # one before the last sampled (which is not cached yet).
        last_position=seq.num_computed - 1 if seq.prefilling else seq.num_tokens - 2,
        # Scores are fresh at the first compression since the cache was (re)computed: pool them.
        pool=config.pooling_width is not None and (seq.num_scored_tokens == 0 or config.pool_every_compression),
        protected=config.protected_tokens(seq.num_prompt_tokens, num_targets * bm.block_size))
