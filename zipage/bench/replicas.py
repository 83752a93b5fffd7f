"""``zipage bench replay --replicas N``: the replay with N data-parallel replicas behind a router.

Each replica is an engine of its own (one GPU: the same KV cache cap as the single-engine
replay) with its own simulated runner and clock. Requests arrive as the options say (all at
t = 0, or prompts as a Poisson process, the samples of a prompt together), and at its arrival
each goes where ``zipage.routing.Router`` sends it, the router seeing every replica's
running and waiting requests and KV usage as of that moment (to within the step a replica
is in) and its own count of requests in flight, with the prompt's prefix keys
(``chunk_keys`` of its token ids, one per KV block). Simulated time advances by events:
arrivals due are delivered first, then the replica whose clock is earliest takes a step.

It predicts aggregate tokens/s, request latency (arrival to last token), time to first
token and the prefix cache's hit rate for each mode, replica count and routing policy.
It does not model the network, the router's own time, nor replicas that differ (each
runs the same step model).
"""

from __future__ import annotations

import heapq
import json
import math
import os

import numpy as np

from zipage.bench.common import print_table
from zipage.bench.replay import (SimulatedRunner, build_replay_engine, busy_seconds, finish_replay,
                                 replay_params)


class ReplicaRunner(SimulatedRunner):
    """A ``SimulatedRunner`` whose clock can wait (an idle replica's time passes too), and which
    notes when each request's first token is ready: at the end of its first prefill step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.idle_s = 0.0
        self.first_token_at: dict[str, float] = {}

    @property
    def clock(self) -> float:
        return busy_seconds(self) + self.idle_s

    def wait_until(self, t: float) -> None:
        self.idle_s += max(0.0, t - self.clock)

    def launch(self, seqs, is_prefill: bool, eos_token_ids, previous=None):
        step = super().launch(seqs, is_prefill, eos_token_ids, previous)
        if is_prefill:
            now = self.clock
            for seq in seqs:
                if seq.chunk is not None and seq.samples:  # the last chunk of its prompt
                    self.first_token_at.setdefault(seq.request_id, now)
        return step


def arrival_times(requests, rate: float | None, seed: int) -> list[float]:
    """When each request arrives: all at 0 without a rate; else the prompts (runs of consecutive
    requests with the same prompt: its samples) as a Poisson process of ``rate / mean samples``
    prompts a second, so that requests arrive at ``rate`` a second, each prompt's samples together."""
    groups: list[int] = []  # request -> its prompt's group
    for i, r in enumerate(requests):
        same = i > 0 and (r.prompt is requests[i - 1].prompt or r.prompt == requests[i - 1].prompt)
        groups.append(groups[-1] if same else (groups[-1] + 1 if groups else 0))
    if rate is None or math.isinf(rate):
        return [0.0] * len(requests)
    if not rate > 0:
        raise ValueError(f"--arrival-rate must be > 0, got {rate}")
    num_groups = groups[-1] + 1 if groups else 0
    group_rate = rate * num_groups / max(len(requests), 1)
    gaps = np.random.default_rng(seed).exponential(1 / group_rate, num_groups)
    starts = np.concatenate([[0.0], np.cumsum(gaps)[:-1]])  # the first prompt at t = 0
    return [float(starts[g]) for g in groups]


