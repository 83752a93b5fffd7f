"""Smoke tests of ``zipage bench serve`` on the CPU with a tiny model."""

from __future__ import annotations

import json
import time

import pytest

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
    assert server["engine_process"]  # the default, as zipage serve's
    for row in result["rates"]:
        assert row["engine_steps"] > 0 and row["engine_steps_per_s"] > 0
        assert row["modelled_ms_per_step"] > 0


# -- a standard workload, online against offline ------------------------------------------------
WORKLOAD = ["--workload", "reasoning-8k", "--scale", "small", "--num-requests", "3", "--device", "cpu"]


def test_standard_workload_served_and_offline_see_the_same_requests(tmp_path):
    """The server and the offline engine run the requests of ``bench throughput`` (prompt lengths and
    max_tokens, in order), each to its length; both tokens/s and their ratio are reported per mode."""
    from zipage.bench.throughput import prepare_workload, workload_defaults

    code = cli_main(["bench", "serve", "--shape", "tiny", *WORKLOAD, "--modes", "zipage,full", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "serving.json").read_text())
    throughput_args = workload_defaults()
    throughput_args.__dict__.update(shape="tiny", scale="small", num_requests=3, device="cpu")
    requests = prepare_workload(throughput_args)[3]
    expected = [[len(r.prompt), r.max_tokens] for r in requests]
    assert result["workload"]["request_lengths"] == expected
    assert list(result["modes"]) == ["zipage", "full"]
    for run in result["modes"].values():
        online, offline = run["online"], run["offline"]
        assert online["request_lengths"] == offline["request_lengths"] == expected
        assert online["failed"] == offline["failed"] == 0
        assert online["output_tokens"] == offline["output_tokens"] == sum(n for _, n in expected)
        assert run["online_over_offline"] == online["output_tokens_per_s"] / offline["output_tokens_per_s"]
        assert 0 < online["ttft_s"]["p50"] <= online["ttft_s"]["p99"] and online["itl_s"]["p99"] > 0
    assert result["modes"]["zipage"]["options"]["compress"] and not result["modes"]["full"]["options"]["compress"]
    assert set(result["ratios"]) == {"zipage_over_full_online", "zipage_over_full_offline"}


def test_standard_workload_with_a_simulated_step(tmp_path):
    """Every side runs the same requests to their lengths; the streamed offline run counts its
    tokens from per-step outputs."""
    code = cli_main(["bench", "serve", "--shape", "tiny", *WORKLOAD, "--modes", "zipage", "--simulated-step",
                     "--step-model", "1,0,0,1,0", "--sides", "online,offline-streamed,offline",
                     "--no-engine-process", "--out", str(tmp_path)])
    assert code == 0
    run = json.loads((tmp_path / "serving.json").read_text())["modes"]["zipage"]
    assert run["online"]["modelled_ms_per_step"] > 0 and run["offline"]["engine_steps"] > 0
    lengths = run["online"]["request_lengths"]
    assert lengths == run["offline"]["request_lengths"] == run["offline-streamed"]["request_lengths"]
    assert all(n > 0 for _, n in lengths)
    for side in ("online", "offline", "offline-streamed"):
        assert run[side]["host_ms_per_step"] > 0
        gaps = run[side]["step_gaps"]
        assert gaps["num_steps"] == len(gaps["timeline"]) == run[side]["engine_steps"]
        assert 0 < gaps["p50_ms"] <= gaps["p99_ms"] <= gaps["max_ms"]




@pytest.mark.parametrize("extra, words", [
    (["--input-len", "8"], "drop ['--input-len']"),
    (["--rates", "1,inf"], "--workload runs one rate"),
    (["--url", "http://127.0.0.1:1"], "drop ['--url']"),
    (["--sides", "online,offlne"], "--sides 'online,offlne': each must be one of online, offline, offline-streamed"),
])
def test_standard_workload_rejects_options_it_sets_itself(extra, words, capsys):
    assert cli_main(["bench", "serve", "--shape", "tiny", *WORKLOAD, *extra]) == 2
    assert words in capsys.readouterr().err


