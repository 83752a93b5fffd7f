"""``zipage bench router``: what the data-parallel path adds per call, against the plain server.

One run serves the same model on this machine by three paths: ``zipage serve``'s app in this
process; one replica on a local Ray cluster, called directly; and the router in front of that
replica (the path of ``zipage serve --data-parallel-size N``). The same short calls go to
each, one at a time, in turn, so all see the same machine; the report gives each path's
median latency and the ratio of the router's to the plain server's. The difference is the router's hop (a loopback HTTP relay) and its bookkeeping: Ray
places and restarts replicas but is not on a call's path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def add_router_parser(sub) -> None:
    p = sub.add_parser("router", help="latency the data-parallel router adds per call, against the plain server",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random one written here)")
    p.add_argument("--calls", type=int, default=200, help="calls per path (default %(default)s)")
    p.add_argument("--max-tokens", default="1,16", help="output lengths, comma-separated (default %(default)s)")
    p.add_argument("--stream", action="store_true", help="streamed calls (time to the last event)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="directory for router.json")
    p.set_defaults(func=run)


def _time_calls(client, url: str, body: dict, calls: int, stream: bool, headers=None) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        if stream:
            with client.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                               headers=headers) as response:
                for _ in response.iter_raw():
                    pass
        else:
            response = client.post(url + "/v1/completions", json=body, headers=headers)
        times.append(time.perf_counter() - start)
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:200]}")
    return times


def run(args: argparse.Namespace) -> int:
    import tempfile

    import httpx

    from zipage import LLM
    from zipage.bench.common import print_table
    from zipage.server.app import create_app
    from zipage.server.background import ServerThread
    from zipage.server.replicas import ReplicaSet
    from zipage.server.router import create_router_app
    from zipage.utils.checkpoint import make_checkpoint

    if args.calls < 1:
        raise ValueError(f"--calls must be >= 1, got {args.calls}")
    lengths = [int(x) for x in args.max_tokens.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or make_checkpoint(os.path.join(scratch, "tiny"), seed=0)
        engine = dict(device=args.device, dtype="float32" if args.device == "cpu" else "auto", block_size=16)
        plain = ServerThread(create_app(LLM(model, **engine).engine, "m"))
        replicas = ReplicaSet(model, 1, engine, "m")
        router = ServerThread(create_router_app(replicas, "m", routing="load"))
        rows, results = [], []
        try:
            with httpx.Client(timeout=120) as client:
                for max_tokens in lengths:
                    body = {"model": "m", "prompt": "The quick brown fox", "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True}
                    inner = {"Authorization": f"Bearer {replicas.api_key}"}
                    paths = [(plain.url, None), (replicas.urls[0], inner), (router.url, None)]
                    for url, headers in paths:  # warm every path
                        _time_calls(client, url, body, 5, args.stream, headers)
                    direct, actor, routed = [], [], []
                    for _ in range(args.calls):  # in turn, so that every path sees the same machine
                        for times, (url, headers) in zip((direct, actor, routed), paths):
                            times += _time_calls(client, url, body, 1, args.stream, headers)
                    d, r = statistics.median(direct), statistics.median(routed)
                    a = statistics.median(actor)
                    result = {"max_tokens": max_tokens, "calls": args.calls, "stream": args.stream,
                              "plain_median_ms": d * 1e3, "router_median_ms": r * 1e3,
                              "replica_direct_median_ms": a * 1e3,
                              "plain_mean_ms": statistics.fmean(direct) * 1e3,
                              "router_mean_ms": statistics.fmean(routed) * 1e3,
                              "added_ms": (r - d) * 1e3, "ratio": r / d}
                    results.append(result)
                    rows.append({"max_tokens": max_tokens, "plain ms": f"{d * 1e3:.2f}",
                                 "replica ms": f"{a * 1e3:.2f}",
                                 "router ms": f"{r * 1e3:.2f}", "added ms": f"{(r - d) * 1e3:+.2f}",
                                 "ratio": f"{r / d:.3f}"})
        finally:
            router.stop()
            replicas.shutdown()
            plain.stop()
    print("median latency per call. plain: zipage serve's app in this process; replica: the Ray actor's app "
          "called directly; router: the router in front of that replica; ratio: router / plain")
    print_table(rows, ["max_tokens", "plain ms", "replica ms", "router ms", "added ms", "ratio"])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "router.json"), "w") as f:
            json.dump(results, f, indent=2)
    return 0
