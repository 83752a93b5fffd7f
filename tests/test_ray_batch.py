"""Batch jobs on Ray Data: two engine replicas on a local Ray cluster give one engine's results."""

from __future__ import annotations

import json

import pytest

from conftest import make_llm
from zipage import SamplingParams

ray = pytest.importorskip("ray")


def _line(custom_id, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


def test_two_replicas_answer_a_file_as_one_engine_would_and_resume(checkpoint_dir, tmp_path):
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