def test_modes_need_a_workload(capsys):
    assert cli_main(["bench", "serve", "--shape", "tiny", "--modes", "full"]) == 2
    assert "--modes needs --workload" in capsys.readouterr().err


# -- the simulated runner ---------------------------------------------------------------------
def test_replay_is_the_same_with_launch_and_collect_as_with_execute(tmp_path):
    """Asynchronous scheduling (the runner's launch / collect) and one call a step (``execute``, the
    mode modifier step-sync) give the same replay: the schedule needs only token counts."""
    common = ["--shape", "tiny", "--scale", "small", "--device", "cpu"]
    runs = {}
    for name, modes in (("async", "full,zipage"), ("sync", "full+step-sync,zipage+step-sync")):
        assert cli_main(["bench", "replay", *common, "--modes", modes, "--out", str(tmp_path / name)]) == 0
        runs[name] = list(json.loads((tmp_path / name / "replay.json").read_text())["modes"].values())
    keys = ["output_tokens", "model_s", "decode_steps", "mean_batch", "prefill_s", "num_preemptions",
            "num_compressions"]
    for launched, executed in zip(runs["async"], runs["sync"]):
        assert launched["options"]["async_scheduling"] and not executed["options"]["async_scheduling"]
        assert [launched[k] for k in keys] == [executed[k] for k in keys]


def test_simulated_runner_steps_take_their_time_between_launch_and_collect(checkpoint_dir):
    """With ``sleep`` a launch returns at once; its tokens are ready a step's time later; a step
    launched while another runs starts when that one ends (one device)."""
    from zipage.bench.replay import SimulatedRunner
    from zipage.bench.throughput import rank_spec
    from zipage.config import EngineConfig
    from zipage.engine.sequence import Sequence
    from zipage.sampling_params import SamplingParams

    model_dir = checkpoint_dir("qwen3")
    config = EngineConfig.from_kwargs(model_dir, device="cpu", block_size=16, max_model_len=64)
    config.scheduler.resolve(64)
    step_ms = 30.0
    runner = SimulatedRunner(config, rank_spec(model_dir, 1), dict(a=step_ms, b=0, c=0, p0=step_ms, p1=0, f=0, g=0),
                             sleep=True, token_range=8)
    seqs = [Sequence(str(i), None, [1, 2, 3], SamplingParams(), 4, 0) for i in range(3)]
    for seq in seqs:
        seq.chunk = (0, 3)  # a whole prompt's prefill
    first = runner.launch(seqs, True, {0})
    launched_at = time.perf_counter()
    for seq in seqs:
        seq.chunk = None  # then a decode
    second = runner.launch(seqs, False, {0}, previous=first)
    assert launched_at < first.ready_at and second.ready_at >= first.ready_at + step_ms / 1000
    tokens = runner.collect(first)
    assert time.perf_counter() >= first.ready_at
    assert len(tokens) == 3 and all(0 < t < 8 for t in tokens)  # random ids below token_range, none the EOS 0
    runner.collect(second)
    assert time.perf_counter() >= second.ready_at
    assert runner.prefill_ms == runner.decode_ms == step_ms
    runner.forget(seqs)


