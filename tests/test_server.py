"""The OpenAI-compatible server, on loopback with a tiny checkpoint, driven by the official client."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import assert_pool_full, make_llm
from zipage import SamplingParams
from zipage.server.app import create_app
from zipage.server.background import ServerThread

MODEL = "tiny"
API_KEY = "test-key"
MAX_MODEL_LEN = 2048  # long enough that the requests aborted below are still running
PROMPTS = ["Let x = 12 and y = 30.", "The quick brown fox", "Question: what is the sum", "Please reason step",
           "We check the result", "Therefore the final", "A request decodes", "0 1 2 3 4 5"]
TIMEOUT = 60  # seconds, for any one client call


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("qwen3")


@pytest.fixture(scope="module")
def served(model_dir):
    """A server with room for 16 running requests and the default queue."""
    llm = make_llm(model_dir, block_size=16, max_num_seqs=16, max_model_len=MAX_MODEL_LEN)
    app = create_app(llm.engine, MODEL)
    with ServerThread(app) as server:
        server.llm, server.engine = llm, app.state.engine
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=TIMEOUT)
        yield server


@pytest.fixture(scope="module")
def guarded(model_dir):
    """A server with an API key, 2 running requests, a queue of 2 and compression on."""
    llm = make_llm(model_dir, block_size=16, max_num_seqs=2, compression={"kv_budget_tokens": 32, "window": 8})
    app = create_app(llm.engine, MODEL, api_key=API_KEY, max_queued_requests=2)
    with ServerThread(app) as server:
        server.llm, server.engine = llm, app.state.engine
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=TIMEOUT)
        yield server


def wait_until_idle(server, timeout: float = 20.0) -> None:
    """Wait for the engine to have no request left, then check every block is back in the pool."""
    deadline = time.monotonic() + timeout
    while server.engine.call_threadsafe(server.llm.engine.has_unfinished_requests):
        assert time.monotonic() < deadline, "requests still in the engine"
        time.sleep(0.05)
    server.engine.call_threadsafe(lambda: assert_pool_full(server.llm))


def metrics(server, headers=None) -> dict:
    text = httpx.get(server.url + "/metrics", headers=headers, timeout=TIMEOUT).text
    return {s.name + "".join(f"|{v}" for v in s.labels.values()): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def clean_stop_string(text: str) -> str | None:
    """Two printable ASCII characters from the middle of ``text`` (a random model's text is mostly bytes)."""
    for i in range(2, len(text) - 2):
        if text[i:i + 2].isascii() and text[i:i + 2].isprintable() and text[:i].find(text[i:i + 2]) < 0:
            return text[i:i + 2]
    return None


# -- the engine's streamed outputs ------------------------------------------------------------
def test_engine_stream_outputs_add_up_to_generate(model_dir):
    llm = make_llm(model_dir, block_size=16, max_num_seqs=8, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=40)
    reference = llm.generate(PROMPTS[:4], greedy, use_tqdm=False)
    stops = [clean_stop_string(o.outputs[0].text) for o in reference]
    assert any(stops)
    params = [SamplingParams(temperature=0, max_tokens=40, stop=[s] if s else None) for s in stops]
    params += [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=5)] * 2
    prompts = PROMPTS[:4] + PROMPTS[4:6]
    expected = llm.generate(prompts, params, use_tqdm=False)

    ids = [llm.engine.add_request(p, sp, stream=True) for p, sp in zip(prompts, params)]
    text, tokens, reason = {i: "" for i in ids}, {i: [] for i in ids}, {}
    while llm.engine.has_unfinished_requests():
        outputs, _ = llm.engine.step()
        for out in outputs:
            assert out.request_id not in reason, "an output after the last one"
            text[out.request_id] += out.outputs[0].text
            tokens[out.request_id] += out.outputs[0].token_ids
            if out.finished:
                reason[out.request_id] = out.outputs[0].finish_reason
    for rid, exp in zip(ids, expected):
        assert text[rid] == exp.outputs[0].text
        assert tokens[rid] == exp.outputs[0].token_ids
        assert reason[rid] == exp.outputs[0].finish_reason
    assert [reason[rid] for rid, s in zip(ids, stops) if s] == ["stop"] * sum(map(bool, stops))
    assert_pool_full(llm)


# -- the API --------------------------------------------------------------------------------
def test_completions_streamed_text_equals_non_streamed(served):
    client = served.client
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0)
    assert full.object == "text_completion" and full.model == MODEL
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    assert full.usage.prompt_tokens == len(served.llm.tokenizer.encode(PROMPTS[0]))


