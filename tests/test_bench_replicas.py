"""``zipage bench replay --replicas``: the replay with data-parallel replicas behind the router."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from zipage.cli import main as cli_main

# Prompts of 8 to 64 tokens in blocks of 16, so that a prompt's samples can share cached blocks.
TINY = ["--scale", "0.0625", "--block-size", "16", "--budget", "128", "--num-requests", "24",
        "--samples-per-prompt", "3"]


@pytest.fixture(scope="module")
def workload():
    from zipage.bench.replay import parse_step_model
    from zipage.bench.throughput import prepare_workload
    from zipage.cli import build_parser

    args = build_parser().parse_args(["bench", "replay", *TINY])
    settings, model_dir, _, requests, cache_tokens, _ = prepare_workload(args)
    return args, settings, model_dir, requests, cache_tokens, parse_step_model(None)


def simulate(workload, mode, n, policy, rate=None):
    from zipage.bench.replicas import arrival_times, simulate_replicas

    args, settings, model_dir, requests, cache_tokens, step_model = workload
    arrivals = arrival_times(requests, rate, args.seed)
    return simulate_replicas(mode, n, policy, args, settings, model_dir, requests, cache_tokens, step_model, arrivals)


def test_one_replica_reproduces_the_single_engine_replay(workload):
    from zipage.bench.replay import replay_mode

    args, settings, model_dir, requests, cache_tokens, step_model = workload
    for mode in ("full", "zipage"):
        single = replay_mode(mode, args, settings, model_dir, requests, cache_tokens, step_model)
        for policy in ("prefix", "load", "round_robin"):
            run = simulate(workload, mode, 1, policy)
            for key in ("output_tokens", "model_s", "tokens_per_s", "decode_steps", "mean_batch",
                        "num_preemptions", "num_compressions", "num_blocks"):
                assert run[key] == single[key], (mode, policy, key)


def test_two_replicas_serve_every_request_once_and_prefix_routing_keeps_samples_together(workload):
    _, _, _, requests, _, _ = workload
    runs = {policy: simulate(workload, "full", 2, policy) for policy in ("prefix", "round_robin")}
    for run in runs.values():
        assert run["output_tokens"] == sum(r.max_tokens for r in requests)
        assert sum(run["requests_per_replica"]) == len(requests) and min(run["requests_per_replica"]) > 0
        assert run["free_blocks_per_replica"] == [run["num_blocks"]] * 2  # every block back in each pool
        assert 0 < run["mean_latency_s"] <= run["p99_latency_s"] <= run["model_s"]
        assert 0 < run["p99_ttft_s"] <= run["p99_latency_s"]
    # Prefix routing puts a prompt's samples on one replica (the loads allow it here), so that its
    # prefix cache serves the later samples; round robin spreads them.
    by_prompt = defaultdict(set)
    for request, replica in zip(requests, runs["prefix"]["placement"]):
        by_prompt[id(request.prompt)].add(replica)
    assert all(len(replicas) == 1 for replicas in by_prompt.values())
    assert runs["prefix"]["prefix_hit_rate"] > runs["round_robin"]["prefix_hit_rate"] > 0


def test_poisson_arrivals_bring_a_prompts_samples_together():
    from zipage.bench.replicas import arrival_times
    from zipage.bench.workloads import make_workload

    requests = make_workload("reasoning-8k", 400, 4, 1000, 0, scale=1 / 64)
    assert arrival_times(requests, None, 0) == [0.0] * len(requests)
    times = arrival_times(requests, 8.0, 0)
    assert times[0] == 0.0 and times == sorted(times)
    assert all(len(set(times[i:i + 4])) == 1 for i in range(0, len(times), 4))
    assert len(requests) / times[-1] == pytest.approx(8.0, rel=0.15)
    with pytest.raises(ValueError):
        arrival_times(requests, 0.0, 0)


def test_replicas_cli_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "replicas"
    assert cli_main(["bench", "replay", *TINY, "--modes", "zipage", "--replicas", "1,2", "--routing",
                     "prefix,load", "--arrival-rate", "2", "--out", str(out)]) == 0
    result = json.loads((out / "replicas.json").read_text())
    runs = {(r["replicas"], r["routing"]): r for r in result["runs"]}
    assert set(runs) == {(1, "prefix"), (1, "load"), (2, "prefix"), (2, "load")}
    assert runs[1, "prefix"]["scaling_efficiency"] == 1.0
    assert runs[2, "load"]["scaling_efficiency"] == pytest.approx(
        runs[2, "load"]["tokens_per_s"] / (2 * runs[1, "load"]["tokens_per_s"]))
    assert result["arrivals"] == "Poisson, 2 requests/s"
    assert (out / "replicas.png").stat().st_size > 0
    assert "scaling_efficiency" in capsys.readouterr().out
    assert cli_main(["bench", "replay", *TINY, "--replicas", "0"]) != 0
    assert cli_main(["bench", "replay", *TINY, "--replicas", "2", "--routing", "random"]) != 0
