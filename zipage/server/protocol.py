"""Request bodies of the OpenAI-compatible API and the errors it answers with.

Bodies are parsed by hand (``parse_body``) rather than by FastAPI, so that the API
key is checked before anything else and every error has OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``, naming the value and its range.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from zipage.sampling_params import SamplingParams

MAX_N = 128  # choices per prompt
MAX_SEED = 2**63 - 1 - MAX_N  # seeds are int64 in the sampler, and choice j gets seed + j
MAX_TOP_K = 2**31 - 1

# OpenAI fields the engine cannot honour: accepted only at their neutral values.
NEUTRAL_FIELDS = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (False,), "logit_bias": (None, {}),
    "best_of": (None, 1), "suffix": (None,),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False), "response_format": (None, {"type": "text"}),
}


class ApiError(Exception):
    """An error answered as an OpenAI-style body with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _in_range(name: str, value, low=None, high=None, low_open: bool = False):
    if value is None:
        return value
    below = low is not None and (value <= low if low_open else value < low)
    if below or (high is not None and value > high) or value != value:  # value != value: NaN
        lo = "-inf" if low is None else low
        hi = "inf)" if high is None else f"{high}]"
        raise ValueError(f"{name} must be in {'(' if low_open or low is None else '['}{lo}, {hi}, got {value!r}")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # usage so far in every chunk, one chunk per step (benchmarks)


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM-style extensions)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = 0.0  # null: 0
    frequency_penalty: float | None = 0.0
    # extensions
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v):
        return _in_range("max_tokens", v, 1)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        return _in_range("temperature", v, 0.0, 2.0)

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        return _in_range("top_p", v, 0.0, 1.0, low_open=True)

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        return _in_range("n", v, 1, MAX_N)

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v):
        return _in_range("min_p", v, 0.0, 1.0)

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v):
        return _in_range("min_tokens", v, 0)

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v):
        return _in_range("repetition_penalty", v, 0.0, low_open=True)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _presence_frequency_penalty(cls, v, info):
        return _in_range(info.field_name, v, -2.0, 2.0)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v not in (-1, 0) and not 1 <= v <= MAX_TOP_K:
            raise ValueError(f"top_k must be -1 or 0 (off) or in [1, {MAX_TOP_K}], got {v}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        return _in_range("seed", v, -2**63, MAX_SEED)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None or v == []:
            return []
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {v!r}")
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def sampling_params(self, num_prompts: int) -> list[SamplingParams]:
        """One ``SamplingParams`` per choice, prompt-major; choice ``j`` of a seeded request gets seed + j."""
        params = []
        for _ in range(num_prompts):
            for j in range(self.n):
                try:
                    params.append(SamplingParams(
                        temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        max_tokens=self.max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                        stop=self.stop, stop_token_ids=self.stop_token_ids,
                        include_stop_str_in_output=self.include_stop_str_in_output,
                        skip_special_tokens=self.skip_special_tokens,
                        seed=None if self.seed is None else self.seed + j,
                        repetition_penalty=self.repetition_penalty,
                        presence_penalty=self.presence_penalty or 0.0,
                        frequency_penalty=self.frequency_penalty or 0.0))
                except ValueError as error:
                    raise ApiError(400, str(error)) from None
        return params


class CompletionRequest(SamplingRequest):
    prompt: Any
    max_tokens: int | None = 16  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        """A string, a list of strings, a list of token ids or a list of such lists."""
        def is_ids(x):
            return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        if isinstance(v, str) or is_ids(v):
            v = [v]
        if not isinstance(v, list) or not v or not all(isinstance(p, str) or is_ids(p) for p in v):
            raise ValueError("prompt must be a string, a list of strings, a non-empty list of token ids "
                             f"or a list of such lists, got {_short(v)}")
        for p in v:
            if p == "":
                raise ValueError("prompt is empty: give at least one token")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, ...: passed to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        """A string, or a list of text parts (joined): images and audio are not supported."""
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) for p in v):
            kinds = {p.get("type") for p in v} - {"text"}
            if kinds:
                raise ValueError(f"only text content parts are supported, got type {sorted(map(str, kinds))}")
            if all(isinstance(p.get("text"), str) for p in v):
                return "".join(p["text"] for p in v)
        raise ValueError(f"content must be a string or a list of text parts, got {_short(v)}")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    chat_template_kwargs: dict | None = None  # passed to the chat template (e.g. enable_thinking)

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        if not v:
            raise ValueError("messages must hold at least one message")
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v):
        return _in_range("max_completion_tokens", v, 1)

    @model_validator(mode="after")
    def _one_max_tokens(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_body(raw: bytes, model_class: type[BaseModel]):
    """Parse and validate a JSON body, or raise an ``ApiError`` (400) naming the first bad field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    for name, neutral in NEUTRAL_FIELDS.items():
        value = data.get(name)
        if name in data and not any(value == v and isinstance(value, bool) == isinstance(v, bool)
                                    for v in neutral):
            allowed = ", ".join(json.dumps(v) for v in neutral)
            raise ApiError(400, f"{name}={_short(value)} is not supported; allowed: {allowed}", param=name,
                           code="unsupported_parameter")
        data.pop(name, None)
    try:
        return model_class.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        if first["type"] == "missing":
            message = f"{param} is required"
        elif first["type"] == "extra_forbidden":
            message = f"unknown parameter {param!r}"
        elif first["type"] == "value_error":
            message = str(first["ctx"]["error"])
        else:
            message = f"{param}: {first['msg'].lower()}, got {_short(first.get('input'))}"
        raise ApiError(400, message, param=param) from None
