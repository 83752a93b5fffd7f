"""The data-parallel router in front of in-process replicas (no Ray): answers as one engine's,
prefix affinity, labelled metrics, and clean errors when a replica stops answering."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from conftest import assert_pool_full, make_llm
from zipage import SamplingParams
from zipage.server.app import create_app
from zipage.server.background import ServerThread
from zipage.server.router import create_router_app, prefix_keys

MODEL = "tiny"
KEY = "replica-key"
TIMEOUT = 60.0


class LocalReplicas:
    """The replica-set interface over servers of this process; ``resolve`` answers what ``back`` holds."""

    def __init__(self, urls):
        self.urls = list(urls)
        self.api_key = KEY
        self.back: dict[int, str] = {}

    def __len__(self):
        return len(self.urls)

    async def resolve(self, index, timeout):
        await asyncio.sleep(0)
        return self.back.get(index)


@pytest.fixture(scope="module")
def replicas(checkpoint_dir):
    model = checkpoint_dir("qwen3")
    llms = [make_llm(model, block_size=16, max_num_seqs=4) for _ in range(2)]
    servers = [ServerThread(create_app(llm.engine, MODEL, api_key=KEY)) for llm in llms]
    yield model, llms, servers
    for server in servers:
        server.stop()


def _routed_counts(router_url, headers=None):
    text = httpx.get(router_url + "/metrics", headers=headers, timeout=TIMEOUT).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("zipage_router_requests_total{"):
            replica = line.split('replica="')[1].split('"')[0]
            counts[replica] = float(line.rsplit(" ", 1)[1])
    return counts


def test_router_answers_as_one_engine_keeps_prefixes_together_and_labels_metrics(replicas):
    model, llms, servers = replicas
    local = LocalReplicas([s.url for s in servers])
    app = create_router_app(local, MODEL, api_key="client-key", poll_interval=0.05)
    auth = {"Authorization": "Bearer client-key"}
    prompts = [f"Item {i} of the list is" for i in range(6)]
    reference = make_llm(model, block_size=16).generate(prompts, SamplingParams(temperature=0, max_tokens=6),
                                                        use_tqdm=False)
    with ServerThread(app) as router:
        assert httpx.post(router.url + "/v1/completions", json={}, timeout=TIMEOUT).status_code == 401
        for prompt, expected in zip(prompts, reference):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
            answer = httpx.post(router.url + "/v1/completions", json=body, headers=auth, timeout=TIMEOUT)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected.outputs[0].text
            with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True}, headers=auth,
                              timeout=TIMEOUT) as stream:
                events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected.outputs[0].text
        bad = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": -1},
                         headers=auth, timeout=TIMEOUT)
        assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]  # the replica's own answer
        # A shared prefix (system prompt) keeps a conversation's calls on one replica while loads are even.
        before = _routed_counts(router.url, auth)
        system = "You are a careful assistant. " * 40
        for i in range(4):
            chat = {"model": MODEL, "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Q{i}"}]}
            assert httpx.post(router.url + "/v1/chat/completions", json=chat, headers=auth,
                              timeout=TIMEOUT).status_code == 200
        after = _routed_counts(router.url, auth)
        grown = sorted(after.get(r, 0) - before.get(r, 0) for r in ("0", "1"))
        assert grown == [0, 4]
        text = httpx.get(router.url + "/metrics", headers=auth, timeout=TIMEOUT).text
        assert 'zipage_replica_up{replica="1"} 1.0' in text
        assert 'vllm:num_requests_waiting{model_name="tiny",replica="0"}' in text
        assert 'zipage_requests_finished_total{finish_reason="length",replica="0"}' in text
        assert 'zipage_requests_finished_total{finish_reason="length",replica="1"}' in text
        assert httpx.get(router.url + "/health", timeout=TIMEOUT).json()["replicas_up"] == 2
        assert httpx.get(router.url + "/v1/models", headers=auth, timeout=TIMEOUT).json()["data"][0]["id"] == MODEL
    for llm in llms:
        assert_pool_full(llm)


def _broken_app():
    """A replica that starts a stream, then dies (the connection closes mid-response)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        async def events():
            yield 'data: {"choices": [{"index": 0, "text": "half"}]}\n\ndata: {"cho'
            await asyncio.sleep(0.05)
            raise RuntimeError("the replica's process died")
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat():
        async def body():
            yield b'{"id": "x", "choi'
            raise RuntimeError("the replica's process died")
        return StreamingResponse(body(), media_type="application/json")

    @app.get("/metrics")
    async def metrics():
        return Response("", media_type="text/plain")
    return app


