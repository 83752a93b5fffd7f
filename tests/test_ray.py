"""Ray: batch jobs on Ray Data and the data-parallel server, two replicas each on one local cluster.

Two engine replicas give one engine's results; a killed replica ends its calls cleanly while
the other's finish, Ray restarts it and the router routes to it again; every pool ends full."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from conftest import make_llm
from zipage import SamplingParams

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """One local cluster for the module (starting one takes seconds): a CPU per replica and spares."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _line(custom_id, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


def test_batch_two_replicas_answer_a_file_as_one_engine_would_and_resume(checkpoint_dir, tmp_path):
    from zipage.ray_batch import run_batch_ray

    model = checkpoint_dir("qwen3")
    prompts = [f"Item {i} of the list is" for i in range(10)]
    requests = tmp_path / "requests.jsonl"
    lines = [_line(f"q{i}", prompt=p, max_tokens=5, temperature=0) for i, p in enumerate(prompts)]
    lines += [_line("bad", prompt="x", temperature=-1), _line("streamed", prompt="x", stream=True)]
    requests.write_text("\n".join(lines) + "\n")
    output = tmp_path / "results.jsonl"
    output.write_text(json.dumps({"id": "batch_req_x", "custom_id": "q0", "response": {"status_code": 200,
                                  "request_id": "x", "body": {"choices": [{"text": "kept"}]}}, "error": None}) + "\n")
    engine = dict(device="cpu", dtype="float32", block_size=16, max_num_seqs=4)
    counts = run_batch_ray(str(model), str(requests), str(output), replicas=2, engine=engine, served_model_name="tiny",
                           batch_size=3, show_progress=False)
    assert counts == {"ok": 9, "refused": 1, "invalid": 1, "skipped": 1}
    records = [json.loads(line) for line in output.read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in records}
    assert len(by_id) == len(records) == 12 and records[0]["response"]["body"]["choices"][0]["text"] == "kept"
    llm = make_llm(model, block_size=16)
    expected = llm.generate(prompts[1:], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    for i, out in enumerate(expected, start=1):
        assert by_id[f"q{i}"]["response"]["body"]["choices"][0]["text"] == out.outputs[0].text
    assert by_id["bad"]["response"]["status_code"] == 400
    assert by_id["streamed"]["response"] is None and "stream must be false" in by_id["streamed"]["error"]["message"]
    again = run_batch_ray(str(model), str(requests), str(output), replicas=2, engine=engine, show_progress=False)
    assert again == {"ok": 0, "refused": 0, "invalid": 0, "skipped": 12}


def _stream(url, body, out, index):
    """The stream's events; a call its replica dropped before answering (a 502) reads as its error
    event and the end, as one dropped mid-stream does."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            response.read()
            out[index] = (response.headers.get("x-replica"), [response.text, "[DONE]"])
            return
        out[index] = (response.headers.get("x-replica"),
                      [line[6:] for line in response.iter_lines() if line.startswith("data: ")])


def test_serve_two_replicas_survive_one_killed_mid_run(checkpoint_dir):
    from zipage.server.background import ServerThread
    from zipage.server.replicas import ReplicaSet
    from zipage.server.router import create_router_app

    model = checkpoint_dir("qwen3")
    engine = dict(device="cpu", dtype="float32", block_size=16, max_num_seqs=4)
    replicas = ReplicaSet(str(model), 2, engine, "tiny")
    try:
        with ServerThread(create_router_app(replicas, "tiny", routing="round_robin", poll_interval=0.2)) as router:
            prompts = [f"Item {i} of the list is" for i in range(4)]
            expected = make_llm(model, block_size=16).generate(prompts, SamplingParams(temperature=0, max_tokens=5),
                                                               use_tqdm=False)
            for prompt, out in zip(prompts, expected):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0}
                answer = httpx.post(router.url + "/v1/completions", json=body, timeout=60).json()
                assert answer["choices"][0]["text"] == out.outputs[0].text
            # Four long streams, two on each replica; replica 0 is killed once they run.
            results: dict = {}
            body = {"model": "tiny", "prompt": "Count:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
            threads = [threading.Thread(target=_stream, args=(router.url, body, results, i)) for i in range(4)]
            for thread in threads:
                thread.start()
            victim = replicas.pool(0)["pid"]
            assert _wait(lambda: replicas.pool(0)["unfinished"] and replicas.pool(1)["unfinished"], 60)
            replicas.kill(0)
            for thread in threads:
                thread.join(120)
            ended = {i: (replica, events) for i, (replica, events) in results.items()}
            assert len(ended) == 4 and all(events[-1] == "[DONE]" for _, events in ended.values())
            killed = [events for replica, events in ended.values() if replica == "0"]
            served = [events for replica, events in ended.values() if replica == "1"]
            assert len(killed) == len(served) == 2
            for events in killed:
                assert json.loads(events[-2])["error"]["code"] == "replica_failed"
            for events in served:
                assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            # Ray restarts the replica; the router finds it and sends it calls again.
            assert _wait(lambda: httpx.get(router.url + "/health", timeout=10).json()["replicas_up"] == 2, 120)
            assert replicas.pool(0)["pid"] != victim
            for prompt, out in zip(prompts, expected):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0}
                answer = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
                assert answer.json()["choices"][0]["text"] == out.outputs[0].text
                assert answer.headers["x-replica"] in ("0", "1")
            text = httpx.get(router.url + "/metrics", timeout=10).text
            assert 'zipage_router_replica_failures_total{replica="0"} 2.0' in text
        for i in range(2):
            assert _wait(lambda: not replicas.pool(i)["unfinished"], 30)
            pool = replicas.pool(i)
            assert pool["free_blocks"] == pool["blocks"] and pool["leaked_refs"] == 0
    finally:
        replicas.shutdown()


def _wait(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False
