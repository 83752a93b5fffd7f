"""Request bodies of the OpenAI-compatible API and the errors it answers with.

Bodies are parsed by hand (``parse_body``) rather than by FastAPI, so that the API
key is checked before anything else and every error has OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``, naming the value and its range.
Every size a client chooses is bounded by ``RequestLimits`` before work is spent on it.

Structured outputs (``response_format``, vLLM's ``structured_outputs``, and the JSON schema that
``tool_choice="required"`` or a named function stands for) are checked for shape and size here;
whether a schema, regex or grammar compiles is the engine's to say (``ParameterError``), and the
server names the field the request used (``StructuredSpec.param``).
"""

from __future__ import annotations

import json
import re
import reprlib
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from zipage.sampling_params import MAX_LOGPROBS, SamplingParams
from zipage.server.tools import function_parameters, required_schema

MAX_N = 128  # choices per prompt
MAX_JSON_DEPTH = 32  # nesting of lists and objects in a body (the API's own fields need 4)
MAX_SEED = 2**63 - 1 - MAX_N  # seeds are int64 in the sampler, and choice j gets seed + j
MAX_TOP_K = 2**31 - 1
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function and schema names
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

# OpenAI fields the engine cannot honour: accepted only at their neutral values (unless the
# endpoint's own model takes the field, as chat takes tools).
NEUTRAL_FIELDS = {
    "echo": (False,), "logit_bias": (None, {}),
    "best_of": (None, 1), "suffix": (None,),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),
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
    max_tools: int = 128  # tools of a chat
    max_schema_bytes: int = 64 << 10  # a JSON schema (a tool's parameters, a response format), a grammar, a tag
    max_regex_chars: int = 4096  # characters of a structured-output regex
    max_choices: int = 256  # strings of a structured-output choice

    def __post_init__(self):
        for name in ("max_body_bytes", "max_pending_body_bytes", "max_messages", "max_stop", "max_stop_chars",
                     "max_requests_per_call", "max_tools", "max_schema_bytes", "max_regex_chars", "max_choices"):
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


