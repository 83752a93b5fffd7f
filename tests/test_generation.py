"""Greedy tokens equal transformers' generate, token for token, in float32."""

from __future__ import annotations

import random

import pytest

from zipage import SamplingParams
from tests.conftest import assert_pool_full, make_llm

NEW_TOKENS = 64


def _prompts(seed: int, vocab: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _check_against_hf(llm, model_dir, prompts, hf_greedy, max_tokens=NEW_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, max_tokens), f"prompt of {len(prompt)}"
    assert_pool_full(llm)
    return outputs


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_greedy_matches_transformers(arch, checkpoint_dir, hf_greedy):
    model_dir = checkpoint_dir(arch)
    llm = make_llm(model_dir, block_size=16, max_num_seqs=8)
    vocab = llm.engine.vocab_size
    # lengths straddle block boundaries; 100 + 64 tokens spans 11 blocks
    prompts = _prompts(1, vocab, [1, 5, 16, 17, 40, 100])
    _check_against_hf(llm, model_dir, prompts, hf_greedy)


def test_text_prompts_and_multi_shard_tied_checkpoint(checkpoint_dir, hf_greedy):
    model_dir = checkpoint_dir("qwen3", tie_word_embeddings=True, max_shard_size="40KB")
    llm = make_llm(model_dir, block_size=16)
    text = ["Let x = 12 and y = 30.", "Please reason step by step."]
    ids = [llm.tokenizer.encode(t) for t in text]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(text, params, use_tqdm=False)
    for prompt, out in zip(ids, outputs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, NEW_TOKENS)
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert_pool_full(llm)


def test_prefix_cache_hits_keep_outputs(checkpoint_dir, hf_greedy):
    model_dir = checkpoint_dir("qwen3")
    llm = make_llm(model_dir, block_size=16, max_num_seqs=8)
    vocab = llm.engine.vocab_size
    shared = _prompts(2, vocab, [48])[0]  # three full blocks
    prompts = [shared + tail for tail in _prompts(3, vocab, [1, 7, 16, 30])] + [shared[:32]]
    bm = llm.engine.block_manager
    # Cold cache: requests admitted in one step share the blocks the first one computes.
    _check_against_hf(llm, model_dir, prompts[:3], hf_greedy)
    assert bm.prefix_hit_tokens == 2 * 48
    hits_before = bm.prefix_hit_tokens
    outputs = _check_against_hf(llm, model_dir, prompts, hf_greedy)
    assert bm.prefix_hit_tokens - hits_before >= 4 * 48 + 16  # every shared full block was a hit
    assert [o.metrics.num_cached_prompt_tokens for o in outputs] == [48, 48, 48, 48, 16]


def test_preemption_under_a_tiny_cache(checkpoint_dir, hf_greedy):
    model_dir = checkpoint_dir("llama")
    # 12 blocks of 16 tokens: 6 requests growing to 73-104 tokens cannot all fit
    import torch
    from zipage.models.registry import spec_from_config
    from zipage.runner.kv_cache import bytes_per_block
    from zipage.utils.loader import load_config
    per_block = bytes_per_block(spec_from_config(load_config(model_dir)), 16, torch.float32)
    llm = make_llm(model_dir, block_size=16, max_model_len=192, kv_cache_memory_bytes=12 * per_block)
    assert llm.engine.block_manager.num_blocks == 12
    prompts = _prompts(4, llm.engine.vocab_size, [20, 33, 9, 40, 25, 12])
    _check_against_hf(llm, model_dir, prompts, hf_greedy)
    assert llm.engine.scheduler.num_preemptions > 0
