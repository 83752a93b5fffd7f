"""The server with its engine in a process of its own (``EngineProcess``): the same tokens as
the engine offline, errors that cross the process boundary, a failed step, a dead engine
process, and nothing left behind."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from tests.conftest import TEST_DEVICE
from zipage import SamplingParams
from zipage.server.app import create_app
from zipage.server.background import ServerThread
from zipage.server.engine_process import EngineProcess, EngineProcessError, build_llm_engine

MODEL = "tiny"
TIMEOUT = 60
FAIL_PROMPT = [7, 7, 7, 7, 7, 7, 7, 7, 7]  # faulty_engine's steps raise while a request with it runs


def engine_kwargs(**options) -> dict:
    kwargs = dict(device=TEST_DEVICE, dtype="float32", block_size=16, max_num_seqs=8, max_model_len=256)
    if TEST_DEVICE != "cpu":
        kwargs["kv_cache_memory_bytes"] = 1 << 28
    return dict(kwargs, **options)


def pool_state(engine) -> dict:
    """What the engine holds (run where it runs)."""
    manager = engine.block_manager
    return {"unfinished": engine.has_unfinished_requests(), "used_blocks": manager.num_blocks - manager.num_free_blocks,
            "held_refs": sum(1 for c in manager.ref_counts if c), "constrained": engine._num_constrained}


def faulty_engine(model_dir: str, kwargs: dict):
    """An engine whose steps raise while a request with FAIL_PROMPT runs."""
    engine = build_llm_engine(model_dir, kwargs)
    real_step = engine.step

    def step(*args, **kw):
        if any(list(seq.token_ids[:seq.num_prompt_tokens]) == FAIL_PROMPT for seq in engine.scheduler.running):
            raise RuntimeError("injected step failure")
        return real_step(*args, **kw)

    engine.step = step
    return engine


def failing_engine():
    raise RuntimeError("boom")


def wait_until_idle(server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (state := server.engine.call_engine_threadsafe(pool_state))["unfinished"]:
        assert time.monotonic() < deadline, "requests still in the engine"
        time.sleep(0.05)
    assert state == {"unfinished": False, "used_blocks": 0, "held_refs": 0, "constrained": 0}


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("qwen3")


@pytest.fixture(scope="module")
def served(model_dir):
    process = EngineProcess(faulty_engine, (model_dir, engine_kwargs()))
    app = create_app(process, MODEL, stream_interval=0.0)
    with ServerThread(app) as server:
        server.engine, server.process = app.state.engine, process
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=TIMEOUT)
        yield server
    assert not process.process.is_alive() and process.process.exitcode == 0


def test_the_engine_runs_in_another_process_and_answers_as_offline(served, model_dir):
    from zipage import LLM

    assert served.engine.call_threadsafe(os.getpid) == served.process.process.pid != os.getpid()
    prompts = ["Let x = 12 and y = 30.", "The quick brown fox"]
    with LLM(model_dir, **engine_kwargs()) as llm:
        expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, want in zip(prompts, expected):
        whole = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                 extra_body={"ignore_eos": True})
        assert whole.choices[0].text == want.outputs[0].text and whole.usage.completion_tokens == 12
        chunks = list(served.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
            stream_options={"continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == want.outputs[0].text
        assert chunks[-1].usage.completion_tokens == 12
    metrics = httpx.get(served.url + "/metrics", timeout=TIMEOUT).text
    assert "zipage_generation_tokens_total 48.0" in metrics
    assert "zipage_requests_finished_total{finish_reason=\"length\"} 4.0" in metrics
    wait_until_idle(served)


def test_the_engine_process_refuses_bad_requests_with_their_reason(served):
    response = httpx.post(served.url + "/v1/completions", timeout=TIMEOUT,
                          json={"model": MODEL, "prompt": [1, 2, 10**9], "max_tokens": 2})
    assert response.status_code == 400 and "prompt token ids must be in [0," in response.json()["error"]["message"]
    # A parameter only the engine judges: its error names it across the process boundary.
    response = httpx.post(served.url + "/v1/completions", timeout=TIMEOUT,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "thinking_token_budget": 4})
    assert response.status_code == 400 and response.json()["error"]["param"] == "thinking_token_budget"
    wait_until_idle(served)


def test_a_failed_step_fails_its_calls_and_the_engine_serves_on(served):
    response = httpx.post(served.url + "/v1/completions", timeout=TIMEOUT,
                          json={"model": MODEL, "prompt": FAIL_PROMPT, "max_tokens": 4})
    assert response.status_code == 500 and "Traceback" not in response.text
    wait_until_idle(served)
    ok = served.client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3
    assert httpx.get(served.url + "/health", timeout=TIMEOUT).status_code == 200


def test_a_client_that_leaves_aborts_its_request_in_the_engine_process(served):
    with httpx.stream("POST", served.url + "/v1/completions", timeout=TIMEOUT,
                      json={"model": MODEL, "prompt": "abc", "max_tokens": 200, "stream": True,
                            "ignore_eos": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk read: leave
    wait_until_idle(served)


def test_a_bad_option_is_raised_where_the_engine_process_is_made(model_dir):
    with pytest.raises(ValueError, match="block_size"):
        EngineProcess(build_llm_engine, (model_dir, engine_kwargs(block_size=-3)))
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        EngineProcess(build_llm_engine, ("/no_such_dir/model", engine_kwargs()))
    with pytest.raises(EngineProcessError, match="boom"):
        EngineProcess(failing_engine, ())


def signal_mid_stream(server, process: EngineProcess, signum: int) -> list[str]:
    """Start a long stream, send the engine process ``signum`` once its first chunk came, and
    return the stream's lines after it."""
    with httpx.stream("POST", server.url + "/v1/completions", timeout=TIMEOUT,
                      json={"model": MODEL, "prompt": "abc", "max_tokens": 240, "stream": True,
                            "ignore_eos": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        os.kill(process.process.pid, signum)
        return [line for line in lines if line]


def test_a_dead_engine_process_fails_the_calls_and_health(model_dir):
    process = EngineProcess(build_llm_engine, (model_dir, engine_kwargs()))
    app = create_app(process, MODEL, stream_interval=0.0)
    with ServerThread(app) as server:
        rest = signal_mid_stream(server, process, signal.SIGKILL)
        assert any("the engine can run no more steps" in line for line in rest) and rest[-1] == "data: [DONE]"
        health = httpx.get(server.url + "/health", timeout=TIMEOUT)
        assert health.status_code == 503 and "exit code -9" in health.json()["error"]["message"]
        refused = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT,
                             json={"model": MODEL, "prompt": "abc", "max_tokens": 2})
        assert refused.status_code == 503 and "Traceback" not in refused.text
    assert process.exited and not process.process.is_alive()


def test_structured_outputs_are_checked_here_and_applied_in_the_engine_process(served):
    pytest.importorskip("xgrammar")

    def complete(structured, **extra):
        return httpx.post(served.url + "/v1/completions", timeout=TIMEOUT,
                          json={"model": MODEL, "prompt": "colour:", "max_tokens": 16, "temperature": 0,
                                "structured_outputs": structured, **extra})

    colours = ["red", "green", "blue"]
    response = complete({"choice": colours})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] in colours
    response = complete({"regex": "[0-9]{3}"})
    assert response.status_code == 200 and response.json()["choices"][0]["text"].isdigit()
    assert len(response.json()["choices"][0]["text"]) == 3
    response = complete({"regex": "(unclosed"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs"
    wait_until_idle(served)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="two ranks on the CPU (gloo); one GPU holds one rank")
def test_a_tensor_parallel_engine_runs_in_the_engine_process(model_dir):
    """The engine process starts its own follower process (it is no daemon) and stops it."""
    from zipage import LLM

    with LLM(model_dir, **engine_kwargs()) as llm:
        want = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    process = EngineProcess(build_llm_engine, (model_dir, engine_kwargs(tensor_parallel_size=2)))
    app = create_app(process, MODEL)
    with ServerThread(app) as server:
        response = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT,
                              json={"model": MODEL, "prompt": "hello there", "max_tokens": 6, "temperature": 0,
                                    "ignore_eos": True})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == want[0].outputs[0].text
    assert process.process.exitcode == 0


