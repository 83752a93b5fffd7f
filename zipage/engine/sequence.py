"""One request's state as the engine sees it."""

from __future__ import annotations

import enum
import time
from array import array

from zipage.engine.block_table import BlockTable
from zipage.outputs import RequestMetrics
from zipage.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids, KV blocks and progress of one request.

    ``kv_len`` counts the tokens whose keys and values sit in the cache. It equals
    the computed tokens in full-KV mode; compression makes it smaller than the true
    position, which is why positions come from ``num_tokens``, not from ``kv_len``.

    With asynchronous scheduling a step is launched before the previous one's tokens
    reach the host: ``num_pending`` counts the request's sampled tokens whose values
    are still on the device. They count in ``num_tokens`` (positions, blocks, stop by
    length) but are not yet in ``token_ids``.

    ``token_ids`` is an ``array('q')``, not a list: a list of tens of thousands of ids per
    request is walked by every full garbage collection, which made the server's host work
    per step grow with the output; an array is one object the collector does not look into.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, max_tokens: int, seed: int):
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids = array("q", prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved: never runs past the context limit
        self.seed = seed  # sampling noise depends on (seed, output index) only
        self.status = SequenceStatus.WAITING
        self.block_table = BlockTable()
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids
        self.num_registered_blocks = 0  # leading blocks entered in the prefix cache
        self.kv_len = 0
        self.num_pending = 0  # sampled tokens not yet in token_ids (asynchronous scheduling)
        self.num_prefix_hit_tokens = 0  # of the current prefill, served from the prefix cache
        # Prefill progress (``scheduler.py``): a request is ``prefilling`` from its admission until
        # the step holding its last prompt chunk is scheduled; ``num_computed`` counts the leading
        # tokens whose KV is computed or scheduled; ``chunk`` is (first token, tokens) of the
        # chunk in the step being built, None when the request decodes in it.
        self.prefilling = False
        self.num_computed = 0
        self.chunk: tuple[int, int] | None = None
        # Compressed between its prompt's chunks (``CompressionConfig.prefill_compression``): its
        # blocks are taken chunk by chunk, and it compresses before a chunk once it holds N full blocks.
        self.compress_prefill = False
        self.kv_is_token_prefix = True  # False once compaction reorders the cache: no prefix caching
        # compression state (whether a compaction is in flight: ``Compressions.is_compressing``)
        self.max_blocks: int | None = None  # N of its own budget; None: full KV (the scheduler sets it)
        self.query_slot: int | None = None  # row of the query cache saving its window queries
        self.num_scored_tokens = 0  # leading cached tokens carrying a history score
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # with finish_reason "error": what failed
        # SamplingParams.logprobs: one {token id: Logprob} per output token in token_ids
        self.logprobs: list | None = [] if sampling_params.logprobs is not None else None
        self.grammar = None  # SamplingParams.structured_outputs: its matcher (zipage.structured.RequestGrammar)
        self.prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs, once its prefill computed them
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Sampled tokens, the pending ones included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:].tolist()

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prefill must compute the prompt's log probabilities (so no prefix-cache hit)."""
        return self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def samples(self) -> bool:
        """Whether the step being built samples a token for it: it decodes, or its chunk ends
        its prefill (an earlier chunk of a prompt yields no token)."""
        return self.chunk is None or not self.prefilling

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, kv_len={self.kv_len}, "
                f"blocks={len(self.block_table)}, {self.status.value})")
