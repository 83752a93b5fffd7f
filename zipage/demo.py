"""``zipage demo``: the trained reasoning model on the CPU, full KV against compression.

The project's 13.8M-parameter Qwen3 model (``checkpoints/ledger-14m``, trained on the
synthetic ledger task of ``zipage/quality/tasks.py``) solves held-out problems of
about 1,000-1,300 tokens twice: with the full KV cache, and with every request held to a
fixed budget of cached tokens per layer and KV head by Compressed PagedAttention. It
prints accuracy, the correct-prefix fraction, peak KV memory per request and output
tokens/s for both, then checks a few greedy outputs token for token against
``transformers``' own ``generate``.
"""

from __future__ import annotations

import argparse
import os

CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "ledger-14m")


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="the trained reasoning model on the CPU: full KV against compression")
    p.add_argument("--model", default=CHECKPOINT, help="checkpoint trained on the synthetic task")
    p.add_argument("--num-problems", type=int, default=24)
    p.add_argument("--budget", type=int, default=512, help="KV budget in tokens per layer and KV head")
    p.add_argument("--check", type=int, default=2, help="outputs compared with transformers' generate")
    p.add_argument("--check-tokens", type=int, default=96, help="tokens generated per compared output")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from zipage.quality.demo import compare, transformers_check

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise ValueError(f"--model {args.model!r} is not a checkpoint directory (no config.json); the trained "
                         "model ships in the repository under checkpoints/ledger-14m")
    print(f"model: {args.model}")
    runs = compare(args.model, num_problems=args.num_problems, budget_tokens=args.budget, device=args.device)
    same, total = transformers_check(args.model, args.check, args.check_tokens, args.device)
    print(f"\ngreedy tokens equal to transformers' generate: {same}/{total} "
          f"(first {args.check_tokens} tokens of {total} problems, full KV)")
    full, compressed = runs.values()
    saving = 1 - compressed["peak_kv_bytes_mean"] / full["peak_kv_bytes_mean"]
    print(f"compression kept {compressed['accuracy']:.0%} accuracy against {full['accuracy']:.0%} with "
          f"{saving:.0%} less KV memory per request")
    return 0 if same == total else 1