def test_ctrl_c_is_left_to_the_server_and_sigterm_stops_the_engine_cleanly(model_dir):
    """SIGINT (a terminal's Ctrl-C reaches the process group) does not stop the engine process:
    the server's process stops it. SIGTERM does, cleanly: the calls in flight get an error that
    says so, /health answers 503, and the process exits with 0."""
    process = EngineProcess(build_llm_engine, (model_dir, engine_kwargs()))
    app = create_app(process, MODEL, stream_interval=0.0)
    with ServerThread(app) as server:
        status = f"/proc/{process.process.pid}/status"
        if os.path.exists(status):  # Linux: the disposition itself (a signal may land in a finalizer)
            with open(status) as lines:
                ignored = int(next(line for line in lines if line.startswith("SigIgn")).split()[1], 16)
            assert ignored & (1 << (signal.SIGINT - 1)), "the engine process does not ignore SIGINT"
        os.kill(process.process.pid, signal.SIGINT)
        time.sleep(1.0)  # an idle engine that took it would be gone by now
        assert process.process.is_alive() and not process.exited
        ok = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT,
                        json={"model": MODEL, "prompt": "abc", "max_tokens": 3})
        assert ok.status_code == 200 and process.process.is_alive()
        rest = signal_mid_stream(server, process, signal.SIGTERM)
        assert any("stopped (SIGTERM)" in line for line in rest) and rest[-1] == "data: [DONE]"
        deadline = time.monotonic() + TIMEOUT
        while not process.exited:  # the server's reader thread joins the process
            assert time.monotonic() < deadline, "the engine process did not exit"
            time.sleep(0.05)
        assert process.process.exitcode == 0
        health = httpx.get(server.url + "/health", timeout=TIMEOUT)
        assert health.status_code == 503 and "SIGTERM" in health.json()["error"]["message"]