def test_stream_interval_merges_steps_into_one_chunk(model_dir):
    """Tokens between a request's first and its end wait for the interval, then come as one chunk."""
    llm = make_llm(model_dir, block_size=16, max_num_seqs=4, max_model_len=256)
    with ServerThread(create_app(llm.engine, MODEL, stream_interval=1000.0)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True})
        chunks = list(client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True,
            stream_options={"continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    assert [c.usage.completion_tokens for c in chunks] == [1, 16]  # the first token at once, the rest at the end
    assert [c.choices[0].finish_reason for c in chunks] == [None, "length"]
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_engine_step_calls_its_async_callback_once_per_model_run(model_dir):
    llm = make_llm(model_dir, block_size=16, max_num_seqs=4, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
    for prompt in PROMPTS[:2]:
        llm.engine.add_request(prompt, greedy)
    calls, steps, model_runs, finished = [], 0, [], {}
    while llm.engine.has_unfinished_requests():
        outputs, stats = llm.engine.step(async_callback=lambda: calls.append(steps))
        if stats is not None:  # None: the step only collected the tokens of the one before
            model_runs.append(steps)
        steps += 1
        finished.update((o.request_id, o.outputs[0].token_ids) for o in outputs)
    assert calls == model_runs and len(model_runs) == 6  # once in every step that runs the model, during it
    assert sorted(finished.values()) == sorted(o.outputs[0].token_ids for o in expected)
    assert llm.engine.step(async_callback=lambda: calls.append("idle")) == ([], None) and "idle" not in calls


def test_outputs_are_handed_over_during_the_next_step(model_dir, monkeypatch):
    """The event loop gets a step's outputs while the engine runs the next one; at once when it goes idle."""
    from zipage.server.engine_loop import EngineLoop

    llm = make_llm(model_dir, block_size=16, max_num_seqs=4, max_model_len=256)
    app = create_app(llm.engine, MODEL, stream_interval=0.0)
    in_callback, flushes = [False], []
    real_step, real_flush = llm.engine.step, EngineLoop._emit_held

    def step(async_callback=None):
        def callback():
            in_callback[0] = True
            try:
                async_callback()
            finally:
                in_callback[0] = False
        return real_step(async_callback=callback)

    def flush(loop, always=False):
        if loop._held:
            flushes.append(in_callback[0])
        real_flush(loop, always)

    llm.engine.step = step
    monkeypatch.setattr(EngineLoop, "_emit_held", flush)
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
        flushes.clear()
        chunks = list(client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
            stream_options={"continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks]  # a chunk per step, unless the loop fell behind
    assert counts[-1] == 12 and counts == sorted(set(counts))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    # The last step only collects the last token (nothing left to launch), so the outputs of the
    # last two steps go out together, at once.
    assert flushes == [True] * 10 + [False]


def test_chat_streamed_text_equals_non_streamed(served):
    client = served.client
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[1]}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    # The same prompt again: its whole blocks (16 tokens each) come from the prefix cache.
    usage, first = chunks[-1].usage, full.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (first.prompt_tokens, first.completion_tokens)
    assert first.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens_details.cached_tokens == first.prompt_tokens // 16 * 16 > 0
    # Without include_usage there is no usage chunk; text parts count as the string they join to.
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             messages[1]]
    chunks = list(client.chat.completions.create(model=MODEL, messages=parts, max_tokens=24, temperature=0,
                                                 stream=True))
    assert all(c.choices for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content


def test_n_seed_stop_top_p_and_max_tokens_are_honoured(served):
    client = served.client
    sampled = client.completions.create(model=MODEL, prompt=PROMPTS[2], n=3, temperature=1.0, seed=7, max_tokens=12,
                                        extra_body={"ignore_eos": True})
    assert [c.index for c in sampled.choices] == [0, 1, 2] and sampled.usage.completion_tokens == 36
    for j, choice in enumerate(sampled.choices):  # choice j is the request seeded seed + j
        alone = client.completions.create(model=MODEL, prompt=PROMPTS[2], temperature=1.0, seed=7 + j,
                                          max_tokens=12, extra_body={"ignore_eos": True})
        assert alone.choices[0].text == choice.text
    assert len({c.text for c in sampled.choices}) > 1
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[2], n=3, temperature=1.0, seed=7,
                                         max_tokens=12, stream=True, extra_body={"ignore_eos": True})
    texts = ["", "", ""]
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in sampled.choices]

    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=40, temperature=0)
    assert len(greedy.choices) == 2  # a list of prompts: one choice each
    narrow = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=40, temperature=1.0,
                                       top_p=1e-9)
    assert [c.text for c in narrow.choices] == [c.text for c in greedy.choices]  # top_p that tiny is greedy
    stop = next(s for c in greedy.choices if (s := clean_stop_string(c.text)))
    index = next(i for i, c in enumerate(greedy.choices) if stop in c.text)
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[index], max_tokens=40, temperature=0, stop=[stop])
    text = greedy.choices[index].text
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    short = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 5 and short.usage.prompt_tokens == 3
    assert short.choices[0].finish_reason == "length"


