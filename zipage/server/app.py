"""The OpenAI-compatible HTTP API: completions, chat completions, models, health, metrics.

A chat answer may be read further before it goes out (``zipage.server.tools.ChatAnswers``):
its thinking split off (``--reasoning-parser``), then tool calls taken out of the rest
(``--tool-call-parser`` for ``tool_choice="auto"``; the JSON that structured outputs hold the
output to for ``"required"`` and a named function). A request whose output is held to a
structure from its first token has no thinking to split off: all of it is the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from zipage.engine.llm_engine import LLMEngine
from zipage.server.engine_process import EngineProcess
from zipage.server.async_engine import AsyncEngine, EngineFailed, EngineOverloaded, Generation
from zipage.server.connections import log_accept_errors_at_a_bounded_rate
from zipage.server.metrics import ServerMetrics
from zipage.server.preprocess import Preprocessor
from zipage.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, RequestLimits, SamplingRequest
from zipage.server.logprobs import call_logprobs, call_prompt_logprobs, observers
from zipage.server.reasoning import ReasoningParser, special_ids
from zipage.server.tools import START_TAG, ChatAnswers, HermesParser, NamedCall, RequiredCalls, check_parser_name

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # the hint sent with 503 when the queue is full
STREAM_INTERVAL_S = 0.02  # streamed tokens are sent in chunks at most this often (see AsyncEngine)
SWITCH_INTERVAL_S = None  # the interpreter's switch interval while serving (see AsyncEngine)
PREPROCESS_WORKERS = 2  # threads that parse, render chat templates and tokenize (see Preprocessor)


def create_app(engine: LLMEngine | EngineProcess, model_name: str, api_key: str | None = None,
               max_queued_requests: int = 1024, stream_interval: float = STREAM_INTERVAL_S,
               switch_interval: float | None = SWITCH_INTERVAL_S, limits: RequestLimits | None = None,
               preprocess_workers: int = PREPROCESS_WORKERS, trust_request_chat_template: bool = False,
               escape_special_tokens: bool = True, metrics_need_key: bool = True,
               reasoning_parser: str | None = None, tool_call_parser: str | None = None,
               enable_auto_tool_choice: bool = False) -> FastAPI:
    """An app serving ``engine`` as model ``model_name``: an ``LLMEngine``, stepped on a thread of
    this process while the app runs, or an ``EngineProcess``, stopped when the app stops.

    ``api_key``: every route but ``/health`` (and ``/metrics`` unless ``metrics_need_key``)
    needs ``Authorization: Bearer <api_key>``. ``limits`` bound what one call may ask for
    (``RequestLimits``); ``preprocess_workers``, ``trust_request_chat_template`` and
    ``escape_special_tokens`` are the ``Preprocessor``'s. Streams get their tokens at most
    every ``stream_interval`` seconds (first tokens and ends at once); the interpreter's
    switch interval is ``switch_interval`` while the app runs; see ``AsyncEngine``.
    ``reasoning_parser`` (``qwen3``, ``deepseek_r1``): chat answers carry their thinking apart
    (``message.reasoning``; see ``zipage.server.reasoning``). ``tool_call_parser`` (``hermes``)
    with ``enable_auto_tool_choice``: ``tool_choice="auto"`` reads tool calls out of the answer
    (``message.tool_calls``; see ``zipage.server.tools``); without both, "auto" is refused, as vLLM does.
    """
    check_api_key_value(api_key)
    check_parser_name(tool_call_parser)
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool call parser (--tool-call-parser) to read the calls")
    reasoning = None if reasoning_parser is None else ReasoningParser(reasoning_parser, engine.tokenizer)
    async_engine = AsyncEngine(engine, ServerMetrics(model_name), max_queued_requests, stream_interval,
                               switch_interval)
    preprocessor = Preprocessor(engine.tokenizer, limits or RequestLimits(), engine.max_prompt_tokens,
                                preprocess_workers, trust_request_chat_template, escape_special_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        previous_handler = log_accept_errors_at_a_bounded_rate(loop)
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.stop()
            preprocessor.close()
            loop.set_exception_handler(previous_handler)

    async def check_api_key(request: Request) -> None:
        require_api_key(request, api_key)

    # No /docs: the endpoints parse their bodies themselves.
    app = FastAPI(title="Zipage", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_InternalErrors)
    app.state.engine = async_engine
    app.state.preprocessor = preprocessor
    api = _Api(async_engine, preprocessor, model_name, int(time.time()), reasoning,
               tool_call_parser if enable_auto_tool_choice else None)
    keyed = [Depends(check_api_key)]

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return _error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return _error_response(ApiError(error.status_code, str(error.detail), headers=getattr(error, "headers", None)))

    @app.get("/health")  # open: load balancers probe it without the key
    async def health():
        if async_engine.failure is not None:  # no traceback: the cause's one line, as logged
            raise ApiError(503, f"the engine can run no more steps: {async_engine.failure}", type="server_error")
        if not async_engine.alive:
            raise ApiError(503, "the engine is not running", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics", dependencies=keyed if metrics_need_key else [])
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=keyed)
    async def models():
        return {"object": "list", "data": [api.model_card()]}

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(request: Request):
        return await api.completions(request)

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(request: Request):
        return await api.chat_completions(request)

    return app


def require_api_key(request: Request, api_key: str | None) -> None:
    """A 401 unless the request carries ``Authorization: Bearer <api_key>`` (any request, without a key)."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def check_api_key_value(api_key: str | None) -> None:
    """An API key must be visible ASCII: an empty one would silently turn authentication off."""
    if api_key is None:
        return
    if not isinstance(api_key, str) or not api_key:
        raise ValueError("the API key is empty: give a key, or none to serve without authentication")
    if not all("!" <= c <= "~" for c in api_key):
        raise ValueError("the API key must be printable ASCII without spaces (it travels in an HTTP header)")


