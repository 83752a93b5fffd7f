"""One OpenAI endpoint in front of several engine replicas (``zipage serve --data-parallel-size N``).

The router is a small FastAPI app of its own. It checks the client's API key, reads the
body within the server's size and time limits, picks a replica (``zipage.routing.Router``:
load from each replica's reported running and waiting requests and KV use, plus the
requests in flight to it; prefix affinity from the prompt's text) and relays the call to
it: the answer, or its server-sent events as they come. Validation, tokenization and
every API field are the replica's, so the router's answers are byte for byte those of
``zipage serve``.

Every ``poll_interval`` seconds the router reads each replica's ``/metrics``: its load
gauges feed the routing, and ``/metrics`` here republishes all of them labelled
``replica="i"``, beside the router's own counters.

When a replica stops answering, the calls in flight to it end with a clean error (a 502
body, or an error event and ``[DONE]`` in a stream), no new call goes to it, and the
router asks for its address until the restarted replica answers ``/health`` again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import ClientDisconnect

from zipage.routing import Router, chunk_keys
from zipage.server.protocol import ApiError, RequestLimits

logger = logging.getLogger(__name__)

PREFIX_CHARS = 256  # characters per prefix chunk (about one 64-token block of text)
MAX_PREFIX_CHARS = 1 << 16  # the router keys at most this much of a prompt
POLL_INTERVAL_S = 0.5
RELAYED_HEADERS = ("content-type", "retry-after", "www-authenticate", "x-error-id")


def prefix_of(body) -> str | list | None:
    """What a call's prompt starts with: a chat's messages as text, a completion's prompt (its
    first one, when it gives several), token ids as they are; None when there is nothing to key."""
    if not isinstance(body, dict):
        return None
    messages = body.get("messages")
    if isinstance(messages, list):
        parts, size = [], 0
        for message in messages:
            if not isinstance(message, dict):
                break
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                                  and isinstance(p.get("text"), str))
            text = f"{message.get('role')}\n{content if isinstance(content, str) else ''}\n"
            parts.append(text)
            size += len(text)
            if size >= MAX_PREFIX_CHARS:
                break
        return "".join(parts)[:MAX_PREFIX_CHARS]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt[:MAX_PREFIX_CHARS]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt[:MAX_PREFIX_CHARS // 4]):
        return prompt[:MAX_PREFIX_CHARS // 4]
    return None


def prefix_keys(body) -> list[bytes]:
    prefix = prefix_of(body)
    if not prefix:
        return []
    return chunk_keys(prefix, PREFIX_CHARS if isinstance(prefix, str) else PREFIX_CHARS // 4)


class ReplicaMetrics:
    """The metric families each replica last published, republished with a ``replica`` label
    (a prometheus_client collector)."""

    def __init__(self, count: int):
        self.families: list[list] = [[] for _ in range(count)]

    def update(self, replica: int, text: str) -> dict[str, float]:
        """Keep replica ``replica``'s families from its ``/metrics`` text; return its load gauges."""
        families = list(text_string_to_metric_families(text))
        self.families[replica] = families
        values = {s.name: s.value for f in families for s in f.samples if not s.labels}
        return {"running": values.get("zipage_requests_running", 0), "waiting": values.get("zipage_requests_waiting", 0),
                "kv_usage": values.get("zipage_kv_cache_usage_ratio", 0.0)}

    def clear(self, replica: int) -> None:
        self.families[replica] = []

    def collect(self):
        merged: dict[str, Metric] = {}
        for replica, families in enumerate(self.families):
            for family in families:
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    out.add_sample(sample.name, {**sample.labels, "replica": str(replica)}, sample.value,
                                   sample.timestamp, sample.exemplar)
        return list(merged.values())


