"""Request bodies of the OpenAI-compatible API and the errors it answers with.

Bodies are parsed by hand (``parse_body``) rather than by FastAPI, so that the API
key is checked before anything else and every error has OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``, naming the value and its range.
Every size a client chooses is bounded by ``RequestLimits`` before work is spent on it.
"""

from __future__ import annotations

import json
import re
import reprlib
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator

from zipage.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 128  # choices per prompt
MAX_JSON_DEPTH = 32  # nesting of lists and objects in a body (the API's own fields need 4)
MAX_SEED = 2**63 - 1 - MAX_N  # seeds are int64 in the sampler, and choice j gets seed + j
MAX_TOP_K = 2**31 - 1

# OpenAI fields the engine cannot honour: accepted only at their neutral values.
NEUTRAL_FIELDS = {
    "echo": (False,), "logit_bias": (None, {}),
    "best_of": (None, 1), "suffix": (None,),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False), "response_format": (None, {"type": "text"}),
}


@dataclass(frozen=True)
class RequestLimits:
    """What one API call may ask for; each is checked before the work it bounds is done.

    ``max_prompt_tokens`` None: the engine's (``max_model_len - 1``, or what the KV cache
    holds); a smaller value refuses longer prompts. ``max_prompt_chars`` None: what
    ``max_prompt_tokens`` could hold at the tokenizer's longest token, so that no prompt that
    could fit is refused by its length alone (``resolve`` sets both).
    """

    max_body_bytes: int = 8 << 20  # a request body (JSON), checked while it is read: 413
    body_timeout_s: float = 60.0  # to receive a whole request body: 408
    max_pending_body_bytes: int = 256 << 20  # request bodies being read or parsed at once, in all: 503
    max_prompt_tokens: int | None = None  # a prompt's tokens
    max_prompt_chars: int | None = None  # a prompt's characters (chat: the rendered template), before tokenizing
    max_messages: int = 4096  # messages in a chat
    max_stop: int = 64  # stop strings; stop token ids
    max_stop_chars: int = 1024  # characters of one stop string
    max_requests_per_call: int = 256  # engine requests of one call: prompts x n

    def __post_init__(self):
        for name in ("max_body_bytes", "max_pending_body_bytes", "max_messages", "max_stop", "max_stop_chars",
                     "max_requests_per_call"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("max_prompt_tokens", "max_prompt_chars"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s!r}")
        if self.max_pending_body_bytes < self.max_body_bytes:
            raise ValueError(f"max_pending_body_bytes ({self.max_pending_body_bytes}) must be at least "
                             f"max_body_bytes ({self.max_body_bytes})")

    def resolve(self, engine_max_prompt_tokens: int, longest_token_chars: int) -> RequestLimits:
        """These limits with the prompt limits set from the engine's and the tokenizer's."""
        tokens = min(self.max_prompt_tokens or engine_max_prompt_tokens, engine_max_prompt_tokens)
        chars = self.max_prompt_chars or tokens * max(1, longest_token_chars)
        return replace(self, max_prompt_tokens=tokens, max_prompt_chars=chars)

    def check_prompt_tokens(self, num_tokens: int, param: str, what: str = "prompt") -> None:
        if self.max_prompt_tokens is not None and num_tokens > self.max_prompt_tokens:
            raise ApiError(400, f"{what} has {num_tokens} tokens; at most {self.max_prompt_tokens} fit the "
                                "context (max_model_len, less one token to generate)", param=param)


class ApiError(Exception):
    """An error answered as an OpenAI-style body with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        param = self.param if self.param is None or len(self.param) <= 80 else self.param[:77] + "..."
        return {"error": {"message": self.message, "type": self.type, "param": param, "code": self.code}}


def _in_range(name: str, value, low=None, high=None, low_open: bool = False):
    if value is None:
        return value
    below = low is not None and (value <= low if low_open else value < low)
    if below or (high is not None and value > high) or value != value:  # value != value: NaN
        lo = "-inf" if low is None else low
        hi = "inf)" if high is None else f"{high}]"
        raise ValueError(f"{name} must be in {'(' if low_open or low is None else '['}{lo}, {hi}, got {_short(value)}")
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
    kv_budget_tokens: int | None = None  # this request's KV budget: a multiple of the block size, <= the server's
    compression: bool = True  # false: full KV for this request

    @field_validator("kv_budget_tokens")
    @classmethod
    def _kv_budget_tokens(cls, v):
        return _in_range("kv_budget_tokens", v, 1)

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
    def _stop(cls, v, info: ValidationInfo):
        if v is None or v == []:
            return []
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {_short(v)}")
        limits = _limits(info)
        if len(stops) > limits.max_stop:
            raise ValueError(f"stop holds {len(stops)} strings; at most {limits.max_stop} are allowed")
        longest = max(len(s) for s in stops)
        if longest > limits.max_stop_chars:
            raise ValueError(f"a stop string has {longest} characters; at most {limits.max_stop_chars} "
                             "are allowed")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v, info: ValidationInfo):
        limits = _limits(info)
        if v is not None and len(v) > limits.max_stop:
            raise ValueError(f"stop_token_ids holds {len(v)} ids; at most {limits.max_stop} are allowed")
        return v

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token the call asks log probabilities for (None: no logprobs)."""
        return None

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
                        frequency_penalty=self.frequency_penalty or 0.0, logprobs=self.num_logprobs,
                        kv_budget_tokens=self.kv_budget_tokens, compression=self.compression))
                except ValueError as error:
                    raise ApiError(400, str(error)) from None
        return params