def test_a_replica_that_dies_ends_its_calls_cleanly_and_the_others_serve(replicas):
    model, llms, servers = replicas
    broken = ServerThread(_broken_app())
    local = LocalReplicas([broken.url, servers[1].url])
    app = create_router_app(local, MODEL, routing="round_robin", poll_interval=0.05)
    try:
        with ServerThread(app) as router:
            body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0, "stream": True}
            with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=TIMEOUT) as stream:
                assert stream.status_code == 200
                events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
            assert events[0] == '{"choices": [{"index": 0, "text": "half"}]}'  # the whole event, not the torn one
            assert json.loads(events[1])["error"]["code"] == "replica_failed" and events[-1] == "[DONE]"
            # Replica 0 is down now: every call goes to replica 1, and succeeds.
            for _ in range(3):
                ok = httpx.post(router.url + "/v1/completions", json={**body, "stream": False}, timeout=TIMEOUT)
                assert ok.status_code == 200
            assert httpx.get(router.url + "/health", timeout=TIMEOUT).json()["replicas_up"] == 1
            assert 'zipage_replica_up{replica="0"} 0.0' in httpx.get(router.url + "/metrics", timeout=TIMEOUT).text
            # Back (restarted elsewhere): the router finds it and routes to it again.
            local.back[0] = servers[0].url
            for _ in range(100):
                if httpx.get(router.url + "/health", timeout=TIMEOUT).json()["replicas_up"] == 2:
                    break
                time.sleep(0.05)
            assert httpx.get(router.url + "/health", timeout=TIMEOUT).json()["replicas_up"] == 2
            before = _routed_counts(router.url)
            for _ in range(2):
                assert httpx.post(router.url + "/v1/completions", json={**body, "stream": False},
                                  timeout=TIMEOUT).status_code == 200
            assert _routed_counts(router.url).get("0", 0) > before.get("0", 0)
    finally:
        broken.stop()
    for llm in llms:
        assert_pool_full(llm)


def test_a_non_streamed_call_whose_replica_dies_gets_a_502(replicas):
    broken = ServerThread(_broken_app())
    app = create_router_app(LocalReplicas([broken.url]), MODEL, poll_interval=60)
    try:
        with ServerThread(app) as router:
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            answer = httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=TIMEOUT)
            assert answer.status_code == 502 and answer.json()["error"]["code"] == "replica_failed"
            assert "Traceback" not in answer.text
            after = httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=TIMEOUT)
            assert after.status_code == 503 and after.headers["retry-after"] == "1"
            assert httpx.get(router.url + "/health", timeout=TIMEOUT).status_code == 503
    finally:
        broken.stop()


def test_prefix_keys_follow_the_prompt_not_the_sampling_fields():
    system = [{"role": "system", "content": "rules " * 100}]
    a = prefix_keys({"messages": system + [{"role": "user", "content": "one"}], "temperature": 0})
    b = prefix_keys({"messages": system + [{"role": "user", "content": "two"}], "max_tokens": 9})
    assert len(a) >= 2 and a[:2] == b[:2]
    assert prefix_keys({"prompt": ["x" * 600, "y"]}) == prefix_keys({"prompt": "x" * 600})
    assert prefix_keys({"prompt": list(range(200))})[:1] == prefix_keys({"prompt": list(range(64)) + [7] * 9})[:1]
    assert prefix_keys({"prompt": 5}) == prefix_keys([1, 2]) == prefix_keys({"messages": "no"}) == []
    assert len(prefix_keys({"prompt": "z" * 10_000_000})) == (1 << 16) // 256  # bounded work for any prompt
