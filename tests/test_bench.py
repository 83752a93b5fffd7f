"""Smoke tests: the benchmarks run end to end on the CPU with a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from zipage.bench.chunks import step_kind
from zipage.cli import main as cli_main


def test_throughput_benchmark_small_scale_writes_results(tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    from zipage.bench.common import COPY_BANDWIDTH_BYTES_PER_S
    from zipage.bench.throughput import rolling_rate

    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k))[1])
    out = tmp_path / "throughput"
    code = cli_main(["bench", "throughput", "--shape", "tiny", "--scale", "small", "--device", "cpu",
                     "--hf-requests", "3", "--hf-batch-size", "2",
                     "--modes", "full,zipage,zipage+sync+no-hybrid+budget=48", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "throughput.json").read_text())
    # On a CPU the roofline is a CPU copy's, measured and said so, not the H200's.
    roofline = result["roofline"]
    assert roofline["copy_bytes_per_s"] != COPY_BANDWIDTH_BYTES_PER_S and "H200" not in roofline["source"]
    assert roofline["source"] == f"{result['device']} copy, measured in this run" and "CPU" in result["device"]
    printed = capsys.readouterr().out
    assert f"{roofline['copy_bytes_per_s'] / 1e9:,.1f} GB/s ({roofline['source']})" in printed
    # The plot: titled with workload, scale, device and date; per mode each step's rate under a rolling mean.
    (fig,) = figures
    assert fig._suptitle.get_text() == (f"bench throughput: reasoning-8k at scale small (x0.0156), tiny, "
                                        f"{result['device']}, {result['date']}")
    rates = fig.axes[0].get_lines()
    assert len(rates) == 2 * len(result["modes"])
    for (raw, mean), timeline in zip(zip(rates[::2], rates[1::2]), result["timelines"].values()):
        assert raw.get_alpha() < 0.5 and mean.get_alpha() is None and mean.get_linewidth() >= 3 * raw.get_linewidth()
        assert list(raw.get_ydata()) == [s["decodes"] / s["dt"] for s in timeline]
        # The bold line is the rolling rate over 1/30 of the longest run, at each step's time.
        window = max(steps[-1]["t"] for steps in result["timelines"].values() if steps) / 30
        times = [s["t"] for s in timeline]
        assert list(mean.get_ydata()) == rolling_rate(times, [s["decodes"] for s in timeline], window)
    assert result["benchmark"] == "throughput" and result["workload"]["name"] == "reasoning-8k"
    for mode in ("full", "zipage"):
        metrics = result["modes"][mode]
        assert metrics["output_tokens"] == result["workload"]["output_tokens"]  # ignore_eos: all of them
        assert metrics["tokens_per_s"] > 0 and 0 < metrics["peak_block_occupancy"] <= 1
        assert len(result["timelines"][mode]) > 0
    assert all(m["blocks_returned"] for m in result["modes"].values())
    ablation = result["modes"]["zipage+sync+no-hybrid+budget=48"]
    assert ablation["options"]["budget"] == 48 and not ablation["options"]["hybrid"]
    assert ablation["num_compressions"] > result["modes"]["zipage"]["num_compressions"] > 0
    assert result["modes"]["full"]["num_compressions"] == 0
    hf = result["hf_generate"]  # 3 requests in calls of at most 2
    assert hf["tokens_per_s"] > 0 and hf["requests"] == 3 and hf["batch_size"] == 2
    assert "zipage_over_full" in result["ratios"]
    capsys.readouterr()
    assert cli_main(["bench", "throughput", "--shape", "tiny", "--scale", "small", "--device", "cpu",
                     "--hf-batch-size", "0"]) != 0
    assert "--hf-batch-size must be >= 1, got 0" in capsys.readouterr().err
    assert (out / "throughput.png").stat().st_size > 10_000


def test_steady_state_is_the_saturated_phase():
    """Steady state leaves out the ramp-up (a large first batch before the cache fills) and
    the drain: it is the steps taken while requests waited."""
    from zipage.bench.throughput import _steady_state

    steps = ([dict(seqs=176, waiting=0)] * 3 + [dict(seqs=40, waiting=60)] * 5 + [dict(seqs=40, waiting=0)]
             + [dict(seqs=3, waiting=0)] * 2)
    bound = list(range(len(steps)))
    assert [b for b, _ in _steady_state(bound, steps)] == [3, 4, 5, 6, 7]
    never_waited = [dict(seqs=10, waiting=0), dict(seqs=9, waiting=0), dict(seqs=2, waiting=0)]
    assert [b for b, _ in _steady_state([0, 1, 2], never_waited)] == [0, 1]
    assert _steady_state([], []) == []


def test_rolling_rate_matches_a_brute_force_window():
    import random

    from zipage.bench.throughput import rolling_rate

    rng = random.Random(1)
    for _ in range(20):
        times, t = [], 0.0
        for _ in range(rng.randint(1, 60)):
            t += rng.choice([0.0, rng.uniform(0.001, 0.5)])
            times.append(t)
        counts = [rng.randint(0, 50) for _ in times]
        window = rng.uniform(0.01, 3.0)
        got = rolling_rate(times, counts, window)
        for i, t in enumerate(times):
            inside = sum(c for j, (u, c) in enumerate(zip(times, counts)) if j <= i and (u > t - window or j == i))
            expected = inside / min(window, t) if min(window, t) > 0 else 0.0
            assert got[i] == pytest.approx(expected)
    # steps alternating between 0 and 200 tokens every 10 ms (0 or 20,000 tokens/s each): about 10,000
    # tokens/s once a window (here of 20 or 21 steps) has passed
    times = [0.01 * (i + 1) for i in range(400)]
    rates = rolling_rate(times, [200 * (i % 2) for i in range(400)], window=0.205)
    assert all(abs(r - 10_000) <= 800 for r in rates[21:])


def test_copy_bandwidth_is_the_run_devices(monkeypatch):
    import itertools
    import time

    import torch

    from zipage.bench import common

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert common.copy_bandwidth(torch.device("cuda")) == (common.COPY_BANDWIDTH_BYTES_PER_S,
                                                           "H200 device-to-device copy, measured 2026-11-29")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(common, "measure_copy_bandwidth", lambda device: 1.5e12)
    assert common.copy_bandwidth(torch.device("cuda")) == (1.5e12, "NVIDIA A100 copy, measured in this run")
    monkeypatch.undo()
    clock = itertools.count(step=0.25)  # each reading a quarter second later: every copy takes 0.25 s
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    assert common.measure_copy_bandwidth(torch.device("cpu")) == 2 * 2**27 / 0.25  # bytes read + written


def test_serving_benchmark_with_a_simulated_step_needs_no_max_model_len(tmp_path, capsys):
    """Without --max-model-len the simulated engine's context is the model's, as a real engine's."""
    from zipage.bench.common import model_dir_for
    from zipage.bench.replay import parse_step_model
    from zipage.bench.serving import simulated_engine

    model_dir, _ = model_dir_for(None, "qwen3-8b", "qwen3")
    engine = simulated_engine(model_dir, dict(kv_cache_memory_bytes=16 * 10**9), parse_step_model(None))
    assert engine.config.scheduler.max_model_len == 40960 and engine.max_prompt_tokens == 40959
    out = tmp_path / "serve"
    code = cli_main(["bench", "serve", "--shape", "qwen3-8b", "--simulated-step", "--kv-cache-memory-bytes",
                     str(16 * 10**9), "--rates", "inf", "--num-requests", "3", "--input-len", "8",
                     "--output-len", "4", "--out", str(out)])
    assert code == 0
    (row,) = json.loads((out / "serving.json").read_text())["rates"]
    assert row["completed"] == 3 and row["failed"] == 0
    # The default 1 GiB cache cannot hold the model's 40,960 tokens: said so, not a crash.
    assert cli_main(["bench", "serve", "--shape", "qwen3-8b", "--simulated-step", "--num-requests", "1"]) == 2
    assert "max_model_len=40960 does not fit the KV cache" in capsys.readouterr().err


