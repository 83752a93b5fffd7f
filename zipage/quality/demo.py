"""The quality half of the demo: the trained model solves held-out problems with the
full KV cache and under a fixed budget, and the two are compared.

``compare(model_dir)`` prints accuracy, peak KV memory per request and output
tokens per second for both and returns them; ``zipage demo`` calls it once a
trained checkpoint is in the repository. Problems are the shorter end of the
trained range (36-50 steps, about 1,000-1,300 tokens) so that a CPU finishes in
about a minute.
"""

from __future__ import annotations

from zipage.quality import eval as qeval
from zipage.quality import tasks

DEMO_TASK = tasks.TaskSpec(min_steps=36, max_steps=50)


def compare(model_dir: str, num_problems: int = 24, budget_tokens: int = 512, block_size: int = 32,
            device: str = "cpu", policy: str = "zipage", log=print) -> dict:
    """Full KV against compression at ``budget_tokens``; returns both runs' metrics."""
    from zipage import CompressionConfig
    from zipage.utils.loader import load_tokenizer

    encoded = qeval.encode(load_tokenizer(model_dir), tasks.held_out_problems(num_problems, DEMO_TASK))
    mean_length = sum(e.length for e in encoded) / len(encoded)
    log(f"{num_problems} held-out problems, {mean_length:.0f} tokens on average (prompt and solution)")
    runs = {"full KV": qeval.run_engine(model_dir, encoded, device=device, block_size=block_size)}
    config = CompressionConfig(kv_budget_tokens=budget_tokens, policy=policy)
    runs[f"{policy}, budget {budget_tokens}"] = qeval.run_engine(model_dir, encoded, compression=config,
                                                                  device=device, block_size=block_size)
    log("\n| mode | accuracy | correct prefix | peak KV per request | output tokens/s |")
    log("| --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        log(f"| {name} | {r['accuracy']:.3f} | {r['prefix_fraction']:.3f} | "
            f"{r['peak_kv_bytes_mean'] / 2 ** 20:.1f} MiB | {r['tokens_per_second']:.0f} |")
    return runs
