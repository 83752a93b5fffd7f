"""``zipage run-batch``: OpenAI Batch files through the served API, resumable, no line lost or doubled."""

from __future__ import annotations

import json

import pytest

from conftest import assert_pool_full, make_llm
from zipage import SamplingParams
from zipage.batch import finished_ids, read_requests, run_batch
from zipage.cli import main as cli_main

MODEL = "tiny"


def _line(custom_id, url="/v1/completions", **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _input(tmp_path) -> str:
    chat = [{"role": "user", "content": "Count to three"}]
    lines = [_line(f"c{i}", prompt=f"The number {i} is", max_tokens=6, temperature=0) for i in range(5)]
    lines += [_line("chat", "/v1/chat/completions", messages=chat, max_tokens=5, temperature=0),
              _line("n2", prompt="Hello", max_tokens=3, temperature=0.8, seed=3, n=2),
              _line("bad-url", "/v1/embeddings", input="x"),
              _line("bad-temperature", prompt="x", temperature=-1),
              _line("streamed", prompt="x", stream=True)]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n\n")
    return str(path)


def _results(path) -> dict:
    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    by_id = {r["custom_id"]: r for r in records}
    assert len(by_id) == len(records), "a custom_id written twice"
    return by_id


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return make_llm(checkpoint_dir("qwen3"), block_size=16, max_num_seqs=4)


def _app(llm):
    from zipage.server.app import create_app
    return create_app(llm.engine, MODEL, stream_interval=0)


def test_a_batch_file_round_trips(llm, tmp_path):
    requests, output = _input(tmp_path), str(tmp_path / "results.jsonl")
    counts = run_batch(_app(llm), MODEL, requests, output, concurrency=3, show_progress=False)
    assert counts == {"ok": 7, "refused": 1, "invalid": 2, "skipped": 0}
    results = _results(output)
    assert set(results) == {f"c{i}" for i in range(5)} | {"chat", "n2", "bad-url", "bad-temperature", "streamed"}
    for i in range(5):  # the greedy text the engine gives offline
        expected = llm.generate([f"The number {i} is"], SamplingParams(temperature=0, max_tokens=6),
                                use_tqdm=False)[0].outputs[0].text
        response = results[f"c{i}"]["response"]
        assert response["status_code"] == 200 and response["body"]["choices"][0]["text"] == expected
        assert results[f"c{i}"]["error"] is None and results[f"c{i}"]["id"].startswith("batch_req_")
    assert results["chat"]["response"]["body"]["object"] == "chat.completion"
    assert len(results["n2"]["response"]["body"]["choices"]) == 2
    refused = results["bad-temperature"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"
    for custom_id, words in (("bad-url", "line 8: url must be one of"), ("streamed", "stream must be false")):
        assert results[custom_id]["response"] is None and words in results[custom_id]["error"]["message"]
    assert_pool_full(llm)


def test_a_killed_run_resumes_without_losing_or_doubling_a_line(llm, tmp_path):
    requests, output = _input(tmp_path), tmp_path / "results.jsonl"
    run_batch(_app(llm), MODEL, requests, str(output), concurrency=2, show_progress=False)
    whole = output.read_text().splitlines(keepends=True)
    # as a killed run leaves it: four finished lines and half of the fifth
    output.write_text("".join(whole[:4]) + whole[4][:25])
    assert len(finished_ids(str(output))) == 4 and output.read_text() == "".join(whole[:4])
    output.write_text("".join(whole[:4]) + whole[4][:25])
    counts = run_batch(_app(llm), MODEL, requests, str(output), concurrency=2, show_progress=False)
    assert counts["skipped"] == 4 and sum(counts.values()) == len(read_requests(requests))
    lines = output.read_text().splitlines(keepends=True)
    assert lines[:4] == whole[:4]  # kept as they were
    results = _results(output)
    assert set(results) == set(_results_from(whole))
    again = run_batch(_app(llm), MODEL, requests, str(output), concurrency=2, show_progress=False)
    assert again["skipped"] == len(results) and again["ok"] == again["refused"] == again["invalid"] == 0
    assert_pool_full(llm)


def _results_from(lines) -> dict:
    return {json.loads(line)["custom_id"]: line for line in lines}


def test_duplicate_custom_ids_are_refused_before_the_model_loads(tmp_path, capsys):
    path = tmp_path / "requests.jsonl"
    for text, words in (("not json\n", "line 1 is not JSON"), ('{"url": "/v1/completions"}\n', "line 1 has no custom_id"),
                        ("[1, 2]\n", "line 1 has no custom_id")):
        path.write_text(text)
        with pytest.raises(ValueError, match=words):
            read_requests(str(path))
    path.write_text(_line("a", prompt="x") + "\n" + _line("b", prompt="y") + "\n" + _line("a", prompt="z") + "\n")
    with pytest.raises(ValueError, match="custom_id 'a' is on lines 1 and 3"):
        read_requests(str(path))
    code = cli_main(["run-batch", str(tmp_path / "no-model"), "-i", str(path), "-o", str(tmp_path / "out.jsonl")])
    assert code == 2 and "custom_id 'a' is on lines 1 and 3" in capsys.readouterr().err


def test_the_command_runs_a_file(checkpoint_dir, tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(_line("only", prompt="Hello", max_tokens=4, temperature=0) + "\n")
    output = tmp_path / "out.jsonl"
    code = cli_main(["run-batch", checkpoint_dir("qwen3"), "-i", str(requests), "-o", str(output),
                     "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "2"])
    assert code == 0 and "1 answered, 0 refused" in capsys.readouterr().out
    assert _results(output)["only"]["response"]["status_code"] == 200


def test_a_run_killed_for_real_resumes(llm, checkpoint_dir, tmp_path):
    """SIGKILL the command while it writes, then run again: every line once, the first ones as they were."""
    import os
    import signal
    import subprocess
    import sys
    import time

    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(_line(f"k{i}", prompt=f"Line {i}", max_tokens=24, temperature=0)
                                  for i in range(16)) + "\n")
    output = tmp_path / "results.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "zipage.cli", "run-batch", checkpoint_dir("qwen3"), "-i",
                             str(requests), "-o", str(output), "--device", "cpu", "--dtype", "float32",
                             "--block-size", "16", "--max-num-seqs", "1", "--concurrency", "1",
                             "--served-model-name", MODEL], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (output.exists() and output.read_text().count("\n") >= 3):
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no result line within 120 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = output.read_text()
    finished = before[:before.rfind("\n") + 1].splitlines(keepends=True)
    assert 3 <= len(finished) < 16
    counts = run_batch(_app(llm), MODEL, str(requests), str(output), concurrency=4, show_progress=False)
    assert counts["skipped"] == len(finished) and counts["ok"] == 16 - len(finished)
    lines = output.read_text().splitlines(keepends=True)
    assert lines[:len(finished)] == finished
    assert sorted(_results(output)) == sorted(f"k{i}" for i in range(16))
    assert_pool_full(llm)