def test_throughput_roofline_counts_the_caches_own_bytes(tmp_path):
    """With an fp8 cache a cached token costs its float8 bytes and their scales in the roofline, not
    the model dtype's bytes."""
    from zipage.bench.common import model_dir_for
    from zipage.bench.throughput import rank_spec
    from zipage.kernels.common import FP8_DTYPE
    from zipage.runner.kv_cache import bytes_per_block
    if FP8_DTYPE is None:
        pytest.skip("this torch has no float8_e4m3fn")
    out = tmp_path / "throughput"
    assert cli_main(["bench", "throughput", "--shape", "tiny", "--scale", "small", "--device", "cpu",
                     "--hf-requests", "0", "--modes", "full", "--kv-cache-dtype", "fp8", "--out", str(out)]) == 0
    spec = rank_spec(model_dir_for(None, "tiny", "qwen3")[0], 1)
    kv = json.loads((out / "throughput.json").read_text())["modes"]["full"]["roofline_bytes"]["kv_per_token"]
    assert kv == bytes_per_block(spec, 1, FP8_DTYPE) == 2 * spec.num_layers * spec.num_kv_heads * (spec.head_dim + 4)


def test_throughput_workloads_are_seeded_and_long_tailed():
    from zipage.bench.workloads import make_workload

    a = make_workload("reasoning-8k", 200, 1, 1000, seed=3)
    b = make_workload("reasoning-8k", 200, 1, 1000, seed=3)
    assert [(r.prompt, r.max_tokens) for r in a] == [(r.prompt, r.max_tokens) for r in b]
    lengths = sorted(r.max_tokens for r in a)
    assert 6000 < sum(lengths) / len(lengths) < 9000  # mean about 8K after the cap
    assert max(lengths) <= 16384 and lengths[len(lengths) // 2] < sum(lengths) / len(lengths)  # long tail
    assert all(128 <= len(r.prompt) <= 1024 for r in a)
    shared = make_workload("reasoning-16k", 3, 4, 1000, seed=1)
    assert len(shared) == 12 and shared[0].prompt == shared[3].prompt


def test_throughput_mode_modifiers_and_bad_modes():
    import argparse

    import pytest

    from zipage.bench.throughput import mode_options

    args = argparse.Namespace(asynchronous=True, no_hybrid=False, no_prefix_caching=False, redundancy="lightning",
                              enforce_eager=False)
    settings = dict(budget=2048, block_size=256)
    opts = mode_options("zipage+sync+raw+block=64", args, settings)
    assert opts["compress"] and not opts["asynchronous"] and opts["redundancy"] == "raw" and opts["block_size"] == 64
    assert not mode_options("full+eager", args, settings)["compress"]
    assert opts["piecewise_graph_tokens"] is None and mode_options("full+pieces=640", args, settings)[
        "piecewise_graph_tokens"] == 640
    for bad in ("fast", "zipage+turbo", "zipage+budget=x", "zipage+pieces=-1"):
        with pytest.raises(ValueError, match="mode"):
            mode_options(bad, args, settings)


def test_peak_kv_demand_and_standard_request_count():
    from zipage.bench.workloads import Request, make_workload, peak_kv_demand, requests_for_demand

    reqs = make_workload("reasoning-8k", 30, 1, 1000, seed=5, scale=1 / 16)
    brute = max(sum(len(r.prompt) + t for r in reqs if r.max_tokens > t) for t in range(0, 2000))
    assert peak_kv_demand(reqs) == brute
    assert peak_kv_demand([Request([1] * 10, 5), Request([2] * 3, 100)]) == max(10 + 4 + 3 + 4, 3 + 99)
    chosen = requests_for_demand("reasoning-8k", 20_000, 1000, seed=5, scale=1 / 16)
    assert peak_kv_demand(chosen) >= 20_000 > peak_kv_demand(chosen[:-1])


def test_throughput_benchmark_tensor_parallel(tmp_path):
    """Two ranks (gloo on the CPU) serve the workload with compression and return every block (full KV
    with two ranks is covered by the tensor-parallel engine tests)."""
    import subprocess
    import sys

    out = tmp_path / "tp"
    # half the small preset's lengths (each step of two CPU ranks is slow), a budget of two blocks
    cmd = [sys.executable, "-m", "zipage.cli", "bench", "throughput", "--shape", "tiny", "--scale", "0.0078125",
           "--block-size", "16", "--budget", "32", "--window", "8", "--device", "cpu", "--hf-requests", "0",
           "--num-requests", "6", "--modes", "zipage", "--tensor-parallel-size", "2", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "throughput.json").read_text())
    assert result["options"]["tensor_parallel_size"] == 2
    metrics = result["modes"]["zipage"]
    assert metrics["output_tokens"] == result["workload"]["output_tokens"] and metrics["blocks_returned"]
    assert result["modes"]["zipage"]["num_compressions"] > 0
    # the roofline counts one rank's share of the cache, as `bench decode` does: half the KV heads
    from zipage.bench.common import model_dir_for
    from zipage.bench.throughput import rank_spec
    from zipage.runner.kv_cache import bytes_per_block

    spec = rank_spec(model_dir_for(None, "tiny", "qwen3")[0], 1)
    assert spec.num_kv_heads % 2 == 0
    assert 2 * metrics["roofline_bytes"]["kv_per_token"] == bytes_per_block(spec, 1, torch.float32)