def simulate_replicas(mode: str, num_replicas: int, policy: str, args, settings: dict, model_dir: str, requests,
                      cache_tokens: int, step_model: dict, arrivals: list[float]) -> dict:
    """Serve ``requests`` arriving at ``arrivals`` (seconds) with ``num_replicas`` replicas of ``mode``
    behind a ``policy`` router; return the run's metrics (see the module's docstring)."""
    from zipage.routing import Router, chunk_keys

    replicas = [build_replay_engine(mode, args, settings, model_dir, requests, cache_tokens, step_model,
                                    runner_class=ReplicaRunner) for _ in range(num_replicas)]
    engines = [engine for engine, _, _ in replicas]
    runners: list[ReplicaRunner] = [runner for _, runner, _ in replicas]
    opts = replicas[0][2]
    router = Router(num_replicas, policy)
    block_size = engines[0].config.cache.block_size
    keys_of: dict[int, list[bytes]] = {}  # id(prompt) -> its chunk keys (samples share the prompt)
    order = sorted(range(len(requests)), key=lambda i: (arrivals[i], i))
    index_of: list[dict[str, int]] = [{} for _ in engines]  # per replica: request id -> workload index
    placed = [0] * len(requests)
    first_token = [math.nan] * len(requests)
    finished_at = [math.nan] * len(requests)
    output_tokens = [0] * len(requests)
    cached_prompt_tokens = [0] * len(requests)
    served = [0] * num_replicas
    steps = batch_sum = preempted = 0
    busy: list[tuple[float, int]] = []  # (clock, replica) of the replicas with unfinished requests
    in_heap = [False] * num_replicas
    next_arrival = 0
    while True:
        due = next_arrival < len(order) and (not busy or arrivals[order[next_arrival]] <= busy[0][0])
        if due:  # the next arrival comes before any replica's next step: route it
            i = order[next_arrival]
            next_arrival += 1
            request = requests[i]
            for r, engine in enumerate(engines):
                bm = engine.block_manager
                router.report(r, len(engine.scheduler.running), len(engine.scheduler.waiting),
                              1 - bm.num_free_blocks / bm.num_blocks)
            keys = ()
            if policy == "prefix":
                keys = keys_of.get(id(request.prompt))
                if keys is None:
                    keys = keys_of[id(request.prompt)] = chunk_keys(request.prompt, block_size)
            r = router.choose(keys)
            placed[i] = r
            served[r] += 1
            runners[r].wait_until(arrivals[i])
            index_of[r][engines[r].add_request(request.prompt, replay_params(i, request))] = i
            if not in_heap[r]:
                heapq.heappush(busy, (runners[r].clock, r))
                in_heap[r] = True
            continue
        if not busy:
            break
        _, r = heapq.heappop(busy)
        engine, runner = engines[r], runners[r]
        before = runner.clock
        outputs, stats = engine.step()
        # With asynchronous scheduling a step returns the previous step's outputs, which were
        # ready when it ended: at the clock before this step was charged.
        done_at = before if engine.async_scheduling else runner.clock
        for out in outputs:
            i = index_of[r].pop(out.request_id)  # a KeyError if a request finished twice
            finished_at[i] = done_at
            output_tokens[i] = len(out.outputs[0].token_ids)
            cached_prompt_tokens[i] = out.metrics.num_cached_prompt_tokens
            first_token[i] = runner.first_token_at.pop(out.request_id)
            router.finished(r)
        if stats is not None:
            preempted += stats.num_preempted
            if stats.num_decodes:
                steps += 1
                batch_sum += stats.num_decodes
        if engine.has_unfinished_requests():
            heapq.heappush(busy, (runner.clock, r))
        else:
            in_heap[r] = False
    for engine, runner in zip(engines, runners):
        finish_replay(mode, engine, runner)  # raises unless every block is back in the pool
    unfinished = [i for i, t in enumerate(finished_at) if math.isnan(t)]
    if unfinished:
        raise RuntimeError(f"{mode}: {len(unfinished)} requests never finished")
    makespan = max(runner.clock for runner in runners) - min(arrivals, default=0.0)
    latency = np.array(finished_at) - np.array(arrivals)
    ttft = np.array(first_token) - np.array(arrivals)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    outputs = sum(output_tokens)
    return dict(mode=mode, replicas=num_replicas, routing=policy, options=opts, requests=len(requests),
                output_tokens=outputs, model_s=makespan, tokens_per_s=outputs / makespan,
                mean_latency_s=float(latency.mean()), p50_latency_s=float(np.percentile(latency, 50)),
                p99_latency_s=float(np.percentile(latency, 99)), mean_ttft_s=float(ttft.mean()),
                p99_ttft_s=float(np.percentile(ttft, 99)),
                prefix_hit_rate=sum(cached_prompt_tokens) / max(prompt_tokens, 1),
                cached_prompt_tokens=sum(cached_prompt_tokens), prompt_tokens=prompt_tokens,
                routed_prefix_matches=router.prefix_hits, requests_per_replica=served,
                busy_s_per_replica=[busy_seconds(runner) for runner in runners],
                decode_steps=steps, mean_batch=batch_sum / max(steps, 1), num_preemptions=preempted,
                num_compressions=sum(engine.stats.num_compressions for engine in engines),
                num_blocks=runners[0].num_blocks, placement=placed,
                free_blocks_per_replica=[engine.block_manager.num_free_blocks for engine in engines])


def parse_replicas(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--replicas needs comma-separated integers, got {text!r}") from None
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"--replicas counts must be >= 1, got {text!r}")
    return counts


def parse_routing(text: str) -> list[str]:
    from zipage.routing import POLICIES

    policies = text.split(",")
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"--routing: unknown policy {bad[0]!r}; choose from {', '.join(POLICIES)}")
    return policies


