"""The OpenAI-compatible HTTP API: completions, chat completions, models, health, metrics."""

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

from zipage.engine.llm_engine import LLMEngine
from zipage.server.async_engine import AsyncEngine, EngineFailed, EngineOverloaded, Generation
from zipage.server.metrics import ServerMetrics
from zipage.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, SamplingRequest, parse_body

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # the hint sent with 503 when the queue is full
STREAM_INTERVAL_S = 0.02  # streamed tokens are sent in chunks at most this often (see AsyncEngine)
SWITCH_INTERVAL_S = None  # the interpreter's switch interval while serving (see AsyncEngine)


def create_app(engine: LLMEngine, model_name: str, api_key: str | None = None,
               max_queued_requests: int = 1024, stream_interval: float = STREAM_INTERVAL_S,
               switch_interval: float | None = SWITCH_INTERVAL_S) -> FastAPI:
    """An app serving ``engine`` as model ``model_name``; the engine thread runs while the app does.

    Streams get their tokens at most every ``stream_interval`` seconds (first tokens and ends
    at once); the interpreter's switch interval is ``switch_interval`` while the app runs;
    see ``AsyncEngine``.
    """
    async_engine = AsyncEngine(engine, ServerMetrics(), max_queued_requests, stream_interval, switch_interval)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.stop()

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    # No /docs: the endpoints parse their bodies themselves, and every route needs the key.
    app = FastAPI(title="Zipage", lifespan=lifespan, dependencies=[Depends(check_api_key)], docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.engine = async_engine
    api = _Api(async_engine, model_name, int(time.time()))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return JSONResponse(ApiError(error.status_code, str(error.detail)).body(), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        logger.exception("unhandled error")
        return JSONResponse(ApiError(500, f"internal error: {type(error).__name__}: {error}",
                                     type="server_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        if not async_engine.alive:
            raise ApiError(503, "the engine is not running", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [api.model_card()]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await api.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await api.chat_completions(request)

    return app


class _Api:
    """The two generating endpoints: request -> engine requests -> JSON or server-sent events."""

    def __init__(self, engine: AsyncEngine, model_name: str, created: int):
        self.engine = engine
        self.model_name = model_name
        self.created = created

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "zipage",
                "max_model_len": self.engine.engine.config.scheduler.max_model_len}

    def _check_model(self, body: SamplingRequest) -> None:
        if body.model != self.model_name:
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def _start(self, body: SamplingRequest, prompts: list, prompt_param: str, id_prefix: str,
                     add_special_tokens: bool = True) -> tuple[str, Generation]:
        params = body.sampling_params(len(prompts))
        response_id = f"{id_prefix}-{uuid.uuid4().hex}"
        request_ids = [f"{response_id}-{i}" for i in range(len(params))]
        expanded = [p for p in prompts for _ in range(body.n)]
        try:
            generation = await self.engine.generate(expanded, params, request_ids, add_special_tokens)
        except ValueError as error:
            raise ApiError(400, str(error), param=prompt_param) from None
        except EngineOverloaded as error:
            raise ApiError(503, f"the server is overloaded: {error}; retry later", type="server_error",
                           code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineFailed as error:
            raise ApiError(503, str(error), type="server_error") from None
        return response_id, generation

    # -- completions ----------------------------------------------------------
    async def completions(self, request: Request):
        body = parse_body(await request.body(), CompletionRequest)
        self._check_model(body)
        response_id, generation = await self._start(body, body.prompt, "prompt", "cmpl")
        if body.stream:
            return _sse(self._completion_events(body, response_id, generation), self.engine, generation)

        def choice(index, text, finish_reason):
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        choices, usage = await _collect(request, self.engine, generation, body.n, choice)
        return {"id": response_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage}

    def _completion_events(self, body, response_id, generation):
        def choice(index, text, finish_reason):
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._events(body, response_id, "text_completion", generation, choice)

    async def _events(self, body, response_id, kind, generation, choice, opening=None):
        """Lists of stream events, one per batch the engine hands over: ``choice(index, text,
        finish_reason)`` builds a choice of new text; ``opening(index)``, if given, a first one per
        choice; a final usage event when asked."""
        base = {"id": response_id, "object": kind, "created": int(time.time()), "model": self.model_name}
        usage = _StreamUsage(body, generation)
        if opening is not None:
            yield [dict(base, choices=[opening(index)], **usage.field())
                   for index in range(len(generation.request_ids))]
        async for batch in generation.batches():
            events = []
            for index, output in batch:
                out = output.outputs[0]
                usage.completion_tokens += len(out.token_ids)
                if out.text or output.finished or body.continuous_usage:
                    finish_reason = out.finish_reason if output.finished else None
                    events.append(dict(base, choices=[choice(index, out.text, finish_reason)], **usage.field()))
            yield events
        if body.include_usage:
            yield [dict(base, choices=[], usage=usage.total())]

    # -- chat -------------------------------------------------------------------
    async def chat_completions(self, request: Request):
        body = parse_body(await request.body(), ChatCompletionRequest)
        self._check_model(body)
        tokenizer = self.engine.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 **(body.chat_template_kwargs or {}))
        except Exception as error:  # noqa: BLE001 - a template may raise anything on odd input
            raise ApiError(400, f"the chat template rejected the messages: {error}", param="messages") from None
        response_id, generation = await self._start(body, [text], "messages", "chatcmpl",
                                                    add_special_tokens=False)
        if body.stream:
            return _sse(self._chat_events(body, response_id, generation), self.engine, generation)

        def choice(index, text, finish_reason):
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish_reason}
        choices, usage = await _collect(request, self.engine, generation, body.n, choice)
        return {"id": response_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage}

    def _chat_events(self, body, response_id, generation):
        def opening(index):
            return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}

        def choice(index, text, finish_reason):
            return {"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                    "finish_reason": finish_reason}
        return self._events(body, response_id, "chat.completion.chunk", generation, choice, opening)


class _StreamUsage:
    """Token counts of a stream: ``usage`` is null in each chunk when a final usage chunk is asked
    for (as OpenAI does), the counts so far with ``continuous_usage_stats``, else absent."""

    def __init__(self, body: SamplingRequest, generation: Generation):
        self.body, self.generation = body, generation
        self.completion_tokens = 0

    def total(self) -> dict:
        return _usage(self.generation, self.body.n, self.completion_tokens)

    def field(self) -> dict:
        if self.body.continuous_usage:
            return {"usage": self.total()}
        return {"usage": None} if self.body.include_usage else {}


def _usage(generation: Generation, n: int, completion_tokens: int) -> dict:
    prompt_tokens = sum(generation.num_prompt_tokens[::n])  # each prompt counts once, whatever n
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _collect(request: Request, engine: AsyncEngine, generation: Generation, n: int, make_choice):
    """Wait for every choice (aborting them all if the client goes away); return (choices, usage)."""
    texts = [[] for _ in generation.request_ids]
    reasons: list[str | None] = [None] * len(texts)
    completion_tokens = 0

    async def drain():
        nonlocal completion_tokens
        async for index, output in generation:
            texts[index].append(output.outputs[0].text)
            completion_tokens += len(output.outputs[0].token_ids)
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
    return choices, _usage(generation, n, completion_tokens)


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

    ``events`` yields lists of chunks, those of one hand-over from the engine thread, sent in one
    write. The event loop runs this for every stream at every hand-over, holding the GIL that the
    engine thread needs, so it is kept short.
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
