"""Per-request sampling settings, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

MAX_LOGPROBS = 20  # most alternatives per token (vLLM's default max_logprobs)


@dataclass(init=False)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature=0`` is greedy decoding. ``seed`` makes a request's samples
    depend only on the seed and the token position, not on the rest of the batch.
    ``kv_budget_tokens`` (a multiple of the block size, at most the engine's budget) gives this
    request a smaller KV budget than the engine's; ``compression=False`` gives it full KV.
    Penalties (vLLM's and OpenAI's meaning): ``repetition_penalty`` divides the positive
    logits (multiplies the others) of every token of the prompt or the output so far;
    ``frequency_penalty`` is subtracted once per occurrence of a token in the output,
    ``presence_penalty`` once if it occurs there.
    ``logprobs=k``: each output token's log probability, its rank, and the ``k`` most likely
    tokens' (``CompletionOutput.logprobs``); ``k`` in ``[0, MAX_LOGPROBS]``, None for none.
    ``prompt_logprobs=k``: the same for every prompt token after the first
    (``RequestOutput.prompt_logprobs``), from the model's raw logits; such a request's prompt is
    computed whole (it is not served from the prefix cache).
    ``structured_outputs``: what the output must match (a JSON schema, a regular expression, a
    choice, a grammar; ``zipage.structured.StructuredOutputsParams`` or a dict of its fields).
    ``thinking_token_budget=N``: at most N tokens of thinking (between ``<think>`` and
    ``</think>``); the next one is ``</think>``, forced, and the answer follows.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    kv_budget_tokens: int | None = None  # this request's compression budget (None: the engine's)
    compression: bool = True  # False: full KV for this request (never compressed)
    logprobs: int | None = None  # alternatives per output token (None: no logprobs)
    prompt_logprobs: int | None = None  # alternatives per prompt token (None: none)
    structured_outputs: object = None  # zipage.structured.StructuredOutputsParams, or None
    thinking_token_budget: int | None = None  # most tokens between <think> and </think> (None: no limit)

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 min_p: float = 0.0, max_tokens: int | None = 16, min_tokens: int = 0,
                 ignore_eos: bool = False, stop: str | list[str] | None = None,
                 stop_token_ids: list[int] | None = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 seed: int | None = None, repetition_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 kv_budget_tokens: int | None = None, compression: bool = True,
                 logprobs: int | None = None, prompt_logprobs: int | None = None, structured_outputs=None,
                 thinking_token_budget: int | None = None, **unknown):
        if unknown:
            allowed = ", ".join(f.name for f in fields(self))
            raise ValueError(f"unknown sampling parameter(s) {sorted(unknown)}; allowed: {allowed}")
        self.temperature = _number("temperature", temperature, low=0.0)
        self.top_p = _number("top_p", top_p, low=0.0, high=1.0, low_open=True)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or (top_k < 1 and top_k not in (-1, 0)):
            raise ValueError(f"top_k must be -1 or 0 (disabled) or an integer >= 1, got {top_k!r}")
        self.top_k = top_k if top_k > 0 else -1
        self.min_p = _number("min_p", min_p, low=0.0, high=1.0)
        if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None for the model's limit), got {max_tokens!r}")
        self.max_tokens = max_tokens
        if not _is_int(min_tokens) or min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {min_tokens!r}")
        if max_tokens is not None and min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")
        self.min_tokens = min_tokens
        self.ignore_eos = bool(ignore_eos)
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        stop = list(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}")
        self.stop = stop
        stop_token_ids = list(stop_token_ids or [])
        if any(not _is_int(t) or t < 0 for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {stop_token_ids!r}")
        self.stop_token_ids = stop_token_ids
        self.include_stop_str_in_output = bool(include_stop_str_in_output)
        self.skip_special_tokens = bool(skip_special_tokens)
        if seed is not None and not (_is_int(seed) and -2**63 <= seed <= 2**63 - 1):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**63 - 1] (int64), got {seed!r}")
        self.seed = seed
        self.repetition_penalty = _number("repetition_penalty", repetition_penalty, low=0.0, low_open=True)
        self.presence_penalty = _number("presence_penalty", presence_penalty, low=-2.0, high=2.0)
        self.frequency_penalty = _number("frequency_penalty", frequency_penalty, low=-2.0, high=2.0)
        if logprobs is not None and not (_is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}")
        self.logprobs = logprobs
        if prompt_logprobs is not None and not (_is_int(prompt_logprobs) and 0 <= prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {prompt_logprobs!r}")
        self.prompt_logprobs = prompt_logprobs
        # Per-request compression: the engine checks the budget against its own (``request_max_blocks``).
        if kv_budget_tokens is not None and (not _is_int(kv_budget_tokens) or kv_budget_tokens < 1):
            raise ValueError(f"kv_budget_tokens must be None (the engine's budget) or an integer >= 1, "
                             f"got {kv_budget_tokens!r}")
        if not isinstance(compression, bool):
            raise ValueError(f"compression must be True or False, got {compression!r}")
        if kv_budget_tokens is not None and not compression:
            raise ValueError(f"kv_budget_tokens={kv_budget_tokens} asks for compression, but compression=False "
                             "asks for full KV: give one of them")
        self.kv_budget_tokens = kv_budget_tokens
        self.compression = compression
        self.structured_outputs = _structured(structured_outputs)
        if thinking_token_budget is not None and not (_is_int(thinking_token_budget) and thinking_token_budget >= 0):
            raise ValueError(f"thinking_token_budget must be None (no limit) or an integer >= 0, "
                             f"got {thinking_token_budget!r}")
        self.thinking_token_budget = thinking_token_budget

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty is away from its neutral value (the request needs a penalty row)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class ParameterError(ValueError):
    """A bad value of one request parameter that only the engine can judge (a budget over its own):
    ``param`` names it, so that the server's 400 does."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled whole: an engine process replies with it
        return type(self), (self.param, str(self))


def _structured(value):
    """``structured_outputs`` as ``StructuredOutputsParams`` (a dict of its fields is accepted)."""
    from zipage.structured import StructuredOutputsParams  # imports this module

    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        try:
            return StructuredOutputsParams(**value)
        except TypeError as error:
            raise ValueError(f"structured_outputs: {error}") from None
    raise ValueError(f"structured_outputs must be StructuredOutputsParams, a dict of its fields or None, "
                     f"got {type(value).__name__}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(name: str, value, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> float:
    """``value`` as a float, or ``ValueError`` naming ``name``, the value and the allowed range."""
    allowed = f"{'(' if low_open else '['}{low}, " + (f"{high}]" if high is not None else "inf)")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number in {allowed}, got {value!r}")
    below = value <= low if low_open else value < low
    if (low is not None and below) or (high is not None and value > high):
        raise ValueError(f"{name} must be in {allowed}, got {value!r}")
    return float(value)