def test_replay_reproduces_the_engine_schedule(tmp_path):
    """``bench replay`` drives the real scheduler: for full KV it takes the same decode steps and
    preemptions as the engine running the model on the same workload."""
    common = ["--shape", "tiny", "--scale", "small", "--device", "cpu", "--modes", "full,zipage"]
    assert cli_main(["bench", "throughput", *common, "--hf-requests", "0", "--out", str(tmp_path / "run")]) == 0
    assert cli_main(["bench", "replay", *common, "--out", str(tmp_path / "replay")]) == 0
    run = json.loads((tmp_path / "run" / "throughput.json").read_text())
    replay = json.loads((tmp_path / "replay" / "replay.json").read_text())
    decode_steps = sum(1 for s in run["timelines"]["full"] if not s["prefill"] and s["seqs"])
    assert replay["modes"]["full"]["decode_steps"] == decode_steps
    assert replay["modes"]["full"]["num_preemptions"] == run["modes"]["full"]["num_preemptions"]
    zipage = replay["modes"]["zipage"]
    assert zipage["output_tokens"] == run["workload"]["output_tokens"] and zipage["num_compressions"] > 0
    assert zipage["model_s"] > 0 and "zipage_over_full" in replay["ratios"]


def test_replay_step_model_errors():
    import pytest

    from zipage.bench.replay import parse_step_model

    assert parse_step_model("1,0,0.5,2,0.01") == dict(a=1.0, b=0.0, c=0.5, p0=2.0, p1=0.01, f=0.0, g=0.0)
    assert parse_step_model("1,0,0.5,2,0.01,0.3,0.4") == dict(a=1.0, b=0.0, c=0.5, p0=2.0, p1=0.01, f=0.3, g=0.4)
    with pytest.raises(ValueError, match="5 or 7 comma-separated"):
        parse_step_model("1,2")
    with pytest.raises(ValueError, match=">= 0"):
        parse_step_model("1,-2,0,0,0")


