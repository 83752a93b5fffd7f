"""``zipage demo``: the engine end to end on the CPU in well under a minute.

Builds a tiny random Qwen3 checkpoint with transformers, serves a batch of
prompts with shared prefixes through the engine, checks a few outputs token for
token against transformers' own ``generate`` and prints throughput and cache use.
It then runs the same batch under a fixed KV budget and prints how often
requests were compressed and how many blocks each held. (A trained reasoning
model, on which the accuracy of compression can be measured, comes later.)
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the CPU demo on a tiny random model")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--check", type=int, default=4, help="outputs to compare with transformers")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from zipage import LLM, CompressionConfig, SamplingParams
    from zipage.utils.checkpoint import make_checkpoint

    with tempfile.TemporaryDirectory() as model_dir:
        make_checkpoint(model_dir, arch="qwen3", shape="tiny", initializer_range=0.05)
        print(f"tiny random Qwen3 checkpoint written by transformers to {model_dir}")
        llm = LLM(model_dir, device=args.device, block_size=16, max_num_seqs=64)
        rng = random.Random(0)
        system = "Please reason step by step, and check every result once more. "
        prompts = [system + f"Question {i}: what is {rng.randrange(100)} + {rng.randrange(100)}?"
                   for i in range(args.num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        ttft = sorted(o.metrics.time_to_first_token for o in outputs)
        bm = llm.engine.block_manager
        print(f"\n{len(prompts)} requests, {generated} tokens in {elapsed:.2f} s: "
              f"{generated / elapsed:.0f} output tokens/s on {llm.config.device}")
        print(f"median time to first token {1000 * ttft[len(ttft) // 2]:.1f} ms; prefix cache served "
              f"{bm.prefix_hit_tokens} of {bm.prefix_query_tokens} prompt tokens")
        print(f"blocks free after the run: {bm.num_free_blocks}/{bm.num_blocks}")
        print(f"sample output: {outputs[0].outputs[0].text[:80]!r}")

        # The same batch under a fixed KV budget: 32 tokens per layer and KV head.
        compressed_llm = LLM(model_dir, device=args.device, block_size=16, max_num_seqs=64,
                             compression=CompressionConfig(kv_budget_tokens=32))
        start = time.perf_counter()
        compressed = compressed_llm.generate(prompts, params)
        elapsed_c = time.perf_counter() - start
        full_peak = max(-(-(len(o.prompt_token_ids) + args.max_tokens - 1) // 16) for o in outputs)
        print(f"\nwith compression (budget 32 tokens, block 16): {generated / elapsed_c:.0f} output tokens/s, "
              f"{sum(o.metrics.num_compressions for o in compressed)} compressions, at most "
              f"{max(o.metrics.peak_blocks for o in compressed)} blocks per request while decoding "
              f"(full KV: {full_peak})")

        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        same = 0
        for out in outputs[:args.check]:
            ids = torch.tensor([out.prompt_token_ids])
            ref = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                     eos_token_id=None, pad_token_id=0)
            same += ref[0, ids.shape[1]:].tolist() == out.outputs[0].token_ids
        print(f"greedy tokens equal to transformers' generate: {same}/{min(args.check, len(outputs))}")
        return 0 if same == min(args.check, len(outputs)) else 1
