"""A bounded soak of the HTTP server: mixed clients for many engine steps, then nothing is left behind.

Several concurrent clients send completions and chat completions, streamed or not, with
stop strings, different lengths and sometimes n=2, and now and then disconnect mid-request.
Over the run the engine's per-step host time and the process's resident memory are
recorded, and their first and last deciles printed (run with -s to see them).

``ZIPAGE_SOAK_STEPS`` sets the engine steps (default 2,000: under a minute on two CPU
cores); e.g. ``ZIPAGE_SOAK_STEPS=20000 python -m pytest -s tests/test_soak.py`` for a long soak.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import numpy as np
import pytest

from tests.conftest import make_llm
from zipage.bench.serving import sse_chunks
from zipage.server.app import create_app
from zipage.server.background import ServerThread

STEPS = int(os.environ.get("ZIPAGE_SOAK_STEPS", "2000"))
CLIENTS = 8
MAX_TOKENS = 40
MODEL = "tiny"
STOP_STRINGS = [["e "], ["\n", "th"], ["never appears"]]
TIMEOUT = 60.0  # seconds, for any one request
# Resident memory may grow this much between the second decile and the last. Memory that a
# leak would add per request is small (a request's state is a few KB here), but the allocator
# keeps freed memory and grows in steps of its own (glibc arenas of up to 64 MB for a new
# thread's allocations, pymalloc arenas, tensors of new shapes), so only a generous bound
# cannot flake; the structural checks (free pool, no request, no per-request state left)
# catch leaks exactly. The first decile is left out: it holds the start-up allocations.
RSS_GROWTH_BOUND = 50 * 2**20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StepRecorder:
    """Wraps the engine's ``step`` (called on the engine thread): each step's ``host_s``, and the
    resident memory every ``RSS_EVERY`` steps."""

    RSS_EVERY = 10

    def __init__(self, engine):
        self.step = engine.step
        self.host_s: list[float] = []
        self.rss: list[tuple[int, int]] = []  # (steps so far, bytes)
        engine.step = self

    def __call__(self, *args, **kwargs):
        outputs, stats = self.step(*args, **kwargs)
        if stats is not None:
            self.host_s.append(stats.host_s)
            if len(self.host_s) % self.RSS_EVERY == 0:
                self.rss.append((len(self.host_s), rss_bytes()))
        return outputs, stats

    def deciles(self) -> list[dict]:
        """Per tenth of the run's steps: the median host time (ms) and resident memory (MB)."""
        steps = len(self.host_s)
        host = np.array_split(np.array(self.host_s), 10)
        at, rss = np.array(self.rss).T
        return [dict(decile=d + 1, host_ms_p50=1000 * float(np.median(host[d])),
                     rss_mb=float(np.median(rss[(at > d * steps / 10) & (at <= (d + 1) * steps / 10)])) / 2**20)
                for d in range(10)]


def random_request(rng: random.Random) -> dict:
    """What one client call asks: endpoint, body, and when (if ever) it walks away."""
    body = {"model": MODEL, "max_tokens": rng.randint(1, MAX_TOKENS), "temperature": rng.choice([0.0, 0.8]),
            "n": 2 if rng.random() < 0.2 else 1, "stream": rng.random() < 0.6, "ignore_eos": rng.random() < 0.7}
    if rng.random() < 0.4:
        body["stop"] = rng.choice(STOP_STRINGS)
    if body["stream"]:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.3}
    if rng.random() < 0.2:
        path, body["messages"] = "chat/completions", [{"role": "user", "content": f"Count to {rng.randint(2, 9)}."}]
    else:
        path, body["prompt"] = "completions", rng.choice(["The soak test", "1 2 3", "Once upon a time", [5, 6, 7]])
    leave = None
    if rng.random() < 0.15:  # a stream: after this many chunks; otherwise after this many seconds
        leave = rng.randint(1, 3) if body["stream"] else rng.uniform(0.02, 0.3)
    return {"path": path, "body": body, "leave": leave}