@pytest.mark.parametrize("asynchronous", [True, False])
def test_replay_charges_compressions(tmp_path, asynchronous):
    """A compression cost adds exactly f + g * tokens/1000 per batch to the modelled time, whether
    it is charged to the step it overlaps (asynchronous) or serially; the schedule is unchanged."""
    common = ["--shape", "tiny", "--scale", "small", "--device", "cpu", "--modes", "zipage",
              "--asynchronous" if asynchronous else "--no-asynchronous"]
    runs = {}
    for name, model in (("hidden", "2,0.01,0.03,1,0.01"), ("charged", "2,0.01,0.03,1,0.01,0.5,0.25")):
        assert cli_main(["bench", "replay", *common, "--step-model", model, "--out", str(tmp_path / name)]) == 0
        runs[name] = json.loads((tmp_path / name / "replay.json").read_text())["modes"]["zipage"]
    hidden, charged = runs["hidden"], runs["charged"]
    assert charged["decode_steps"] == hidden["decode_steps"] and charged["num_compressions"] > 0
    assert charged["num_compressions"] == hidden["num_compressions"] and hidden["compression_s"] == 0
    # at least f per batch and g per thousand tokens of each compressed request (>= one block of 16)
    assert charged["compression_s"] >= charged["num_compressions"] * 0.25 * 16 / 1e6
    assert charged["model_s"] - hidden["model_s"] == pytest.approx(charged["compression_s"], rel=1e-9)


def _brute_overlap(start: float, end: float, intervals) -> float:
    """Length of [start, end] covered by ``intervals``, on a fine grid of their endpoints."""
    points = sorted({start, end, *(p for iv in intervals for p in iv)})
    return sum(b - a for a, b in zip(points, points[1:])
               if start <= a and b <= end and any(s <= a and b <= e for s, e in intervals))