def test_models_health_and_metrics(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(served.url + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    served.client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    m = metrics(served)
    assert m["zipage_generation_tokens_total"] >= 8 and m["zipage_prompt_tokens_total"] > 0
    assert m["zipage_time_to_first_token_seconds_count"] >= 1
    assert m["zipage_inter_token_latency_seconds_count"] >= 7
    assert m["zipage_requests_finished_total|length"] >= 1
    assert m["zipage_kv_blocks_total"] == served.llm.engine.block_manager.num_blocks
    for name in ("zipage_requests_running", "zipage_requests_waiting", "zipage_kv_cache_usage_ratio",
                 "zipage_compressions_total"):
        assert name in m


def test_health_reports_an_engine_that_can_run_no_more_steps(served, monkeypatch):
    """A tensor-parallel group shut down after a failure (``ParallelRunner.failure``): /health
    answers 503 with the cause, so that a balancer or the router takes the replica out, and
    new calls are refused with it."""
    cause = "rank 0 failed in a step the other ranks were running (RuntimeError: boom)"
    monkeypatch.setattr(served.llm.engine.runner, "failure", cause, raising=False)
    response = httpx.get(served.url + "/health", timeout=TIMEOUT)
    assert response.status_code == 503 and cause in response.json()["error"]["message"]
    assert "Traceback" not in response.text
    with pytest.raises(openai.APIStatusError) as refused:  # a new call is refused, not queued to fail
        served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
    assert refused.value.status_code == 503 and cause in refused.value.message
    assert not served.llm.engine.has_unfinished_requests()
    monkeypatch.undo()
    assert httpx.get(served.url + "/health", timeout=TIMEOUT).json() == {"status": "ok"}


def test_32_concurrent_streaming_clients_all_complete(served):
    references = served.client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=24, temperature=0,
                                                  extra_body={"ignore_eos": True})
    expected = [c.text for c in references.choices]

    async def run_clients():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)

        async def one(i):
            stream = await client.completions.create(
                model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=24, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            text, usage = "", None
            async for chunk in stream:
                text += "".join(c.text for c in chunk.choices)
                usage = chunk.usage or usage
            return text, usage.completion_tokens

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), TIMEOUT)
        finally:
            await client.close()

    results = asyncio.run(run_clients())
    assert [r[0] for r in results] == [expected[i % len(PROMPTS)] for i in range(32)]
    assert all(r[1] == 24 for r in results)
    wait_until_idle(served)


def test_clients_disconnecting_mid_stream_free_their_blocks(served):
    aborted_before = metrics(served).get("zipage_requests_finished_total|abort", 0)
    streams = []
    for i in range(8):
        stream = served.client.completions.create(
            model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_MODEL_LEN, temperature=0, stream=True,
            stream_options={"continuous_usage_stats": True}, extra_body={"ignore_eos": True})  # a chunk a step
        streams.append(stream)
        chunks = iter(stream)
        next(chunks), next(chunks)
        assert next(chunks).usage.completion_tokens < 100  # mid-stream
    for stream in streams:
        stream.close()
    wait_until_idle(served)
    assert metrics(served)["zipage_requests_finished_total|abort"] - aborted_before == 8
    generated_before = metrics(served)["zipage_generation_tokens_total"]
    # A non-streaming request whose client leaves (its connection reset) is aborted too. (A client
    # that only shuts down its sending side still gets its answer: tests/test_security.py.)
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_MODEL_LEN, "n": 4,
                       "temperature": 0, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + TIMEOUT
        while metrics(served).get("zipage_generation_tokens_total", 0) == generated_before:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    wait_until_idle(served)
    assert metrics(served)["zipage_requests_finished_total|abort"] - aborted_before == 12
    assert served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4).usage.completion_tokens