async def streamed(client: httpx.AsyncClient, path: str, body: dict, leave: int | None) -> dict | None:
    """A streamed call's choices and usage, or None if the client left mid-stream."""
    choices: dict[int, dict] = {}
    usage, chunks = None, 0
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, (await response.aread()).decode()
        async for chunk in sse_chunks(response):
            chunks += 1
            if leave is not None and chunks > leave:
                return None  # closing the response drops the connection mid-stream
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                choice = choices.setdefault(c["index"], {"text": "", "finish_reason": None})
                choice["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                choice["finish_reason"] = c["finish_reason"] or choice["finish_reason"]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


async def unstreamed(client: httpx.AsyncClient, path: str, body: dict, leave: float | None) -> dict | None:
    """A call's choices and usage, or None if the client left (timed out) before the answer came."""
    try:
        response = await asyncio.wait_for(client.post(path, json=body), leave)
    except asyncio.TimeoutError:
        return None
    assert response.status_code == 200, response.text
    reply = response.json()
    return {"choices": [{"text": c.get("text", (c.get("message") or {}).get("content")),
                         "finish_reason": c["finish_reason"]} for c in reply["choices"]], "usage": reply["usage"]}


def check_reply(request: dict, reply: dict) -> list[str]:
    """What is wrong with a completed call's reply (nothing, for a right one)."""
    body, problems = request["body"], []
    if len(reply["choices"]) != body["n"]:
        problems.append(f"{len(reply['choices'])} choices for n={body['n']}")
    reasons = [c["finish_reason"] for c in reply["choices"]]
    tokens = reply["usage"]["completion_tokens"]
    if any(r not in ("length", "stop") for r in reasons):
        problems.append(f"finish reasons {reasons}")
    elif all(r == "length" for r in reasons) and tokens != body["n"] * body["max_tokens"]:
        problems.append(f"{tokens} tokens, not {body['n']} x {body['max_tokens']}, though every choice hit the length")
    elif tokens > body["n"] * body["max_tokens"]:
        problems.append(f"{tokens} tokens, over {body['n']} x {body['max_tokens']}")
    if body["ignore_eos"] and "stop" not in body and reasons != ["length"] * body["n"]:
        problems.append(f"finish reasons {reasons} with EOS ignored and no stop string")
    for c in reply["choices"]:
        if any(s in c["text"] for s in body.get("stop", [])):
            problems.append(f"a stop string of {body['stop']} is in the text {c['text']!r}")
    return [f"{request['path']} {body}: {p}" for p in problems]


async def soak(url: str, steps_run, steps: int = STEPS) -> tuple[list[str], int, int]:
    """Clients that call until the engine has run ``steps`` steps (``steps_run()``: those so far);
    (problems, completed, abandoned)."""
    problems, counts = [], {"completed": 0, "abandoned": 0}

    async def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=url + "/v1", timeout=TIMEOUT) as client:
            while steps_run() < steps:
                request = random_request(rng)
                call = streamed if request["body"]["stream"] else unstreamed
                reply = await call(client, request["path"], request["body"], request["leave"])
                if reply is None:
                    counts["abandoned"] += 1
                else:
                    counts["completed"] += 1
                    problems.extend(check_reply(request, reply))

    await asyncio.gather(*(client_loop(seed) for seed in range(CLIENTS)))
    return problems, counts["completed"], counts["abandoned"]


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    llm = make_llm(checkpoint_dir("qwen3"), block_size=16, max_num_seqs=16, max_model_len=256)
    app = create_app(llm.engine, MODEL)
    with ServerThread(app) as server:
        server.engine, server.async_engine = llm.engine, app.state.engine
        yield server


def leftovers(server) -> dict:
    """Everything a finished request should have given back (read on the engine thread)."""
    engine, async_engine = server.engine, server.async_engine
    bm = engine.block_manager
    return {"unfinished": engine.has_unfinished_requests(), "blocks_in_use": bm.num_blocks - bm.num_free_blocks,
            "referenced_blocks": sum(c != 0 for c in bm.ref_counts),
            "engine_requests": len(engine._requests) + len(engine._detokenizers) + len(engine._streamed),
            "server_requests": len(async_engine._generations) + len(async_engine._timing)}