def test_gpu_timeline_summary_matches_brute_force():
    """The trace's summary (sorted sweeps) equals a plain piecewise count on random timelines."""
    import random

    from zipage.runner.trace import timeline_summary

    rng = random.Random(0)
    for _ in range(30):
        t, steps, compressions = 0.0, [], []
        for _ in range(rng.randint(1, 25)):
            t += rng.choice([0.0, rng.random()])  # back to back or after a gap
            steps.append((t, t + rng.uniform(0.1, 2.0)))
            t = steps[-1][1]
        for _ in range(rng.randint(0, 8)):
            a = rng.uniform(-1.0, t + 1.0)
            compressions.append((a, a + rng.uniform(0.05, 3.0)))
        got = timeline_summary(steps, compressions)
        busy = steps + compressions
        lo, hi = min(a for a, _ in busy), max(b for _, b in busy)
        busy_s = _brute_overlap(lo, hi, busy)
        assert abs(got["gpu_busy_s"] - busy_s) < 1e-9 and abs(got["gpu_span_s"] - (hi - lo)) < 1e-9
        hidden = sum(_brute_overlap(a, b, steps) for a, b in compressions)
        assert abs(got["compression_hidden_s"] - hidden) < 1e-9
        gaps = sum(b - a - _brute_overlap(a, b, compressions)
                   for (_, a), (b, _) in zip(steps, steps[1:]) if b > a)
        assert abs(got["idle_ms_per_step"] - 1000 * gaps / len(steps)) < 1e-6
        under = [b - a for a, b in steps if _brute_overlap(a, b, compressions) > 0]
        if under:
            assert abs(got["step_ms_under_compression"] - 1000 * sum(under) / len(under)) < 1e-6
        else:
            assert got["step_ms_under_compression"] is None