# -- host CPU per step against the output length ----------------------------------------------
def test_host_benchmark_measures_a_window_per_length(tmp_path, capsys):
    code = cli_main(["bench", "host", "--shape", "tiny", "--streams", "4", "--output-lens", "80,120",
                     "--window-steps", "16", "--prompt-len", "8", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "host.json").read_text())
    assert [r["output_len"] for r in result["lengths"]] == [80, 120]
    for row in result["lengths"]:
        assert row["window_steps"] == 16 and row["min_running"] == 4
        assert row["cpu_ms_per_step"] > 0 and row["host_ms_p50"] > 0 and row["wall_ms_per_step"] > 0
        assert row["cpu_us_per_token"] == pytest.approx(1000 * row["cpu_ms_per_step"] / 4)
        assert row["run_cpu_s"] > 0 and row["run_gc_s"] >= 0
    assert result["step_model"]["c"] == 0  # the KV term fixed at --context, the same step at every length
    assert "cpu_ms_per_step" in capsys.readouterr().out
    assert cli_main(["bench", "host", "--output-lens", "60", "--window-steps", "16"]) == 2
    assert "--output-lens must each be >= 66" in capsys.readouterr().err


@pytest.mark.parametrize("chunked", [True, False])
def test_long_prompts_among_decoding_streams(tmp_path, chunked):
    """``--background``: streams decode while long prompts arrive; the report separates the
    streams' gaps in the window the long prompts are prefilled from those before it."""
    out = tmp_path / ("on" if chunked else "off")
    code = cli_main(["bench", "serve", "--shape", "tiny", "--device", "cpu", "--block-size", "16",
                     "--max-model-len", "1536", "--max-num-seqs", "8", "--background", "4", "--input-len", "8",
                     "--output-len", "1500", "--long-prompts", "300,200", "--long-repeats", "1",
                     "--long-start", "1.2", "--long-rate", "20", "--long-output-len", "4",
                     # every step's tokens sent at once, and streams that outlast the long prompts at steps
                     # down to 1 ms (a few ms here): the window (a few steps) holds the streams' gaps; the
                     # long prompts start late enough that the streams decode before them on a slow machine
                     "--stream-interval", "0",
                     "--max-num-batched-tokens", "64" if chunked else "1536", "--out", str(out),
                     *([] if chunked else ["--no-chunked-prefill"]),
                     *(["--profile-window", "0.2", "--control"] if chunked else [])])
    assert code == 0
    result = json.loads((out / "serving.json").read_text())
    assert result["benchmark"] == "serving-interference" and result["failed"] == 0
    assert result["streams"] == 4 and result["long_prompts"] == 2
    assert sorted(n for n, _ in result["long_ttft_s"]) == [200, 300]
    first, last = result["window_s"]
    assert 1.2 <= first < last and result["median_decode_step_s"] > 0
    # every stream's tokens after its first chunk (which may hold a few, when its first steps are sent together)
    assert 4 * 1490 <= result["itl_all_s"]["count"] <= 4 * 1499
    window = result["itl_window_s"]
    assert window["count"] > 0 and window["p50"] <= window["p99"] <= window["max"]
    assert result["settings"]["server"]["engine"]["enable_chunked_prefill"] is chunked
    # The engine's own steps in the window, on the clients' clock: prompt tokens were computed in it.
    steps = result["engine_steps"]
    assert steps["steps"] == len(steps["all"]) > 0
    assert all(first <= row["at_s"] <= last for row in steps["all"])
    assert sum(row["tokens"] - row["decodes"] for row in steps["all"]) > 0
    assert sum(k["steps"] for k in steps["by_kind"].values()) == steps["steps"]
    assert any(kind.startswith("chunk") for kind in steps["by_kind"])
    assert max(r["interval_ms"] for r in steps["longest"]) == max(r["interval_ms"] for r in steps["all"])
    if chunked:  # the control run's streams, alone, at the window's output positions
        assert result["control_failed"] == 0 and result["control_decode_step_s"] > 0
        assert result["p99_over_control_step"] == pytest.approx(window["p99"] / result["control_decode_step_s"])
    else:
        assert "control_decode_step_s" not in result
    if chunked:  # the engine's kernels recorded in its process, a while into the window, by kind
        profile = result["profile"]
        assert "error" not in profile and profile["steps"] > 0 and profile["seconds"] >= 0.2
        kinds = {row["kind"]: row for row in profile["kinds"]}
        assert kinds["matmul"]["ms_per_step"] > 0 and "no kernel running" in kinds


