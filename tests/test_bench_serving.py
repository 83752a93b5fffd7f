"""Smoke tests of ``zipage bench serve`` on the CPU with a tiny model."""

from __future__ import annotations

import json

from tests.conftest import make_llm
from zipage.cli import main as cli_main
from zipage.server.app import create_app
from zipage.server.background import ServerThread

SMALL = ["--rates", "50,inf", "--num-requests", "6", "--input-len", "8", "--output-len", "6"]


def check_result(path, num_requests=6, output_len=6):
    result = json.loads(path.read_text())
    assert result["benchmark"] == "serving" and [r["rate"] for r in result["rates"]] == [50.0, "inf"]
    for row in result["rates"]:
        assert row["completed"] == num_requests and row["failed"] == 0
        assert row["requests_per_s"] > 0 and row["output_tokens_per_s"] > 0
        assert 0 < row["ttft_s"]["p50"] <= row["ttft_s"]["p99"] < 60
        assert 0 < row["itl_s"]["p50"] <= row["itl_s"]["p99"] < 60
        assert row["latency_s"]["p50"] >= row["ttft_s"]["p50"]
    return result


def test_serving_benchmark_in_process(tmp_path):
    code = cli_main(["bench", "serve", "--shape", "tiny", "--device", "cpu", "--block-size", "16",
                     "--max-model-len", "128", "--max-num-seqs", "4", "--out", str(tmp_path), *SMALL])
    assert code == 0
    result = check_result(tmp_path / "serving.json")
    assert result["settings"]["server"]["in_process"] == "tiny"


def test_serving_benchmark_against_a_running_server(tmp_path, checkpoint_dir):
    llm = make_llm(checkpoint_dir("qwen3"), block_size=16, max_num_seqs=8, max_model_len=128)
    with ServerThread(create_app(llm.engine, "tiny", api_key="k")) as server:
        code = cli_main(["bench", "serve", "--url", server.url, "--api-key", "k", "--out", str(tmp_path), *SMALL])
    assert code == 0
    assert check_result(tmp_path / "serving.json")["model"] == "tiny"


def test_serving_benchmark_with_a_simulated_gpu_step(tmp_path):
    code = cli_main(["bench", "serve", "--shape", "tiny", "--simulated-step", "--step-model", "2,0,0,1,0",
                     "--switch-interval", "0.00123", "--block-size", "16", "--max-model-len", "128",
                     "--max-num-seqs", "4", "--out", str(tmp_path), *SMALL])
    assert code == 0
    result = check_result(tmp_path / "serving.json")
    server = result["settings"]["server"]
    assert server["simulated_step"]["a"] == 2.0 and server["switch_interval"] == 0.00123
    for row in result["rates"]:
        assert row["engine_steps"] > 0 and row["engine_steps_per_s"] > 0
        assert row["modelled_ms_per_step"] > 0