def test_profile_breakdown_groups_kernels_and_idle_time():
    from zipage.bench.profile import breakdown, kind_of

    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert kind_of("_decode_split_kernel") == "attention" and kind_of("_store_kv_kernel") == "kv store"
    assert kind_of("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "collective"
    assert kind_of("triton_red_fused_add_mean_mul_pow_rsqrt_0") == "fused elementwise"
    assert kind_of("_add_rms_norm_kernel") == kind_of("_norm_rope_kernel") == "norm and rope"
    assert kind_of("_redundancy_kernel") == "compression" and kind_of("mystery") == "other"
    assert kind_of("_choose_kept_kernel") == kind_of("_compact_single_pass_kernel") == "compression"
    assert kind_of("_merge_parts_kernel") == kind_of("_decode_fp8_probs_kernel") == "attention"
    assert kind_of("_fp8_dot_kernel") == kind_of("_fp8_dot_tma_kernel") == "matmul"
    assert kind_of("_silu_mul_quantize_kernel") == kind_of("_quantize_rows_kernel") == "fp8 quantize"
    # two steps of 10 ms: per step a 4 ms product and a 1 ms kernel overlapping it by 0.5 ms, 2 ms of attention
    kernels = []
    for t0 in (0.0, 10_000.0):
        kernels += [("gemm_a", t0, t0 + 4000), ("triton_poi_fused_0", t0 + 3500, t0 + 4500),
                    ("_decode_merge_kernel", t0 + 5000, t0 + 7000)]
    rows = {r["kind"]: r for r in breakdown(kernels, num_steps=2, step_s=0.010)}
    assert rows["matmul"]["ms_per_step"] == 4.0 and rows["matmul"]["kernels_per_step"] == 1
    assert rows["attention"]["ms_per_step"] == 2.0 and rows["fused elementwise"]["ms_per_step"] == 1.0
    assert abs(rows["no kernel running"]["ms_per_step"] - 3.5) < 1e-9  # 10 - (4.5 + 2) busy
    assert abs(rows["matmul"]["share"] - 0.4) < 1e-9
    with pytest.raises(ValueError, match="num_steps must be >= 1, got 0"):
        breakdown(kernels, 0, 0.01)


def test_decode_benchmark_profiles_steps(tmp_path, capsys):
    out = tmp_path / "decode.json"
    code = cli_main(["bench", "decode", "--shape", "tiny", "--batch", "2", "--context", "16", "--steps", "4",
                     "--modes", "eager", "--device", "cpu", "--block-size", "16", "--profile-steps", "3",
                     "--out", str(out)])
    assert code == 0
    (row,) = json.loads(out.read_text())["rows"]
    kinds = {r["kind"]: r for r in row["profile"]}
    assert kinds["matmul"]["kernels_per_step"] > 0 and "no kernel running" in kinds
    assert all(r["ms_per_step"] >= 0 for r in row["profile"])
    capsys.readouterr()
    assert cli_main(["bench", "decode", "--shape", "tiny", "--device", "cpu", "--profile-steps", "-1"]) != 0
    assert "--profile-steps >= 0 (got -1)" in capsys.readouterr().err


def test_decode_benchmark_runs_every_sampling_variant_beside_plain(tmp_path, capsys):
    out = tmp_path / "decode.json"
    code = cli_main(["bench", "decode", "--shape", "tiny", "--batch", "3", "--context", "40", "--steps", "8",
                     "--modes", "eager", "--device", "cpu", "--block-size", "16", "--kv-budget-tokens", "32",
                     "--variants", "logprobs,json,budgets,penalties", "--out", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    rows = {r["sampling"]: r for r in record["rows"]}
    assert list(rows) == ["plain", "logprobs", "json", "budgets", "penalties"]
    assert rows["plain"]["vs_plain"] == 1.0 and all(r["timed_steps"] >= 5 and r["vs_plain"] > 0 for r in rows.values())
    assert record["json_schema"]["required"] == ["reasoning", "answer"] and record["kv_budget_tokens"] == 32
    capsys.readouterr()
    assert cli_main(["bench", "decode", "--shape", "tiny", "--device", "cpu", "--variants", "budgets"]) != 0
    assert "--variants budgets needs --kv-budget-tokens" in capsys.readouterr().err
    assert cli_main(["bench", "decode", "--shape", "tiny", "--device", "cpu", "--variants", "fast"]) != 0
    assert "unknown ['fast']" in capsys.readouterr().err


def test_decode_benchmark_tensor_parallel_counts_one_gpus_share(tmp_path):
    """``--tensor-parallel-size 2`` (gloo on the CPU) decodes the batch on two ranks; its roofline
    counts one rank's bytes: half the weights (vocabulary, heads and MLP split) and half the KV heads."""
    import subprocess
    import sys

    bytes_per_step = {}
    for tp in (1, 2):
        out = tmp_path / f"decode-tp{tp}.json"
        cmd = [sys.executable, "-m", "zipage.cli", "bench", "decode", "--shape", "tiny", "--batch", "4",
               "--context", "256", "--steps", "4", "--modes", "eager", "--device", "cpu", "--block-size", "16",
               "--tensor-parallel-size", str(tp), "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        record = json.loads(out.read_text())
        (row,) = record["rows"]
        assert record["tensor_parallel_size"] == tp and row.get("tp", 1) == tp and row["timed_steps"] >= 2
        bytes_per_step[tp] = row["bytes_per_step"]
    # the weights and the KV both split in two (the norms, replicated, are a few hundred bytes)
    assert 0.49 < bytes_per_step[2] / bytes_per_step[1] < 0.51, bytes_per_step
    # --one-rank-of 2: one rank's layers alone, in this process: the bytes of rank 0 at TP=2
    out = tmp_path / "decode-one-rank.json"
    assert cli_main(["bench", "decode", "--shape", "tiny", "--batch", "4", "--context", "256", "--steps", "4",
                     "--modes", "eager", "--device", "cpu", "--block-size", "16", "--one-rank-of", "2",
                     "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    (row,) = record["rows"]
    assert record["one_rank_of"] == 2 and row["one_rank_of"] == 2 and "tp" not in row
    assert row["bytes_per_step"] == bytes_per_step[2], (row["bytes_per_step"], bytes_per_step)


def test_one_rank_shape_divides_the_layers_a_rank_holds(capsys):
    from zipage.bench.common import one_rank_shape

    assert one_rank_shape("qwen3-8b", "qwen3", 2) == dict(num_attention_heads=16, num_key_value_heads=4,
                                                          intermediate_size=6144, head_dim=128, vocab_size=75968)
    # a config without head_dim keeps its head size; the vocabulary rounds up as the split pads it
    assert one_rank_shape("llama3-8b", "llama", 4) == dict(num_attention_heads=8, num_key_value_heads=2,
                                                           intermediate_size=3584, head_dim=128, vocab_size=32064)
    with pytest.raises(ValueError, match="num_key_value_heads=2 of shape 'tiny' does not divide by 4"):
        one_rank_shape("tiny", "qwen3", 4)
    with pytest.raises(ValueError, match="mixture of experts"):
        one_rank_shape("qwen3-30b-a3b", "qwen3", 2)
    for bad, error in ((["--one-rank-of", "0"], "--one-rank-of must be >= 1, got 0"),
                       (["--one-rank-of", "2", "--tensor-parallel-size", "2"], "not with --model or --tensor-par"),
                       (["--one-rank-of", "2", "--variants", "plain,json"], "not with the json variant")):
        assert cli_main(["bench", "decode", "--shape", "tiny", "--device", "cpu", *bad]) == 2
        assert error in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["decode", "throughput"])
def test_one_shot_all_reduce_benchmarks_take_one_mode(bench, capsys):
    """``--all-reduce one-shot`` at tensor-parallel size 2 runs one engine a process, so several
    --modes are refused before any engine is built (exit code 2, the error names the modes)."""
    from zipage.cli import main

    modes = "eager,graphs" if bench == "decode" else "full,zipage"
    argv = ["bench", bench, "--shape", "tiny", "--device", "cpu", "--tensor-parallel-size", "2",
            "--all-reduce", "one-shot", "--modes", modes]
    assert main(argv) == 2
    assert f"runs one engine a process: give one mode, got --modes {modes}" in capsys.readouterr().err


def test_qwen3_32b_shape_has_its_published_size(tmp_path):
    """The benchmark shape of Qwen3-32B builds (on the meta device) with its 32.8B parameters: 64 GB of
    bf16 weights, which tensor parallelism splits."""
    from zipage.bench.common import model_dir_for
    from zipage.models.registry import build_model
    from zipage.utils.loader import load_config

    model_dir, load_format = model_dir_for(None, "qwen3-32b", "qwen3")
    assert load_format == "dummy"
    with torch.device("meta"):
        model = build_model(load_config(model_dir), 4096)
    params = sum(p.numel() for p in model.parameters())
    assert 32.7e9 < params < 32.9e9, params
    spec = model.spec
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (64, 64, 8, 128)


def test_synthetic_tokenizer_has_the_size_asked_and_round_trips_text():
    from zipage.utils.checkpoint import build_tokenizer

    tok = build_tokenizer(20000, synthetic=True)
    assert len(tok) == 20000
    text = '{"reasoning": "Let x = 12; then x * 3 = 36.", "answer": 36}'
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_compression_benchmark_beside_decode_runs_and_returns_every_block(tmp_path, kv_cache_dtype):
    """Stages of one compression, then its cost beside other requests' decode steps (CPU: a smoke
    test; the bench itself raises if a block was not returned). With a float8 cache its kernel
    check compares the kernels with their twins on float8 keys and moves the scales too."""
    out = tmp_path / "compression.json"
    check = "0" if kv_cache_dtype == "auto" else "1"
    code = cli_main(["bench", "compression", "--shape", "tiny", "--device", "cpu", "--requests", "1,2",
                     "--budget", "64", "--block-size", "16", "--check", check, "--beside", "3",
                     "--kv-cache-dtype", kv_cache_dtype, "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["kv_cache_dtype"] == kv_cache_dtype
    if kv_cache_dtype == "fp8":
        errors = result["kernel_errors"]
        assert errors["attention"] < 1e-5 and errors["redundancy"] < 1e-5 and errors["compaction"] == 0
    assert [row["requests"] for row in result["rows"]] == [1, 2]
    assert [row["requests"] for row in result["beside_decode"]] == [1, 2]
    for row in result["beside_decode"]:
        assert row["decoding"] == 3 and row["isolated_ms"] > 0 and row["step_alone_ms"] > 0


def test_max_seconds_cuts_a_run_short_and_counts_its_tokens(tmp_path, capsys, monkeypatch):
    """``--max-seconds`` aborts what is unfinished once the time is up: the tokens produced so far
    count, every block comes back, and the result says it was cut short (replay: modelled time)."""
    import itertools
    import time

    common = ["--shape", "tiny", "--scale", "small", "--device", "cpu", "--modes", "full,zipage"]
    clock = itertools.count(step=1e-3)  # a clock that each reading moves on: the cut comes after a few steps
    with monkeypatch.context() as m:
        m.setattr(time, "perf_counter", lambda: next(clock))
        assert cli_main(["bench", "throughput", *common, "--hf-requests", "0", "--max-seconds", "0.2",
                         "--out", str(tmp_path / "run")]) == 0
    assert "cut short at" in capsys.readouterr().out
    run = json.loads((tmp_path / "run" / "throughput.json").read_text())
    for metrics in run["modes"].values():
        assert metrics["truncated_at_s"] is not None and metrics["blocks_returned"]
        assert metrics["finished_requests"] < metrics["requests"]
        assert 0 < metrics["output_tokens"] < run["workload"]["output_tokens"]

    assert cli_main(["bench", "replay", *common, "--out", str(tmp_path / "whole")]) == 0
    whole = json.loads((tmp_path / "whole" / "replay.json").read_text())["modes"]
    half = whole["full"]["model_s"] / 2
    assert cli_main(["bench", "replay", *common, "--max-seconds", str(half), "--out", str(tmp_path / "half")]) == 0
    cut = json.loads((tmp_path / "half" / "replay.json").read_text())["modes"]["full"]
    assert whole["full"]["truncated_at_s"] is None and cut["truncated_at_s"] >= half
    assert cut["model_s"] == pytest.approx(cut["truncated_at_s"])  # nothing runs after the cut
    assert 0 < cut["output_tokens"] < whole["full"]["output_tokens"]
    assert cut["decode_steps"] < whole["full"]["decode_steps"]
    assert cli_main(["bench", "replay", *common, "--max-seconds", "0"]) != 0
    assert "--max-seconds must be > 0, got 0" in capsys.readouterr().err


def test_a_traced_step_spans_its_forward_and_its_sampler(checkpoint_dir):
    """The GPU timeline's step interval opens before the step's forward is queued and closes
    after its sampler (events stand in for CUDA's on the CPU)."""
    from tests.conftest import make_llm
    from zipage import SamplingParams

    log = []

    class Trace:
        steps, compressions = [], []

        def mark(self):
            log.append("mark")
            return len(log) - 1

    llm = make_llm(checkpoint_dir("qwen3"))
    runner = llm.engine.runner
    runner.trace = Trace()
    forward, sample = runner.logits, runner.sampler.sample
    runner.logits = lambda *a, **k: (log.append("forward"), forward(*a, **k))[1]
    runner.sampler.sample = lambda *a, **k: (log.append("sample"), sample(*a, **k))[1]
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert Trace.steps and all(log[a] == "mark" and log[a + 1] == "forward" and log[b - 1] == "sample"
                               for a, b in Trace.steps)


def test_chunks_benchmark_times_every_chunk_of_the_prompt(tmp_path, capsys):
    common = ["bench", "chunks", "--shape", "tiny", "--device", "cpu", "--streams", "4", "--input-len", "16",
              "--prompt-len", "300", "--max-num-batched-tokens", "36", "--piecewise-graph-tokens", "40"]
    assert cli_main([*common, "--out", str(tmp_path / "plain")]) == 0
    result = json.loads((tmp_path / "plain" / "chunks.json").read_text())
    steps = result["steps"]  # (depth, chunk tokens, host ms, wall ms)
    assert [s[1] for s in steps] == [32] * 9 + [12]  # 36 tokens a step, 4 of them the streams' decodes
    assert [s[0] for s in steps] == [32 * i for i in range(10)]
    assert all(0 < host <= wall for _, _, host, wall in steps)
    assert result["piecewise_graph_tokens"] == 36  # capped at a step's tokens
    assert result["summary"]["mixed_steps"] == 10 and sum(b["steps"] for b in result["bands"]) == 10
    assert result["summary"]["decode_step_ms"] > 0
    # Every step from the prompt's arrival is recorded by kind: here each one ran a chunk.
    assert [e["chunk_tokens"] for e in result["every_step"]] == [s[1] for s in steps]
    assert [row["kind"] for row in result["kinds"]] == ["chunk"] and result["kinds"][0]["steps"] == 10
    out = capsys.readouterr().out
    assert "decode step before the prompt" in out and "every step while the prompt was prefilled" in out

    assert cli_main([*common, "--profile", "--out", str(tmp_path / "profiled")]) == 0
    result = json.loads((tmp_path / "profiled" / "chunks.json").read_text())
    # The profiler recorded the three steps from 3/4 of the prompt on (its last two chunks, then a decode).
    assert [s[0] for s in result["steps"]] == [32 * i for i in range(8)]
    kinds = {row["kind"] for row in result["profile"]}
    assert {"matmul", "attention", "no kernel running"} <= kinds

    # With a budget the requests are compressed (the prompt between its chunks) and every chunk still runs.
    assert cli_main([*common, "--kv-budget-tokens", "64", "--block-size", "16", "--prefill-compression", "always",
                     "--out", str(tmp_path / "compressed")]) == 0
    result = json.loads((tmp_path / "compressed" / "chunks.json").read_text())
    chunks = [s[1] for s in result["steps"]]  # a stream being compressed skips its decode: its room goes to the chunk
    assert sum(chunks) == 300 and max(chunks) <= 36 and result["summary"]["compressions"] >= 4
    every = result["every_step"]
    assert sum(e["chunk_tokens"] for e in every) == 300 and sum(e["compressions"] for e in every) >= 1
    assert all(e["kind"] == step_kind(e["chunk_tokens"], e["compressions"]) for e in every)
    assert sum(row["steps"] for row in result["kinds"]) == len(every)

    assert cli_main([*common[:-4], "--max-num-batched-tokens", "4"]) == 2
    assert "--max-num-batched-tokens must exceed --streams (4), whose decodes come first in every step, got 4" \
        in capsys.readouterr().err