def test_a_script_that_never_closes_its_engine_process_still_exits(model_dir):
    """An engine process nobody closed (an app that never started) is closed when the interpreter
    exits; multiprocessing would otherwise wait there for it forever."""
    import subprocess
    import sys

    script = ("from zipage.server.engine_process import EngineProcess, build_llm_engine\n"
              "if __name__ == '__main__':\n"
              f"    EngineProcess(build_llm_engine, ({model_dir!r}, {engine_kwargs()!r}))\n"
              "    print('built', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0 and "built" in done.stdout, done.stderr[-2000:]


def test_commands_left_when_the_engine_loop_stops_are_answered_with_engine_failed():
    """A command still queued when the loop stops gets an ``EngineFailed`` (which the API maps to
    503) with the reason, in both modes the same message; nothing else of the engine is touched."""
    from zipage.server.async_engine import EngineFailed
    from zipage.server.engine_loop import EngineLoop

    messages = []
    loop = EngineLoop(object(), messages.append)
    assert loop.submit(("call", 7, len, ((),), False))
    loop.stop("the engine process was stopped (SIGTERM)")
    loop.run()
    (reply, failed) = messages
    assert reply[:3] == ("reply", 7, None) and isinstance(reply[3], EngineFailed)
    assert str(reply[3]) == "the engine process was stopped (SIGTERM)"
    assert failed == ("failed", "the engine process was stopped (SIGTERM)")
    assert not loop.submit(("abort", None, ["x"]))
