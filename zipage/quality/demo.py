"""The quality half of the demo: the trained model solves held-out problems with the
full KV cache and under a fixed budget, and the two are compared.

``compare(model_dir)`` prints accuracy, peak KV memory per request and output
tokens per second for both and returns them; ``transformers_check`` compares a few
greedy outputs with ``transformers``. ``zipage demo`` calls both. Problems are the
shorter end of the trained range (36-50 steps, about 1,000-1,300 tokens) so that a
CPU finishes in about a minute and a half.
"""

from __future__ import annotations

from zipage.quality import eval as qeval
from zipage.quality import tasks

DEMO_TASK = tasks.TaskSpec(min_steps=36, max_steps=50)


def compare(model_dir: str, num_problems: int = 24, budget_tokens: int = 512, block_size: int = 32,
            device: str = "cpu", policy: str = "zipage", keep_prompt: bool = True, window: int = 32,
            log=print) -> dict:
    """Full KV against compression at ``budget_tokens`` (the problem statement kept with
    ``keep_prompt``; an observation window of one whole block, which the synthetic
    evaluation found better than 16 at blocks of 32); returns both runs' metrics."""
    from zipage import CompressionConfig
    from zipage.utils.loader import load_tokenizer

    encoded = qeval.encode(load_tokenizer(model_dir), tasks.held_out_problems(num_problems, DEMO_TASK))
    mean_length = sum(e.length for e in encoded) / len(encoded)
    log(f"{num_problems} held-out problems, {mean_length:.0f} tokens on average (prompt and solution)")
    runs = {"full KV": qeval.run_engine(model_dir, encoded, device=device, block_size=block_size)}
    config = CompressionConfig(kv_budget_tokens=budget_tokens, policy=policy, keep_prompt=keep_prompt,
                               window=window)
    runs[f"{policy}, budget {budget_tokens}"] = qeval.run_engine(model_dir, encoded, compression=config,
                                                                  device=device, block_size=block_size)
    log("\n| mode | accuracy | correct prefix | peak KV per request | output tokens/s |")
    log("| --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        log(f"| {name} | {r['accuracy']:.3f} | {r['prefix_fraction']:.3f} | "
            f"{r['peak_kv_bytes_mean'] / 2 ** 20:.1f} MiB | {r['tokens_per_second']:.0f} |")
    return runs


def transformers_check(model_dir: str, num_problems: int, max_tokens: int, device: str = "cpu") -> tuple[int, int]:
    """(equal, compared): the engine's greedy tokens against ``transformers``' ``generate``
    on the first ``num_problems`` demo problems, ``max_tokens`` each, full KV, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from zipage import LLM, SamplingParams
    from zipage.utils.loader import load_tokenizer

    encoded = qeval.encode(load_tokenizer(model_dir), tasks.held_out_problems(num_problems, DEMO_TASK))
    prompts = [e.prompt_ids for e in encoded]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model_dir, device=device, dtype="float32", block_size=32) as llm:
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    same = 0
    for ids, tokens in zip(prompts, ours):
        x = torch.tensor([ids], device=device)
        out = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
        same += out[0, len(ids):].tolist() == tokens
    return same, len(prompts)
