"""What ``LLM.generate`` returns, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.perf_counter``) and counters of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0
    num_compressions: int = 0
    peak_blocks: int = 0  # most KV blocks held at once while decoding
    evicted_tokens: int = 0  # per layer and KV head, over all compressions

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        """Seconds from the first output token to the last."""
        if self.first_token_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.first_token_time


@dataclass
class Logprob:
    """One token's log probability at one position (vLLM's ``Logprob``)."""

    logprob: float  # natural log; -inf for a token the processed distribution excludes
    rank: int  # 1 = the most likely token at that position
    decoded_token: str | None = None  # the token alone, decoded


# One position: the sampled token and the k most likely ones (k or k + 1 entries), by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # With ``SamplingParams(logprobs=k)``: one entry per token of ``token_ids``, else None.
    logprobs: list[PositionLogprobs] | None = None


@dataclass
class RequestOutput:
    """One request's result. A request added with ``stream=True`` gets one per step instead, each
    holding only what is new: the prompt ids in its first, then the new text and token ids."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)
    error: str | None = None  # why the request failed (finish_reason "error"): the step that raised, and how
    # With ``SamplingParams(prompt_logprobs=k)``: one entry per prompt token, None for the first (it has
    # no context), else the prompt token's and the k most likely tokens'. In a stream: the first output.
    prompt_logprobs: list[PositionLogprobs | None] | None = None


class RequestsFailed(RuntimeError):
    """Some requests of a ``generate`` call failed in the engine; the others completed.

    ``outputs`` holds every request's output in input order; a failed one has
    ``finish_reason == "error"`` and its ``error`` says which step raised and how (the
    traceback is in the log)."""

    def __init__(self, outputs: list[RequestOutput]):
        self.outputs = outputs
        failed = [o for o in outputs if o.error is not None]
        shown = "; ".join(f"request {o.request_id}: {o.error}" for o in failed[:3])
        more = f" (and {len(failed) - 3} more)" if len(failed) > 3 else ""
        super().__init__(f"{len(failed)} of {len(outputs)} requests failed: {shown}{more}")