def test_soak_server_mixed_clients_leave_nothing_behind(server):
    recorder = StepRecorder(server.engine)
    start = time.perf_counter()
    problems, completed, abandoned = asyncio.run(soak(server.url, lambda: len(recorder.host_s)))
    # Aborts of the last disconnects are commands the engine thread runs, and a cancelled call's
    # handler forgets its request on the event loop after that: wait for both, within a bound.
    deadline = time.monotonic() + 30
    while (state := server.async_engine.call_threadsafe(lambda: leftovers(server)))["unfinished"] or (
            state["engine_requests"] or state["server_requests"]):
        if time.monotonic() > deadline:
            break  # the assertion below names what was left
        time.sleep(0.05)
    deciles = recorder.deciles()
    print(f"\nsoak: {len(recorder.host_s)} steps in {time.perf_counter() - start:.0f} s, {completed} calls "
          f"completed, {abandoned} abandoned")
    for d in deciles:
        print(f"  decile {d['decile']:2d}: host {d['host_ms_p50']:.2f} ms per step (median), RSS {d['rss_mb']:.1f} MB")
    assert not problems, "\n".join(problems[:10])
    assert completed > 0 and abandoned > 0
    assert state == {"unfinished": False, "blocks_in_use": 0, "referenced_blocks": 0, "engine_requests": 0,
                     "server_requests": 0}
    growth = (deciles[-1]["rss_mb"] - deciles[1]["rss_mb"]) * 2**20
    assert growth < RSS_GROWTH_BOUND, f"resident memory grew {growth / 2**20:.1f} MB after the first decile"


# -- the same clients against the engine in a process of its own (zipage serve's default) -------
def engine_leftovers(engine) -> dict:
    """What a finished request should have given back, in the engine process."""
    bm = engine.block_manager
    return {"unfinished": engine.has_unfinished_requests(), "blocks_in_use": bm.num_blocks - bm.num_free_blocks,
            "referenced_blocks": sum(c != 0 for c in bm.ref_counts),
            "engine_requests": len(engine._requests) + len(engine._detokenizers) + len(engine._streamed)}


def engine_steps(engine) -> int:
    return engine.stats.num_steps


def test_soak_with_the_engine_in_its_own_process_leaves_nothing_behind(checkpoint_dir):
    from tests.conftest import TEST_DEVICE
    from zipage.server.engine_process import EngineProcess, build_llm_engine

    kwargs = dict(device=TEST_DEVICE, dtype="float32", block_size=16, max_num_seqs=16, max_model_len=256)
    if TEST_DEVICE != "cpu":
        kwargs["kv_cache_memory_bytes"] = 1 << 28
    process = EngineProcess(build_llm_engine, (checkpoint_dir("qwen3"), kwargs))
    app = create_app(process, MODEL)
    with ServerThread(app) as server:
        async_engine = app.state.engine
        seen = {"steps": 0, "at": 0.0}

        def steps_run() -> int:  # asked of the engine process at most every 0.2 s
            if time.monotonic() - seen["at"] > 0.2:
                seen["steps"], seen["at"] = async_engine.call_engine_threadsafe(engine_steps), time.monotonic()
            return seen["steps"]

        problems, completed, abandoned = asyncio.run(soak(server.url, steps_run, STEPS // 2))
        deadline = time.monotonic() + 30
        while (state := async_engine.call_engine_threadsafe(engine_leftovers))["unfinished"] or (
                state["engine_requests"] or async_engine._generations or async_engine._timing):
            if time.monotonic() > deadline:
                break  # the assertions below name what was left
            time.sleep(0.05)
        assert not problems, "\n".join(problems[:10])
        assert completed > 0 and abandoned > 0
        assert state == {"unfinished": False, "blocks_in_use": 0, "referenced_blocks": 0, "engine_requests": 0}
        assert not async_engine._generations and not async_engine._timing and not async_engine._pending
    assert process.process.exitcode == 0