OVER_CONTEXT = [7] * (MAX_MODEL_LEN + 10)
BAD_REQUESTS = [  # (path, body, status, param, words in the message)
    ("completions", b"{not json", 400, None, "not valid JSON"),
    ("completions", b"[1, 2]", 400, None, "must be a JSON object"),
    ("completions", {"prompt": "hi"}, 400, "model", "model is required"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "'gpt-4' does not exist"),
    ("completions", {"model": MODEL}, 400, "prompt", "prompt is required"),
    ("chat/completions", {"model": MODEL}, 400, "messages", "messages is required"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature",
     "temperature must be in [0.0, 2.0], got -0.5"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400, "temperature", "got 2.5"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", "top_p must be in (0.0, 1.0], got 0"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p", "got 1.5"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens",
     "max_tokens must be in [1, inf), got 0"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n", "n must be in [1, 128], got 0"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 1000}, 400, "n", "got 1000"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "'ten'"),
    ("completions", {"model": MODEL, "prompt": "hi", "seed": 1.5}, 400, "seed", "got 1.5"),
    ("completions", {"model": MODEL, "prompt": "hi", "seed": 2**64}, 400, "seed", f"got {2**64}"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_k": -5}, 400, "top_k", "in [1, 2147483647], got -5"),
    ("completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature", "got nan"),
    ("completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, 400, "stop", "stop must be a non-empty"),
    ("completions", {"model": MODEL, "prompt": "hi", "min_tokens": 9, "max_tokens": 2}, 400, None,
     "min_tokens (9) must not exceed max_tokens (2)"),
    ("completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage", "'yes'"),
    ("completions", {"model": MODEL, "prompt": "hi", "temprature": 0}, 400, "temprature", "unknown parameter"),
    ("completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs", "in [0, 20], got 21"),
    ("completions", {"model": MODEL, "prompt": ""}, 400, "prompt", "prompt is empty"),
    ("completions", {"model": MODEL, "prompt": []}, 400, "prompt", "prompt must be"),
    ("completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt", "prompt token ids must be in [0, "),
    ("completions", {"model": MODEL, "prompt": OVER_CONTEXT}, 400, "prompt",
     f"prompt 0 has {len(OVER_CONTEXT)} tokens; at most {MAX_MODEL_LEN - 1} fit the context (max_model_len"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "at least one message"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages.0.role", "'wizard'"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages.0.content", "only text content"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x " * 3 * MAX_MODEL_LEN}]}, 400,
     "messages", f"tokens; at most {MAX_MODEL_LEN - 1} fit the context (max_model_len"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400,
     "max_tokens", "got -1"),
]


@pytest.mark.parametrize("path, body, status, param, words", BAD_REQUESTS,
                         ids=[f"{i}-{b[3] or 'body'}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_an_openai_error(served, path, body, status, param, words):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    response = httpx.post(f"{served.url}/v1/{path}", timeout=TIMEOUT, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"], error


def test_server_keeps_serving_after_bad_input(served):
    for path, body, *_ in BAD_REQUESTS[:6]:
        httpx.post(f"{served.url}/v1/{path}", json=body if isinstance(body, dict) else None, timeout=TIMEOUT)
    response = httpx.get(served.url + "/v1/nowhere", timeout=TIMEOUT)
    assert response.status_code == 404 and response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:  # the client sees the error body too
        served.client.completions.create(model=MODEL, prompt="hi", temperature=9)
    assert "temperature" in str(info.value)
    good = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert good.choices[0].finish_reason in ("length", "stop")
    wait_until_idle(served)


def test_engine_failure_fails_the_requests_in_flight_and_the_server_recovers(served, monkeypatch):
    engine = served.llm.engine
    real_step, fail = engine.step, [True]

    def step(**kwargs):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("injected failure")
        return real_step(**kwargs)

    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(openai.InternalServerError, match="internal error") as info:
        served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8)
    assert "injected" not in str(info.value)  # the cause goes to the log, not to the client
    fail[0] = True
    with pytest.raises(openai.APIError, match="internal error") as info:
        list(served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=8, stream=True))
    assert "injected" not in str(info.value)
    wait_until_idle(served)
    good = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert good.usage.completion_tokens >= 1


# -- API key and overload ---------------------------------------------------------------------
def test_api_key_is_checked_on_every_request_but_health(guarded):
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = httpx.request(method, guarded.url + path, headers=headers, json={}, timeout=TIMEOUT)
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(guarded.url + "/health", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(guarded.url + "/health").json() == {"status": "ok"}  # load balancers probe without the key
    out = guarded.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8)
    assert out.choices[0].message.content is not None


def test_overload_gets_503_with_retry_after_and_the_engine_survives(guarded):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=guarded.url, headers=auth, timeout=TIMEOUT) as client:
        # 2 requests run and 2 wait: the queue (max_queued_requests=2) is full.
        streams = [client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
                   for _ in range(4)]
        try:
            assert [s.status_code for s in streams] == [200] * 4
            refused = client.post("/v1/completions", json=dict(body, stream=False))
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "overloaded" and "max_queued_requests=2" in error["message"]
        finally:
            for stream in streams:
                stream.close()
    wait_until_idle(guarded)
    m = metrics(guarded, auth)
    assert m["zipage_requests_rejected_total"] == 1 and m["zipage_requests_finished_total|abort"] >= 4
    # Compression ran under the server (a 32-token budget), and it still serves.
    long = guarded.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=120, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 120
    assert metrics(guarded, auth)["zipage_compressions_total"] > 0
    wait_until_idle(guarded)


# -- the command line -------------------------------------------------------------------------
@pytest.mark.parametrize("engine_process", [True, False])
def test_serve_command_builds_the_server(model_dir, monkeypatch, engine_process):
    """zipage serve: its options reach the server, and the engine (in a process of its own by
    default) serves; the switch interval is set where the engine runs, and put back."""
    import zipage.server.cli as serve_cli
    from zipage.cli import main as cli_main

    monkeypatch.setenv("ZIPAGE_API_KEY", "env-key")
    seen = {}

    def fake_serve(config):  # serve on a free port instead, and query it
        seen.update(host=config.host, port=config.port, keep_alive=config.timeout_keep_alive,
                    max_connections=config.http.max_connections)
        with ServerThread(config.app) as server:
            seen["switch_interval"] = config.app.state.engine.call_threadsafe(sys.getswitchinterval)
            seen["pid"] = config.app.state.engine.call_threadsafe(os.getpid)
            seen["no_key"] = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).status_code
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="env-key", max_retries=0, timeout=TIMEOUT)
            seen["models"] = [m.id for m in client.models.list().data]
            seen["text"] = client.completions.create(model="served", prompt="hi", max_tokens=3).choices[0].text

    monkeypatch.setattr(serve_cli, "serve", fake_serve)
    before = sys.getswitchinterval()
    code = cli_main(["serve", model_dir, "--port", "8123", "--served-model-name", "served", "--device", "cpu",
                     "--block-size", "16", "--max-model-len", "128", "--max-num-seqs", "4",
                     "--switch-interval", "0.00123", "--keep-alive-timeout", "7", "--max-connections", "99",
                     "--engine-process" if engine_process else "--no-engine-process"])
    assert code == 0
    assert seen["switch_interval"] == pytest.approx(0.00123) and sys.getswitchinterval() == before
    assert (seen["pid"] != os.getpid()) == engine_process
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8123
    assert seen["keep_alive"] == 7 and seen["max_connections"] == 99
    assert seen["no_key"] == 401 and seen["models"] == ["served"] and isinstance(seen["text"], str)
    if engine_process:
        return
    assert cli_main(["serve", model_dir, "--max-queued-requests", "-1"]) == 2
    assert cli_main(["serve", model_dir, "--switch-interval", "0"]) == 2


def test_sse_events_stay_one_line_whatever_the_text():
    """U+2028, U+2029 and U+0085 end lines for str.splitlines-based clients: they are escaped."""
    import json

    from zipage.server.app import _encode_json

    chunk = {"text": "a\u2028b\u2029c\x85d\ne \u00e9"}
    encoded = _encode_json(chunk)
    assert len(encoded.splitlines()) == 1 and json.loads(encoded) == chunk
    assert "\u00e9" in encoded  # other text stays as it is


def test_responses_are_sent_without_waiting_for_acknowledgements(served):
    """Every accepted connection has TCP_NODELAY: without it a response's body, written after its
    headers, waits for the client's delayed acknowledgement (about 40 ms a call on a kept-alive
    connection). asyncio sets it only on sockets made with an explicit IPPROTO_TCP."""
    import socket

    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as client:
        assert client.get("/health").status_code == 200
        connections = list(served.server.server_state.connections)
        assert connections
        for protocol in connections:
            sock = protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