def test_step_report_attributes_each_interval_to_what_made_it():
    from zipage.bench.interference import step_report
    from zipage.engine.llm_engine import StepStats

    def step(end, prefill=False, decodes=4, compression_s=0.0):
        return StepStats(prefill, decodes + 1, decodes + (60 if prefill else 0), 0, num_decodes=decodes,
                         compression_s=compression_s, host_s=0.002, start=end - 0.005, end=end)

    t0 = 100.0
    steps = [step(100.99), step(101.00), step(101.01, prefill=True), step(101.05),
             step(101.06, compression_s=0.02), step(101.09), step(103.0)]
    async_report = step_report(steps, t0, (1.0, 1.1), 0.01, async_scheduling=True)
    # The interval ending at 1.05 s collected the mixed step launched at 1.01 s (40 ms: over 3x 10 ms).
    kinds = ["decode", "chunk launched", "chunk collected", "compression", "decode"]
    assert [r["kind"] for r in async_report["all"]] == kinds
    assert async_report["all"][2]["interval_ms"] == pytest.approx(40.0)
    assert async_report["by_kind"]["chunk collected"]["over_3x_step"] == 1
    assert async_report["by_kind"]["decode"]["steps"] == 2 and async_report["steps"] == 5
    sync_report = step_report(steps, t0, (1.0, 1.1), 0.01, async_scheduling=False)
    assert [r["kind"] for r in sync_report["all"]] == ["decode", "chunk", "decode", "compression", "decode"]
    assert step_report(steps, t0, (5.0, 6.0), 0.01, True) == {"steps": 0, "by_kind": {}, "longest": [], "all": []}


def test_window_gaps_count_the_chunks_that_arrived_in_the_window():
    from array import array

    from zipage.bench.interference import gap_stats, window_gaps

    results = [{"gaps": array("d", [0.1, 0.2, 0.5]), "counts": array("l", [1, 2, 1]),
                "times": array("d", [1.0, 2.0, 3.0])},
               {"gaps": array("d", [0.3]), "counts": array("l", [3]), "times": array("d", [2.5])}]
    assert sorted(window_gaps(results, 1.5, 2.5).tolist()) == [0.2, 0.2, 0.3, 0.3, 0.3]
    assert window_gaps(results, 5.0, 6.0).size == 0
    stats = gap_stats(window_gaps(results, 0.0, 9.0))
    assert stats["count"] == 7 and stats["max"] == 0.5 and stats["p50"] == 0.3


def test_the_control_run_is_read_at_the_windows_output_positions():
    """The control's gaps are taken at the output positions the main run's streams reached in the
    window (not at the same times: alone, the streams are further along by then)."""
    from zipage.bench.interference import control_report

    def stream(times, counts, gaps, error=None):
        return {"times": times, "counts": counts, "gaps": gaps, "error": error}

    # Main run: chunks at 1..6 s of 2 tokens each; the window [2.5, 4.5] holds the chunks at 3 and
    # 4 s, i.e. output positions 5..8 (after the 4 tokens of the chunks at 1 and 2 s).
    main = [stream([1, 2, 3, 4, 5, 6], [2] * 6, [0.1] * 6), stream([1], [2], [0.1], error="lost")]
    # Control: one token per chunk, gaps 0.01 * position; positions 5..8 have gaps 0.05..0.08.
    alone = [stream(list(range(1, 13)), [1] * 12, [0.01 * i for i in range(1, 13)]), stream([1], [1], [0.5])]
    report = {"window_s": [2.5, 4.5], "itl_window_s": {"p99": 0.13}}
    out = control_report(alone, main, report)
    assert out["control_decode_step_s"] == pytest.approx(0.065)
    assert out["p99_over_control_step"] == pytest.approx(2.0) and out["control_failed"] == 0