class _RouterMetrics:
    def __init__(self, count: int):
        self.registry = r = CollectorRegistry()
        self.routed = Counter("zipage_router_requests", "Calls relayed, by replica", ["replica"], registry=r)
        self.failed = Counter("zipage_router_replica_failures",
                              "Calls that ended with an error because their replica stopped answering",
                              ["replica"], registry=r)
        self.up = Gauge("zipage_replica_up", "1 while the replica answers, 0 while it is down", ["replica"],
                        registry=r)
        self.prefix_hits = Counter("zipage_router_prefix_hits",
                                   "Calls sent where a replica held part of their prompt's prefix", registry=r)
        self.replicas = ReplicaMetrics(count)
        r.register(self.replicas)
        for i in range(count):
            self.up.labels(str(i)).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def create_router_app(replicas, model_name: str, api_key: str | None = None, routing: str = "prefix",
                      limits: RequestLimits | None = None, metrics_need_key: bool = True,
                      poll_interval: float = POLL_INTERVAL_S) -> FastAPI:
    """An app that relays the OpenAI API to ``replicas``: an object with ``urls`` (one address per
    replica, None while down), ``api_key`` (the replicas' internal key, or None), ``len()`` and
    ``async resolve(i, timeout)`` (replica i's address once it answers again, else None);
    ``zipage.server.replicas.ReplicaSet`` is one."""
    import httpx

    from zipage.server.app import _error_response, check_api_key_value, require_api_key

    check_api_key_value(api_key)
    limits = limits or RequestLimits()
    count = len(replicas)
    router = Router(count, routing)
    metrics = _RouterMetrics(count)
    inner = {"Authorization": f"Bearer {replicas.api_key}"} if replicas.api_key else {}
    state = {"client": None, "monitor": None}

    def client() -> httpx.AsyncClient:
        return state["client"]

    def mark_down(i: int) -> None:
        if router.loads[i].healthy:
            logger.warning("replica %d stopped answering; routing around it until it is back", i)
        router.mark_down(i)
        metrics.up.labels(str(i)).set(0)
        metrics.replicas.clear(i)

    async def poll(i: int) -> None:
        url = replicas.urls[i]
        if url is not None and router.loads[i].healthy:
            try:
                answer = await client().get(f"{url}/metrics", headers=inner, timeout=max(2.0, 4 * poll_interval))
                answer.raise_for_status()
                router.report(i, **metrics.replicas.update(i, answer.text))
                return
            except Exception:  # noqa: BLE001 - any failure to answer means down
                mark_down(i)
        # Down: ask Ray where it is (a restarted actor answers once its engine is built).
        url = await replicas.resolve(i, timeout=max(1.0, 2 * poll_interval))
        if url is None:
            return
        try:
            (await client().get(f"{url}/health", timeout=2.0)).raise_for_status()
        except Exception:  # noqa: BLE001
            return
        replicas.urls[i] = url
        router.mark_up(i)
        metrics.up.labels(str(i)).set(1)
        logger.info("replica %d is back at %s", i, url)

    async def monitor() -> None:
        while True:
            await asyncio.gather(*(poll(i) for i in range(count)), return_exceptions=True)
            await asyncio.sleep(poll_interval)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        state["monitor"] = asyncio.create_task(monitor())
        try:
            yield
        finally:
            state["monitor"].cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await state["monitor"]
            await state["client"].aclose()

    app = FastAPI(title="Zipage router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    def check_key(request: Request) -> None:
        require_api_key(request, api_key)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return _error_response(error)

    @app.get("/health")
    async def health():
        up = len(router.healthy())
        if not up:
            raise ApiError(503, "no replica is running", type="server_error")
        return {"status": "ok", "replicas": count, "replicas_up": up}

    @app.get("/metrics")
    async def metrics_route(request: Request):
        if metrics_need_key:
            check_key(request)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return await relay(request, "GET", "/v1/models", b"", [])

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        raw = await read_body(request)
        return await relay(request, "POST", "/v1/completions", raw, await keys_of(raw))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request)
        raw = await read_body(request)
        return await relay(request, "POST", "/v1/chat/completions", raw, await keys_of(raw))

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise _too_large(limits.max_body_bytes)
        chunks, held = [], 0

        async def read() -> None:
            nonlocal held
            async for chunk in request.stream():
                held += len(chunk)
                if held > limits.max_body_bytes:
                    raise _too_large(limits.max_body_bytes)
                chunks.append(chunk)
        try:
            await asyncio.wait_for(read(), limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                           code="request_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise ApiError(499, "the client closed the connection") from None
        return b"".join(chunks)

    async def keys_of(raw: bytes) -> list[bytes]:
        def parse():
            try:
                return prefix_keys(json.loads(raw))
            except (ValueError, RecursionError):
                return []  # the replica answers the malformed body with its 400
        return await asyncio.to_thread(parse) if len(raw) > 65536 else parse()

    async def relay(request: Request, method: str, path: str, raw: bytes, keys: list[bytes]):
        for _ in range(count):  # a replica found down before it took the call: try another
            hits = router.prefix_hits
            try:
                i = router.choose(keys)
            except LookupError:
                raise ApiError(503, "no replica is running; retry later", type="server_error",
                               headers={"Retry-After": "1"}) from None
            if router.prefix_hits > hits:
                metrics.prefix_hits.inc()
            url = replicas.urls[i]
            headers = {**inner, "content-type": request.headers.get("content-type", "application/json")}
            try:
                upstream = await client().send(client().build_request(method, f"{url}{path}", content=raw,
                                                                      headers=headers), stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                router.finished(i)
                mark_down(i)
                continue
            except httpx.HTTPError:
                router.finished(i)
                mark_down(i)
                metrics.failed.labels(str(i)).inc()
                raise ApiError(502, f"replica {i} stopped answering while taking this request", type="server_error",
                               code="replica_failed", headers={"x-replica": str(i)}) from None
            metrics.routed.labels(str(i)).inc()
            return await answer(i, upstream)
        raise ApiError(503, "no replica is running; retry later", type="server_error", headers={"Retry-After": "1"})

    async def answer(i: int, upstream) -> Response:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() in RELAYED_HEADERS}
        headers["x-replica"] = str(i)
        media_type = headers.pop("content-type", None)
        if not (media_type or "").startswith("text/event-stream"):
            try:
                content = await upstream.aread()
            except httpx.HTTPError:
                failed(i)
                raise ApiError(502, f"replica {i} stopped answering while serving this request",
                               type="server_error", code="replica_failed") from None
            finally:
                router.finished(i)
                await upstream.aclose()
            return Response(content, status_code=upstream.status_code, headers=headers, media_type=media_type)

        async def events():
            held = b""  # relayed a whole event at a time, so that an error event never lands mid-event
            try:
                async for chunk in upstream.aiter_raw():
                    held += chunk
                    end = held.rfind(b"\n\n") + 2
                    if end > 1:
                        yield held[:end]
                        held = held[end:]
            except httpx.HTTPError:
                failed(i)
                error = ApiError(502, f"replica {i} stopped answering while serving this request",
                                 type="server_error", code="replica_failed")
                yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
            finally:
                router.finished(i)
                await upstream.aclose()
        return StreamingResponse(events(), status_code=upstream.status_code, headers=headers, media_type=media_type)

    def failed(i: int) -> None:
        metrics.failed.labels(str(i)).inc()
        mark_down(i)

    return app


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {limit} bytes; at most {limit} are allowed",
                    code="request_too_large", headers={"Connection": "close"})