class CompletionRequest(SamplingRequest):
    prompt: Any
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # log probabilities of each token and of this many alternatives

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        return _in_range("logprobs", v, 0, MAX_LOGPROBS)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v, info: ValidationInfo):
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
        limits = _limits(info)
        if len(v) > limits.max_requests_per_call:  # checked before each prompt is looked at again
            raise ValueError(f"prompt holds {len(v)} prompts; at most {limits.max_requests_per_call} are allowed "
                             "per call")
        for i, p in enumerate(v):
            if isinstance(p, str) and limits.max_prompt_chars is not None and len(p) > limits.max_prompt_chars:
                raise ValueError(f"prompt {i} has {len(p)} characters; at most {limits.max_prompt_chars} "
                                 "can fit the context (max_model_len)")
            if isinstance(p, list) and limits.max_prompt_tokens is not None and len(p) > limits.max_prompt_tokens:
                raise ValueError(f"prompt {i} has {len(p)} tokens; at most {limits.max_prompt_tokens} fit the "
                                 "context (max_model_len, less one token to generate)")
        return v

    @model_validator(mode="after")
    def _requests_per_call(self, info: ValidationInfo):
        _check_requests_per_call(len(self.prompt), self.n, _limits(info))
        return self


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
            other = next((p.get("type") for p in v if p.get("type") != "text"), None)
            if other is not None:
                raise ValueError(f"only text content parts are supported, got type {_short(other)}")
            if all(isinstance(p.get("text"), str) for p in v):
                return "".join(p["text"] for p in v)
        raise ValueError(f"content must be a string or a list of text parts, got {_short(v)}")

    @model_validator(mode="after")
    def _reasoning(self):
        """An earlier answer's thinking, by vLLM's name (``reasoning``) or DeepSeek's
        (``reasoning_content``): a string, given to the template as ``reasoning_content``
        (what Qwen3's template reads; others ignore it)."""
        extra = self.__pydantic_extra__ if self.__pydantic_extra__ is not None else {}
        for name in ("reasoning_content", "reasoning"):
            value = extra.get(name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string or null, got {_short(value)}")
        reasoning = extra.pop("reasoning", None)
        if extra.get("reasoning_content") is None and reasoning is not None:
            extra["reasoning_content"] = reasoning
        return self


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    chat_template_kwargs: dict | None = None  # passed to the chat template (e.g. enable_thinking)
    logprobs: bool | None = False  # log probabilities of each token of the answer
    top_logprobs: int | None = None  # with logprobs: and of this many alternatives

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v):
        return _in_range("top_logprobs", v, 0, MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_count(cls, v, info: ValidationInfo):
        limits = _limits(info)
        if isinstance(v, list) and len(v) > limits.max_messages:  # before each message is validated
            raise ValueError(f"messages holds {len(v)} messages; at most {limits.max_messages} are allowed")
        return v

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
    def _one_max_tokens(self, info: ValidationInfo):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        _check_requests_per_call(1, self.n, _limits(info))
        return self


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = 3, 60, 60, 40


def _short(value) -> str:
    """A bounded repr of a client's value, for an error message (any size, any nesting)."""
    text = _repr.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_DEFAULT_LIMITS = RequestLimits()


def _limits(info: ValidationInfo) -> RequestLimits:
    return (info.context or {}).get("limits", _DEFAULT_LIMITS)


def _check_requests_per_call(num_prompts: int, n: int, limits: RequestLimits) -> None:
    if num_prompts * n > limits.max_requests_per_call:
        raise ValueError(f"{num_prompts} prompt(s) x n={n} make {num_prompts * n} requests; at most "
                         f"{limits.max_requests_per_call} are allowed per call")


_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone half of a UTF-16 pair (JSON's \ud800): not text


def find_surrogate(text: str) -> str | None:
    """The first lone UTF-16 surrogate in ``text`` (which no tokenizer takes), as its escape, or None."""
    match = _SURROGATE.search(text)
    return None if match is None else f"\\u{ord(match.group()):04x}"


def _check_values(data: dict) -> None:
    """Refuse nesting deeper than ``MAX_JSON_DEPTH`` and strings that are not text (lone surrogates).

    One pass without paths (a prompt may hold a million ids); a second, only on failure,
    names the place."""
    if _first_bad_value(data, with_path=False) is None:
        return
    path, problem = _first_bad_value(data, with_path=True)
    raise ApiError(400, f"{path}: {problem}", param=path)


def _first_bad_value(data: dict, with_path: bool):
    for name in data:
        if find_surrogate(name) is not None:
            return _short(name), "a field name holds a lone UTF-16 surrogate, not text"
    stack = [(value, 1, name) for name, value in data.items()]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            bad = find_surrogate(value)
            if bad is not None:
                return path, f"{bad} is a lone UTF-16 surrogate, not text"
            continue
        if depth > MAX_JSON_DEPTH:
            return path, f"the body nests lists and objects deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(value, dict):
            for key, item in value.items():
                if find_surrogate(key) is not None:
                    return path, f"the key {_short(key)} holds a lone UTF-16 surrogate, not text"
                if isinstance(item, (str, list, dict)):
                    stack.append((item, depth + 1, f"{path}.{key}" if with_path and depth < 3 else path))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, (str, list, dict)):
                    stack.append((item, depth + 1, f"{path}.{index}" if with_path and depth < 3 else path))
    return None


def parse_body(raw: bytes, model_class: type[BaseModel], limits: RequestLimits = _DEFAULT_LIMITS):
    """Parse and validate a JSON body, or raise an ``ApiError`` (400) naming the first bad field.

    The body's size is bounded by the caller; this bounds what a body of that size may hold."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the request body nests lists and objects deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
    except ValueError:  # Python's limit on integer digits
        raise ApiError(400, "the request body holds an integer of more than 4300 digits",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    _check_values(data)
    for name, neutral in NEUTRAL_FIELDS.items():
        value = data.get(name)
        if name in data and not any(value == v and isinstance(value, bool) == isinstance(v, bool)
                                    for v in neutral):
            allowed = ", ".join(json.dumps(v) for v in neutral)
            raise ApiError(400, f"{name}={_short(value)} is not supported; allowed: {allowed}", param=name,
                           code="unsupported_parameter")
        data.pop(name, None)
    try:
        return model_class.model_validate(data, context={"limits": limits})
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        if first["type"] == "missing":
            message = f"{param} is required"
        elif first["type"] == "extra_forbidden":
            message = f"unknown parameter {_short(param)}"
        elif first["type"] == "value_error":
            message = str(first["ctx"]["error"])
        else:
            message = f"{param}: {first['msg'].lower()}, got {_short(first.get('input'))}"
        raise ApiError(400, message, param=param) from None
