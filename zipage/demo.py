"""``zipage demo``: the trained reasoning model on the CPU, full KV against compression.

The project's 13.8M-parameter Qwen3 model (``checkpoints/ledger-14m``, trained on the
synthetic ledger task of ``zipage/quality/tasks.py``) solves a few held-out problems of
about 1,000 tokens three times: with the full KV cache, and with every request held to a
fixed budget of cached tokens per layer and KV head by Compressed PagedAttention, once
with the published defaults and once with the settings tuned on this task. It prints
accuracy, the correct-prefix fraction and peak KV memory per request for each run and a
one-line verdict, then checks a few greedy outputs token for token against
``transformers``' own ``generate``. About two minutes on a 2-core CPU (docs/quality.md).
"""

from __future__ import annotations

import argparse
import os
import time

CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "ledger-14m")


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="the trained reasoning model on the CPU: full KV against compression")
    p.add_argument("--model", default=CHECKPOINT, help="checkpoint trained on the synthetic task")
    p.add_argument("--num-problems", type=int, default=4, help="held-out problems solved by every run")
    p.add_argument("--budget", type=int, default=448,
                   help="KV budget: tokens kept per layer and KV head, a multiple of the block size (32)")
    p.add_argument("--check", type=int, default=2,
                   help="full-KV outputs compared with transformers' generate (0: none)")
    p.add_argument("--check-tokens", type=int, default=64, help="tokens generated per compared output")
    p.add_argument("--device", default="cpu")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs side by side, one CPU thread each (default on a CPU: 2 if it has 2 cores or more)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    from zipage.quality.demo import compare, verdict

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise ValueError(f"--model {args.model!r} is not a checkpoint directory (no config.json); the trained "
                         "model ships in the repository under checkpoints/ledger-14m")
    if args.num_problems < 1:
        raise ValueError(f"--num-problems must be >= 1, got {args.num_problems}")
    import torch

    print(f"Zipage demo: model {os.path.relpath(args.model)} on {args.device}")
    threads = torch.get_num_threads()
    if args.device == "cpu":
        # The model's matrices are small (384 wide): one thread computes them as fast as two, and
        # it does not stall when another process takes a core (two threads then ran 5-20x slower).
        torch.set_num_threads(1)
    try:
        runs, check = compare(args.model, num_problems=args.num_problems, budget_tokens=args.budget,
                              device=args.device, progress=not args.no_progress, workers=args.jobs,
                              check_problems=min(args.check, args.num_problems), check_tokens=args.check_tokens)
    finally:
        torch.set_num_threads(threads)
    print(verdict(runs))
    print(f"(finished in {time.perf_counter() - start:.0f} s)")
    return 0 if check is None or check[0] == check[1] else 1