class _ErrorJSON(JSONResponse):
    """JSON with every non-ASCII character escaped: an error may quote any string a client sent."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(error: ApiError) -> JSONResponse:
    return _ErrorJSON(error.body(), status_code=error.status, headers=error.headers)


class _InternalErrors:
    """Any exception that escapes a route: a 500 saying "internal error" and an id to find it in the
    log by, never the exception's text (which may hold internals or a client's input)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracking(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception:  # noqa: BLE001 - every route's last resort
            error_id = uuid.uuid4().hex[:16]
            logger.exception("internal error %s on %s %s", error_id, scope.get("method"), scope.get("path"))
            if started:  # a stream broke off: the connection closes without its end
                return
            response = _error_response(ApiError(500, f"internal error (id {error_id})", type="server_error",
                                                headers={"X-Error-Id": error_id}))
            await response(scope, receive, send)


class _BodyBudget:
    """Bytes of request bodies held at once (being read or parsed), across all calls (event loop)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def take(self, num_bytes: int) -> None:
        if self.used + num_bytes > self.limit:
            raise ApiError(503, f"the server holds {self.used} bytes of request bodies, the most it takes at once "
                                f"(max_pending_body_bytes={self.limit}); retry later", type="server_error",
                           code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
        self.used += num_bytes

    def give_back(self, num_bytes: int) -> None:
        self.used -= num_bytes


class _Api:
    """The two generating endpoints: request -> engine requests -> JSON or server-sent events."""

    def __init__(self, engine: AsyncEngine, preprocessor: Preprocessor, model_name: str, created: int,
                 reasoning: ReasoningParser | None = None, auto_tool_parser: str | None = None):
        self.engine = engine
        self.reasoning = reasoning
        self.auto_tool_parser = auto_tool_parser
        # Tool-call tags that skip_special_tokens would drop: auto calls are read with it off (as vLLM).
        self.tool_tags_special = _special_tag(preprocessor.tokenizer, START_TAG)
        self.pre = preprocessor
        self.model_name = model_name
        self.created = created
        self.bodies = _BodyBudget(preprocessor.limits.max_pending_body_bytes)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "zipage",
                "max_model_len": self.engine.engine.config.scheduler.max_model_len}

    def _check_model(self, body: SamplingRequest) -> None:
        if body.model != self.model_name:
            raise ApiError(404, f"model {body.model!r:.80} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def _parse(self, request: Request, model_class):
        """Read the body (within its size, time and the server's budget) and parse it off the loop."""
        limits = self.pre.limits
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise _too_large(limits.max_body_bytes, int(declared))
        chunks: list[bytes] = []
        held = 0

        async def read() -> None:
            nonlocal held
            async for chunk in request.stream():
                if held + len(chunk) > limits.max_body_bytes:
                    raise _too_large(limits.max_body_bytes)
                self.bodies.take(len(chunk))
                held += len(chunk)
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), limits.body_timeout_s)
            raw = b"".join(chunks)
            chunks.clear()
            return await self.pre.run(self.pre.parse, raw, model_class)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                           code="request_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise ApiError(499, "the client closed the connection") from None
        finally:
            self.bodies.give_back(held)

    async def _start(self, body: SamplingRequest, num_prompts: int, encode, prompt_param: str,
                     id_prefix: str) -> tuple[str, Generation]:
        """Admit the call's requests, tokenize its prompts (``encode()``, on a worker thread) and add them.

        A structured output's grammar is compiled there too: the engine finds it in its compiler's
        cache, so that a large schema does not hold up the engine's steps, and every stream with
        them (an engine process compiles it again off its steps: ``engine_process``)."""
        params = body.sampling_params(num_prompts)
        response_id = f"{id_prefix}-{uuid.uuid4().hex}"
        request_ids = [f"{response_id}-{i}" for i in range(len(params))]

        def prepare():
            prompts = encode()
            if params[0].structured_outputs is not None:
                try:
                    self.engine.engine.grammar_compiler().compile(params[0].structured_outputs)
                except ValueError as error:
                    raise ApiError(400, str(error), param=body.structured.param) from None
            return prompts
        try:
            with self.engine.admit(len(params)) as admission:
                prompts = await self.pre.run(prepare)
                expanded = [p for p in prompts for _ in range(body.n)]
                generation = await self.engine.generate(expanded, params, request_ids, admission)
        except ValueError as error:
            param = getattr(error, "param", prompt_param)
            if param == "structured_outputs" and body.structured is not None:
                param = body.structured.param  # the field the request used: response_format, tools
            raise ApiError(400, str(error), param=param) from None
        except EngineOverloaded as error:
            raise ApiError(503, f"the server is overloaded: {error}; retry later", type="server_error",
                           code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineFailed as error:
            raise ApiError(503, str(error), type="server_error") from None
        return response_id, generation

    # -- completions ----------------------------------------------------------
    async def completions(self, request: Request):
        body = await self._parse(request, CompletionRequest)
        self._check_model(body)
        response_id, generation = await self._start(body, len(body.prompt),
                                                    lambda: self.pre.encode_prompts(body.prompt), "prompt", "cmpl")
        if body.stream:
            return _sse(self._completion_events(body, response_id, generation), self.engine, generation)

        logprobs = call_logprobs(body, len(generation.request_ids), chat=False)
        prompt_logprobs = call_prompt_logprobs(body, len(generation.request_ids))

        def choice(index, text, finish_reason):
            made = {"index": index, "text": text, "logprobs": logprobs and logprobs.take(index),
                    "finish_reason": finish_reason}
            if prompt_logprobs is not None:
                made["prompt_logprobs"] = prompt_logprobs.take(index)
            return made
        choices, usage = await _collect(request, self.engine, generation, body, choice,
                                        observers(logprobs and logprobs.observe,
                                                  prompt_logprobs and prompt_logprobs.observe))
        return {"id": response_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage}

    def _completion_events(self, body, response_id, generation):
        logprobs = call_logprobs(body, len(generation.request_ids), chat=False)

        def choice(index, text, finish_reason):
            return {"index": index, "text": text, "logprobs": logprobs and logprobs.take(index),
                    "finish_reason": finish_reason}
        return self._events(body, response_id, "text_completion", generation, choice,
                            observe=logprobs and logprobs.observe)

    async def _events(self, body, response_id, kind, generation, choice, opening=None, observe=None):
        """Lists of stream events, one per batch the engine hands over: ``choice(index, text,
        finish_reason)`` builds a choice of new text (None: no event); ``opening(index)``, if given, a
        first one per choice; ``observe(index, output)``, if given, sees every output first; a final
        usage event when asked."""
        base = {"id": response_id, "object": kind, "created": int(time.time()), "model": self.model_name}
        usage = _Usage(body, generation)
        if opening is not None:
            yield [dict(base, choices=[opening(index)], **usage.field())
                   for index in range(len(generation.request_ids))]
        async for batch in generation.batches():
            events = []
            for index, output in batch:
                out = output.outputs[0]
                usage.add(index, output)
                if observe is not None:
                    observe(index, output)
                if out.text or output.finished or body.continuous_usage:
                    finish_reason = out.finish_reason if output.finished else None
                    event_choice = choice(index, out.text, finish_reason)
                    if event_choice is not None:
                        events.append(dict(base, choices=[event_choice], **usage.field()))
            yield events
        if body.include_usage:
            yield [dict(base, choices=[], usage=usage.total())]

    # -- chat -------------------------------------------------------------------
    async def chat_completions(self, request: Request):
        body = await self._parse(request, ChatCompletionRequest)
        self._check_model(body)
        make_reader = self._tool_reader(body)

        starts_in_reasoning = []

        def encode():
            ids = self.pre.encode_chat(body.template_messages(), body.chat_template_kwargs, body.template_tools())
            if self.reasoning is not None:  # a structured output is all answer: the grammar holds from its start
                starts_in_reasoning.append(body.structured is None and
                                           self.reasoning.starts_in_reasoning(ids, body.chat_template_kwargs))
            return [ids]
        response_id, generation = await self._start(body, 1, encode, "messages", "chatcmpl")
        answers = None
        if self.reasoning is not None or make_reader is not None:
            in_reasoning = bool(starts_in_reasoning) and starts_in_reasoning[0]
            answers = ChatAnswers(len(generation.request_ids), self.reasoning, in_reasoning,
                                  body.skip_special_tokens, make_reader)
        if body.stream:
            return _sse(self._chat_events(body, response_id, generation, answers), self.engine, generation)
        logprobs = call_logprobs(body, len(generation.request_ids), chat=True)
        prompt_logprobs = call_prompt_logprobs(body, len(generation.request_ids))

        def choice(index, text, finish_reason):
            if answers is None:
                message = {"role": "assistant", "content": text}
            else:
                message, finish_reason = answers.message(index), answers.finish_reason(index, finish_reason)
            return {"index": index, "message": message, "logprobs": logprobs and logprobs.take(index),
                    "finish_reason": finish_reason}
        choices, usage = await _collect(request, self.engine, generation, body, choice,
                                        observers(None if answers is None else answers.observe,
                                                  logprobs and logprobs.observe,
                                                  prompt_logprobs and prompt_logprobs.observe))
        response = {"id": response_id, "object": "chat.completion", "created": int(time.time()),
                    "model": self.model_name, "choices": choices, "usage": usage}
        if prompt_logprobs is not None:  # one prompt, whatever n: vLLM's place for it
            response["prompt_logprobs"] = prompt_logprobs.take(0)
        return response

    def _tool_reader(self, body: ChatCompletionRequest):
        """A factory of the tool-call reader of each choice, or None when the answer is not read
        for calls; refuses "auto" when the server reads no calls from free text."""
        mode, parallel = body.tool_mode, body.parallel_tool_calls is not False
        if mode == "auto":
            if self.auto_tool_parser is None:
                raise ApiError(400, 'tool_choice="auto" (the default when tools are given) needs a server started '
                                    "with --enable-auto-tool-choice and --tool-call-parser; this one reads no tool "
                                    'calls from free text: send tool_choice "none", "required" or a named function',
                               param="tool_choice")
            if self.tool_tags_special:
                body.skip_special_tokens = False
            return lambda: HermesParser(parallel)
        if mode == "required":
            return lambda: RequiredCalls(parallel)
        if mode == "named":
            return lambda: NamedCall(body.tool_choice["function"]["name"])
        return None

    def _chat_events(self, body, response_id, generation, answers: ChatAnswers | None = None):
        logprobs = call_logprobs(body, len(generation.request_ids), chat=True)

        def opening(index):
            return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}

        def choice(index, text, finish_reason):
            if answers is None:
                delta = {"content": text} if text else {}
            else:
                delta, finish_reason = answers.delta(index), answers.finish_reason(index, finish_reason)
                if not delta and finish_reason is None and not body.continuous_usage:
                    return None  # all of it held back (a tag's first characters) or a tag alone
            return {"index": index, "delta": delta, "logprobs": logprobs and logprobs.take(index),
                    "finish_reason": finish_reason}
        return self._events(body, response_id, "chat.completion.chunk", generation, choice, opening,
                            observers(None if answers is None else answers.observe, logprobs and logprobs.observe))