class ParamError(ValueError):
    """A bad value that a validator names by a field other than its own (``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredSpec:
    """What a request's output is held to: ``kwargs`` of ``StructuredOutputsParams``, and the
    field that asked for it (``param``: an error compiling it names that field)."""

    kwargs: dict
    param: str

    def params(self):
        from zipage.structured import StructuredOutputsParams

        try:
            return StructuredOutputsParams(**self.kwargs)
        except ValueError as error:
            raise ApiError(400, str(error), param=self.param) from None


def _json_bytes(value) -> int:
    return len(value.encode()) if isinstance(value, str) else len(json.dumps(value, separators=(",", ":")).encode())


def check_schema(param: str, schema, limits: RequestLimits) -> None:
    """A JSON schema: an object, within ``max_schema_bytes`` (whether it compiles is the engine's to say)."""
    if not isinstance(schema, dict):
        raise ParamError(param, f"{param} must be a JSON schema (an object), got {_short(schema)}")
    size = _json_bytes(schema)
    if size > limits.max_schema_bytes:
        raise ParamError(param, f"{param} is a schema of {size} bytes; at most {limits.max_schema_bytes} are "
                                "allowed (max_schema_bytes)")


def _check_text(param: str, value, limit: int, limit_name: str, unit: str = "bytes") -> None:
    if not isinstance(value, str) or not value:
        raise ParamError(param, f"{param} must be a non-empty string, got {_short(value)}")
    size = _json_bytes(value) if unit == "bytes" else len(value)
    if size > limit:
        raise ParamError(param, f"{param} has {size} {unit}; at most {limit} are allowed ({limit_name})")


def parse_response_format(value, limits: RequestLimits) -> StructuredSpec | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
    or ``{"type": "json_schema", "json_schema": {"name", "schema", "description", "strict"}}``."""
    if value is None:
        return None
    kinds = '"text", "json_object" or "json_schema"'
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        got = value.get("type") if isinstance(value, dict) else value
        raise ParamError("response_format.type", f"response_format.type must be {kinds}, got {_short(got)}")
    kind = value["type"]
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    for key in value:
        if key not in allowed:
            raise ParamError(f"response_format.{key}", f"unknown parameter response_format.{_short(key)} for "
                                                       f"type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":  # an object, as OpenAI's (xgrammar's built-in JSON grammar takes any value)
        return StructuredSpec({"json": {"type": "object"}}, "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ParamError("response_format.json_schema", "response_format.json_schema must be an object "
                                                        f'{{"name", "schema", ...}}, got {_short(spec)}')
    for key in spec:
        if key not in ("name", "schema", "description", "strict"):
            raise ParamError(f"response_format.json_schema.{key}",
                             f"unknown parameter response_format.json_schema.{_short(key)}; allowed: name, schema, "
                             "description, strict")
    name = spec.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ParamError("response_format.json_schema.name", "response_format.json_schema.name must be 1 to 64 "
                                                             f"letters, digits, _ or -, got {_short(name)}")
    for key, kind_ok, what in (("description", lambda v: isinstance(v, str), "a string"),
                               ("strict", lambda v: isinstance(v, bool), "true or false")):
        if spec.get(key) is not None and not kind_ok(spec[key]):
            raise ParamError(f"response_format.json_schema.{key}",
                             f"response_format.json_schema.{key} must be {what}, got {_short(spec[key])}")
    if "schema" not in spec:
        raise ParamError("response_format.json_schema.schema", "response_format.json_schema.schema is required")
    check_schema("response_format.json_schema.schema", spec["schema"], limits)
    return StructuredSpec({"json": spec["schema"]}, "response_format")


def parse_structured_outputs(value, limits: RequestLimits) -> StructuredSpec | None:
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, or its JSON text), ``regex``,
    ``choice`` (strings), ``grammar`` (EBNF, xgrammar's syntax), ``json_object`` (true) and
    ``structural_tag`` (xgrammar's, as JSON text)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ParamError("structured_outputs", "structured_outputs must be an object with one of "
                                               f"{', '.join(STRUCTURED_KINDS)}, got {_short(value)}")
    for key in value:
        if key not in STRUCTURED_KINDS:
            raise ParamError(f"structured_outputs.{key}", f"unknown parameter structured_outputs.{_short(key)}; "
                                                          f"allowed: {', '.join(STRUCTURED_KINDS)}")
    given = [k for k in STRUCTURED_KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(given) != 1:
        raise ParamError("structured_outputs", "structured_outputs must give exactly one of "
                                               f"{', '.join(STRUCTURED_KINDS)}; got {len(given)}"
                                               + (f" ({', '.join(given)})" if given else ""))
    kind = given[0]
    item, param = value[kind], f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(item, str):
            _check_text(param, item, limits.max_schema_bytes, "max_schema_bytes")
            try:
                schema = json.loads(item)
            except (ValueError, RecursionError):
                raise ParamError(param, f"{param} must be a JSON schema or its JSON text; the text is not "
                                        "JSON") from None
            check_schema(param, schema, limits)
        else:
            check_schema(param, item, limits)
    elif kind == "regex":
        _check_text(param, item, limits.max_regex_chars, "max_regex_chars", unit="characters")
    elif kind == "choice":
        _check_choice(item, limits)
    elif kind == "json_object":
        if item is not True:
            raise ParamError(param, f"{param} must be true or false, got {_short(item)}")
    else:  # grammar, structural_tag
        _check_text(param, item, limits.max_schema_bytes, "max_schema_bytes")
    return StructuredSpec({kind: list(item) if kind == "choice" else item}, "structured_outputs")


def _check_choice(choices, limits: RequestLimits) -> None:
    param = "structured_outputs.choice"
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ParamError(param, f"{param} must be a non-empty list of non-empty strings, got {_short(choices)}")
    if len(choices) > limits.max_choices:
        raise ParamError(param, f"{param} holds {len(choices)} strings; at most {limits.max_choices} are allowed "
                                "(max_choices)")
    size = sum(_json_bytes(c) for c in choices)
    if size > limits.max_schema_bytes:
        raise ParamError(param, f"{param} holds {size} bytes; at most {limits.max_schema_bytes} are allowed "
                                "(max_schema_bytes)")


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
    thinking_token_budget: int | None = None  # most thinking tokens, then </think> is forced
    prompt_logprobs: int | None = None  # the prompt's log probabilities and this many alternatives (not streamed)
    compression: bool = True  # false: full KV for this request
    response_format: Any = None  # OpenAI's: json_object, json_schema (structured outputs)
    structured_outputs: Any = None  # vLLM's: json, regex, choice, grammar, json_object, structural_tag

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v, info: ValidationInfo):
        return parse_response_format(v, _limits(info))

    @field_validator("structured_outputs")
    @classmethod
    def _structured_outputs(cls, v, info: ValidationInfo):
        return parse_structured_outputs(v, _limits(info))

    @model_validator(mode="after")
    def _one_structure(self):
        if self.response_format is not None and self.structured_outputs is not None:
            raise ParamError("structured_outputs", "give response_format or structured_outputs, not both")
        return self

    @property
    def structured(self) -> StructuredSpec | None:
        """What the output is held to, if anything."""
        return self.response_format or self.structured_outputs

    @field_validator("kv_budget_tokens")
    @classmethod
    def _kv_budget_tokens(cls, v):
        return _in_range("kv_budget_tokens", v, 1)

    @field_validator("thinking_token_budget")
    @classmethod
    def _thinking_token_budget(cls, v):
        return _in_range("thinking_token_budget", v, 0)

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, v):
        return _in_range("prompt_logprobs", v, 0, MAX_LOGPROBS)

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.prompt_logprobs is not None and self.stream:
            raise ParamError("prompt_logprobs", f"prompt_logprobs={self.prompt_logprobs} is returned in a "
                                                "non-streamed response only: set stream to false")
        return self

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
        structured = self.structured
        extra = {} if structured is None else {"structured_outputs": structured.params()}
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
                        kv_budget_tokens=self.kv_budget_tokens, compression=self.compression,
                        thinking_token_budget=self.thinking_token_budget, prompt_logprobs=self.prompt_logprobs,
                        **extra))
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


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not FUNCTION_NAME.fullmatch(v):
            raise ValueError(f"a function name must be 1 to 64 letters, digits, _ or -, got {_short(v)}")
        return v

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v, info: ValidationInfo):
        if v is not None:
            try:
                check_schema("parameters", v, _limits(info))
            except ParamError as error:  # named by its place in the body instead
                raise ValueError(str(error)) from None
        return v


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str | dict  # OpenAI sends JSON text; the template gets it parsed (as vLLM does)


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made, sent back with the conversation."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, ...: passed to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

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
    tools: list[Tool] | None = None  # functions the model may call, rendered by the chat template
    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None  # false: at most one call
    _tool_structured: StructuredSpec | None = PrivateAttr(None)

    @field_validator("tools", mode="before")
    @classmethod
    def _tools_count(cls, v, info: ValidationInfo):
        limits = _limits(info)
        if isinstance(v, list) and len(v) > limits.max_tools:  # before each tool is validated
            raise ValueError(f"tools holds {len(v)} tools; at most {limits.max_tools} are allowed (max_tools)")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        names = [tool.function.name for tool in v or []]
        twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
        if twice is not None:
            raise ValueError(f"tools names the function {twice!r} twice")
        return v or None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v is None or v in ("none", "auto", "required"):
            return v
        usage = 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        if not isinstance(v, dict) or set(v) != {"type", "function"} or v["type"] != "function":
            raise ValueError(f"{usage}, got {_short(v)}")
        function = v["function"]
        if not isinstance(function, dict) or set(function) != {"name"} or not isinstance(function["name"], str):
            raise ValueError(f"{usage}, got {_short(v)}")
        return {"type": "function", "function": {"name": function["name"]}}

    @model_validator(mode="after")
    def _tool_use(self, info: ValidationInfo):
        """The tool choice against the tools (``tool_choice`` defaults to "auto" with tools, "none"
        without, as OpenAI's); "required" and a named function hold the output to a JSON schema."""
        choice = self.tool_choice
        if choice is None or (choice == "auto" and self.tools is None):
            choice = "auto" if self.tools else "none"
        if choice != "none" and self.tools is None:
            raise ParamError("tool_choice", f"tool_choice={_short(choice)} needs tools; none were given")
        names = [tool.function.name for tool in self.tools or []]
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise ParamError("tool_choice", f"tool_choice names the function {_short(choice['function']['name'])}, "
                                            f"which is not among tools: {_short(', '.join(names))}")
        self.tool_choice = choice
        if choice in ("none", "auto"):
            return self
        if self.structured is not None:
            param = "response_format" if self.response_format is not None else "structured_outputs"
            raise ParamError(param, f"{param} cannot be combined with tool_choice={_short(choice)}, which holds the "
                                    "output to the tools' schema")
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools]
        if choice == "required":
            schema = required_schema(tools, self.parallel_tool_calls is not False)
        else:
            schema = function_parameters(next(t for t in tools if t["function"]["name"] == choice["function"]["name"]))
        size, limit = _json_bytes(schema), _limits(info).max_schema_bytes
        if size > limit:
            raise ParamError("tools", f"tool_choice={_short(choice)} holds the output to a schema of the tools' "
                                      f"parameters of {size} bytes; at most {limit} are allowed (max_schema_bytes)")
        self._tool_structured = StructuredSpec({"json": schema}, "tools")
        return self

    @property
    def structured(self) -> StructuredSpec | None:
        return self.response_format or self.structured_outputs or self._tool_structured

    @property
    def tool_mode(self) -> str:
        """How the answer is read for tool calls: "none", "auto", "required" or "named"."""
        return "named" if isinstance(self.tool_choice, dict) else self.tool_choice

    def template_messages(self) -> list[dict]:
        """The messages as the chat template gets them: the arguments of earlier calls parsed
        from JSON text into objects (templates write them with ``tojson``), as vLLM does."""
        messages = [m.model_dump(exclude_none=True) for m in self.messages]
        for message in messages:
            for call in message.get("tool_calls", ()):
                arguments = call["function"]["arguments"]
                if isinstance(arguments, str):
                    try:
                        parsed = json.loads(arguments)
                    except (ValueError, RecursionError):
                        continue  # left as text: a template writes a string as it is
                    if isinstance(parsed, dict):
                        call["function"]["arguments"] = parsed
        return messages

    def template_tools(self) -> list[dict] | None:
        return None if self.tools is None else [tool.model_dump(exclude_none=True) for tool in self.tools]

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
        if name in model_class.model_fields:
            continue
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
            param = getattr(first["ctx"]["error"], "param", param)
        else:
            message = f"{param}: {first['msg'].lower()}, got {_short(first.get('input'))}"
        raise ApiError(400, message, param=param) from None