def replica_workload(args, model_dir: str, requests, cache_tokens: int, scale: float, num_replicas: int):
    """The requests of an ``num_replicas`` run: the workload as given, or with --weak-scaling one
    ``num_replicas`` times as large (seeded the same way: the standard run's peak KV demand is twice
    all the replicas' caches together; --num-requests is per replica)."""
    if not args.weak_scaling or num_replicas == 1:
        return requests
    from zipage.bench.throughput import _trust
    from zipage.bench.workloads import make_workload, requests_for_demand
    from zipage.utils.loader import load_config

    vocab = load_config(model_dir, _trust(args)).vocab_size
    if args.num_requests:
        total = args.num_requests * num_replicas
        return make_workload(args.workload, math.ceil(total / args.samples_per_prompt), args.samples_per_prompt,
                             vocab, args.seed, scale)[:total]
    return requests_for_demand(args.workload, 2 * cache_tokens * num_replicas, vocab, args.seed, scale,
                               args.samples_per_prompt)


def run_replicas_bench(args, settings: dict, model_dir: str, requests, cache_tokens: int, modes: list[str],
                       step_model: dict) -> int:
    counts = parse_replicas(args.replicas or "1")
    policies = parse_routing(args.routing)
    rows = []
    for mode in modes:
        for n in counts:
            workload = replica_workload(args, model_dir, requests, cache_tokens, settings["scale"], n)
            rate = args.arrival_rate * (n if args.weak_scaling else 1) if args.arrival_rate else None
            arrivals = arrival_times(workload, rate, args.seed)
            for policy in policies:
                if n == 1 and policy != policies[0]:  # one replica: every policy sends it everything
                    row = dict(rows[-1], routing=policy, routed_prefix_matches=None)
                else:
                    row = simulate_replicas(mode, n, policy, args, settings, model_dir, workload, cache_tokens,
                                            step_model, arrivals)
                rows.append(row)
                print(f"  {mode} x{n} {policy}: {row['tokens_per_s']:,.0f} tokens/s, "
                      f"{row['requests']} requests in {row['model_s']:,.1f} s", flush=True)
    for row in rows:
        base = next((b for b in rows if b["mode"] == row["mode"] and b["routing"] == row["routing"]
                     and b["replicas"] == 1), None)
        row["scaling_efficiency"] = row["tokens_per_s"] / (row["replicas"] * base["tokens_per_s"]) if base else None
    print()
    print_table(rows, ["mode", "replicas", "routing", "requests", "tokens_per_s", "scaling_efficiency",
                       "mean_latency_s", "p99_latency_s", "p99_ttft_s", "prefix_hit_rate", "num_preemptions",
                       "model_s"])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        arrival = (f"Poisson, {args.arrival_rate:g} requests/s" + (" per replica" if args.weak_scaling else "")
                   if args.arrival_rate else "all at t = 0")
        with open(os.path.join(args.out, "replicas.json"), "w") as f:
            json.dump(dict(benchmark="replay-replicas", workload=args.workload, settings=settings,
                           step_model=step_model, kv_cache_tokens_per_replica=cache_tokens,
                           samples_per_prompt=args.samples_per_prompt, arrivals=arrival,
                           weak_scaling=args.weak_scaling, runs=rows), f, indent=1)
        plot_replicas(rows, os.path.join(args.out, "replicas.png"),
                      f"bench replay: {args.workload}, {arrival}, "
                      f"{'workload x replicas' if args.weak_scaling else 'same workload for every N'}")
    return 0


def plot_replicas(rows: list[dict], path: str, title: str) -> None:
    """Tokens/s and mean request latency against the number of replicas, one line per mode and
    routing (dotted: N x the single replica's tokens/s)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    lines = {}
    for row in rows:
        lines.setdefault((row["mode"], row["routing"]), []).append(row)
    modes = list(dict.fromkeys(mode for mode, _ in lines))
    policies = list(dict.fromkeys(policy for _, policy in lines))
    counts = sorted({row["replicas"] for row in rows})
    for (mode, policy), runs in lines.items():  # a color per mode, a line style per routing policy
        runs = sorted(runs, key=lambda r: r["replicas"])
        n = [r["replicas"] for r in runs]
        style = dict(color=f"C{modes.index(mode)}", linestyle=("-", "--", "-.")[policies.index(policy) % 3],
                     marker="o^s"[policies.index(policy) % 3], label=f"{mode}, {policy}")
        axes[0].plot(n, [r["tokens_per_s"] for r in runs], **style)
        if runs[0]["replicas"] == 1 and policies.index(policy) == 0:
            axes[0].plot(n, [k * runs[0]["tokens_per_s"] for k in n], linestyle=":", color=style["color"],
                         linewidth=1)
        axes[1].plot(n, [r["mean_latency_s"] for r in runs], **style)
    for ax, label in zip(axes, ("output tokens/s (dotted: N x one replica)", "mean request latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.set_xlabel("replicas (one GPU each)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