def _special_tag(tokenizer, tag: str) -> bool:
    """Whether ``tag`` is one special token (which ``skip_special_tokens`` leaves out of text)."""
    if tokenizer is None:
        return False
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return len(ids) == 1 and ids[0] in special_ids(tokenizer)


def _too_large(limit: int, size: int | None = None) -> ApiError:
    size_text = f"has {size} bytes" if size is not None else f"exceeds {limit} bytes"
    return ApiError(413, f"the request body {size_text}; at most {limit} are allowed", code="request_too_large",
                    headers={"Connection": "close"})


class _Usage:
    """Token counts of a call: each prompt once whatever ``n`` (its first choice's numbers), the
    completion tokens of every choice, and the prompt tokens the prefix cache served."""

    def __init__(self, body: SamplingRequest, generation: Generation):
        self.body, self.generation = body, generation
        self.completion_tokens = 0
        self._metrics: dict[int, object] = {}  # first choice of each prompt -> its engine metrics

    def add(self, index: int, output) -> None:
        self.completion_tokens += len(output.outputs[0].token_ids)
        if index % self.body.n == 0 and output.metrics is not None:
            self._metrics[index] = output.metrics

    def total(self) -> dict:
        prompt_tokens = sum(self.generation.num_prompt_tokens[::self.body.n])
        cached = sum(m.num_cached_prompt_tokens for m in self._metrics.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def field(self) -> dict:
        """A stream chunk's ``usage``: null when a final usage chunk is asked for (as OpenAI does),
        the counts so far with ``continuous_usage_stats``, else absent."""
        if self.body.continuous_usage:
            return {"usage": self.total()}
        return {"usage": None} if self.body.include_usage else {}


async def _collect(request: Request, engine: AsyncEngine, generation: Generation, body: SamplingRequest,
                   make_choice, observe=None):
    """Wait for every choice (aborting them all if the client goes away); return (choices, usage).
    ``observe(index, output)``, if given, sees every output as it comes."""
    texts = [[] for _ in generation.request_ids]
    reasons: list[str | None] = [None] * len(texts)
    usage = _Usage(body, generation)

    async def drain():
        async for index, output in generation:
            texts[index].append(output.outputs[0].text)
            usage.add(index, output)
            if observe is not None:
                observe(index, output)
            if output.finished:
                reasons[index] = output.outputs[0].finish_reason

    drain_task = asyncio.ensure_future(drain())
    gone_task = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({drain_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
        if not drain_task.done():
            raise ApiError(499, "the client closed the connection")
        try:
            drain_task.result()
        except EngineFailed as error:
            raise ApiError(500, str(error), type="server_error") from None
    finally:
        drain_task.cancel()
        gone_task.cancel()
        if generation.unfinished:
            engine.abort(generation.unfinished)
    choices = [make_choice(i, "".join(parts), reason) for i, (parts, reason) in enumerate(zip(texts, reasons))]
    return choices, usage.total()


async def _client_gone(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _EventStream(StreamingResponse):
    """A streamed response that aborts its requests however it ends (the client may leave before
    the first event, when the event generator has not even started)."""

    def __init__(self, events, engine: AsyncEngine, generation: Generation):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.engine, self.generation = engine, generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.generation.unfinished:
                self.engine.abort(self.generation.unfinished)


_encode = json.JSONEncoder(ensure_ascii=False).encode  # built once: json.dumps builds one a call
# Characters that JSON leaves raw but that line splitters such as Python's str.splitlines (and
# so some SSE clients) treat as line ends: escaped, an event is always one line.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def _encode_json(obj) -> str:
    return _encode(obj).translate(_LINE_BREAKS)


def _sse(events, engine: AsyncEngine, generation: Generation) -> StreamingResponse:
    """Server-sent events of JSON chunks, ending with [DONE]; a client that leaves aborts its requests.

    ``events`` yields lists of chunks, those of one hand-over from the engine, sent in one write.
    The event loop runs this for every stream at every hand-over, holding the GIL that an engine
    on a thread of this process needs, so it is kept short.
    """
    async def stream():
        try:
            async for chunks in events:
                if chunks:
                    yield "".join([f"data: {_encode_json(chunk)}\n\n" for chunk in chunks])
        except EngineFailed as error:
            yield f"data: {_encode_json(ApiError(500, str(error), type='server_error').body())}\n\n"
        yield "data: [DONE]\n\n"

    return _EventStream(stream(), engine, generation)
