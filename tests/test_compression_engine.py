"""The compressed engine end to end on tiny models: budget, trigger, prefix sharing, stats."""

from __future__ import annotations

import random

import pytest
import torch

from zipage import CompressionConfig, SamplingParams
from tests.conftest import assert_pool_full, make_llm

BLOCK = 16


def _prompt(seed: int, n: int, vocab: int = 384) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def expected_compressions(prompt_len: int, max_tokens: int, max_blocks: int, block: int = BLOCK):
    """(compressions, evicted tokens) from walking the cache length as the engine fills it."""
    kept = (max_blocks - 1) * block
    kv, count, evicted = prompt_len, 0, 0
    if -(-kv // block) > max_blocks:  # a long prompt is brought under the budget at once
        kv, count, evicted = kept, 1, kv - kept
    for _ in range(max_tokens - 1):  # the last sampled token is never cached
        if kv == max_blocks * block:
            kv, count, evicted = kept, count + 1, evicted + block
        kv += 1
    return count, evicted


def test_large_budget_never_compresses_and_matches_full_kv(checkpoint_dir):
    model_dir = checkpoint_dir("qwen3")
    prompts = [_prompt(i, n) for i, n in enumerate([5, 17, 40, 63])]
    full = make_llm(model_dir, block_size=BLOCK).generate(prompts, _greedy(60), use_tqdm=False)
    llm = make_llm(model_dir, block_size=BLOCK, compression=CompressionConfig(kv_budget_tokens=8 * BLOCK))
    outputs = llm.generate(prompts, _greedy(60), use_tqdm=False)
    for a, b in zip(full, outputs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.metrics.num_compressions == 0
    assert llm.engine.stats.num_compressions == 0
    assert_pool_full(llm)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("redundancy", ["lightning", "raw", "off"])
def test_small_budget_bounds_blocks_and_counts_compressions(checkpoint_dir, arch, redundancy):
    n_max = 3
    llm = make_llm(checkpoint_dir(arch), block_size=BLOCK, max_model_len=512,
                   compression=CompressionConfig(max_blocks_per_seq=n_max, redundancy=redundancy))
    lengths = [(5, 150), (33, 120), (48, 100), (70, 90), (16, 1)]
    prompts = [_prompt(10 + i, p) for i, (p, _) in enumerate(lengths)]
    params = [_greedy(t) for _, t in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for (p, t), out in zip(lengths, outputs):
        assert len(out.outputs[0].token_ids) == t
        m = out.metrics
        assert (m.num_compressions, m.evicted_tokens) == expected_compressions(p, t, n_max), (p, t)
        assert m.peak_blocks <= n_max, (p, t, m.peak_blocks)
    stats = llm.stats
    assert stats.num_compressions == sum(o.metrics.num_compressions for o in outputs) > 0
    assert stats.peak_running == len(prompts)
    assert len(stats.occupancy) == stats.num_steps
    assert_pool_full(llm)


def test_compressing_a_request_leaves_shared_prefix_blocks_untouched(checkpoint_dir):
    model_dir = checkpoint_dir("qwen3")
    config = CompressionConfig(max_blocks_per_seq=6)  # 80 kept tokens; compresses at 96
    prefix = _prompt(3, 3 * BLOCK)  # the window (16) is always recomputed: two blocks are shared
    long_prompt, short_prompt = prefix + _prompt(4, 10), prefix + _prompt(5, 5)
    alone = make_llm(model_dir, block_size=BLOCK, compression=config).generate(
        [short_prompt], _greedy(40), use_tqdm=False)[0].outputs[0].token_ids

    llm = make_llm(model_dir, block_size=BLOCK, compression=config)
    engine = llm.engine
    engine.add_request(long_prompt, _greedy(120), request_id="long")
    engine.add_request(short_prompt, _greedy(40), request_id="short")
    engine.step()  # one prefill: "short" reads the two prefix blocks "long" computes
    long_seq, short_seq = engine._requests["long"], engine._requests["short"]
    shared = short_seq.block_table.array()[:2].tolist()
    assert long_seq.block_table.array()[:2].tolist() == shared
    kv = engine.runner.kv_cache
    before = [plane[:, shared].clone() for plane in kv]
    outputs = {}
    while engine.has_unfinished_requests():
        finished, _ = engine.step()
        outputs.update({o.request_id: o for o in finished})
        if long_seq.metrics.num_compressions and "short" not in outputs:
            assert shared[0] not in long_seq.block_table.array().tolist()  # fresh targets instead
            assert all(torch.equal(plane[:, shared], b) for plane, b in zip(kv, before)), "a shared block was written"
    assert long_seq.metrics.num_compressions >= 1
    assert outputs["short"].metrics.num_compressions == 0
    assert outputs["short"].outputs[0].token_ids == alone
    assert_pool_full(llm)


def test_compressed_blocks_are_never_served_from_the_prefix_cache(checkpoint_dir):
    """A request that repeats a compressed request's prompt and output reads only true prefix KV:
    its tokens equal those of an engine without a prefix cache. (Compaction rewrote the prompt's
    blocks in place, so nothing here may be served; registering a compacted block would serve it.)"""
    model_dir = checkpoint_dir("qwen3")
    config = CompressionConfig(max_blocks_per_seq=3)
    llm = make_llm(model_dir, block_size=BLOCK, compression=config)
    prompt = _prompt(7, 40)
    first = llm.generate([prompt], _greedy(90), use_tqdm=False)[0]
    assert first.metrics.num_compressions > 1
    # The repeat covers tokens the first request decoded after its compressions, in its compacted blocks.
    again_prompt = prompt + first.outputs[0].token_ids[:80]
    again = llm.generate([again_prompt], _greedy(20), use_tqdm=False)[0]
    uncached = make_llm(model_dir, block_size=BLOCK, compression=config, enable_prefix_caching=False)
    reference = uncached.generate([again_prompt], _greedy(20), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == reference.outputs[0].token_ids
    assert_pool_full(llm)


def test_bad_compression_settings_name_the_field(checkpoint_dir):
    model_dir = checkpoint_dir("qwen3")
    with pytest.raises(ValueError, match="window=32 must be <= block_size=16"):
        make_llm(model_dir, block_size=16, compression=CompressionConfig(window=32))
    with pytest.raises(ValueError, match="kv_budget_tokens=100 must be a multiple of block_size=16"):
        make_llm(model_dir, block_size=16, compression=CompressionConfig(kv_budget_tokens=100))
    with pytest.raises(ValueError, match="pooling_width"):
        CompressionConfig(pooling_width=4)
    with pytest.raises(ValueError, match="redundancy"):
        CompressionConfig(redundancy="fast")
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        CompressionConfig(max_blocks_per_seq=1)
    with pytest.raises(ValueError, match="must fit the budget"):
        make_llm(model_dir, block_size=16, compression=CompressionConfig(max_blocks_per_seq=2, attention_sink=4))


@pytest.mark.parametrize("hybrid", [True, False])
def test_asynchronous_and_synchronous_compression_give_the_same_tokens(checkpoint_dir, hybrid):
    model_dir = checkpoint_dir("qwen3")
    prompts = [_prompt(20 + i, n) for i, n in enumerate([5, 30, 50, 12])]
    params = [_greedy(t) for t in (120, 90, 60, 100)]
    runs = {}
    for asynchronous in (False, True):
        llm = make_llm(model_dir, block_size=BLOCK, max_model_len=512, compression=CompressionConfig(
            max_blocks_per_seq=3, asynchronous=asynchronous, hybrid=hybrid))
        runs[asynchronous] = llm.generate(prompts, params, use_tqdm=False)
        assert_pool_full(llm)
    for sync, overlapped in zip(runs[False], runs[True]):
        assert sync.outputs[0].token_ids == overlapped.outputs[0].token_ids
        assert sync.metrics.num_compressions == overlapped.metrics.num_compressions > 0


def test_hybrid_scheduling_under_memory_pressure(checkpoint_dir):
    """Fewer query slots than requests: the others decode without one, wait, get one, finish."""
    from zipage.models.registry import spec_from_config
    from zipage.runner.kv_cache import bytes_per_block
    from zipage.utils.loader import load_config

    model_dir = checkpoint_dir("qwen3")
    spec = spec_from_config(load_config(model_dir))
    n_max, window = 3, 8
    per_block = bytes_per_block(spec, BLOCK, torch.float32, with_scores=True)
    per_slot = spec.num_layers * window * spec.num_heads * spec.head_dim * 4
    budget = 2 * (n_max * per_block + per_slot) + 2 * per_block  # two slots, two blocks to spare
    llm = make_llm(model_dir, block_size=BLOCK, max_model_len=256, kv_cache_memory_bytes=budget,
                   compression=CompressionConfig(max_blocks_per_seq=n_max, window=window))
    assert llm.engine.runner.num_query_slots == 2
    lengths = [(20, 90), (9, 70), (30, 60), (5, 80), (14, 40), (3, 100)]
    outputs = llm.generate([_prompt(40 + i, p) for i, (p, _) in enumerate(lengths)],
                           [_greedy(t) for _, t in lengths], use_tqdm=False)
    for (p, t), out in zip(lengths, outputs):
        assert len(out.outputs[0].token_ids) == t
        assert out.metrics.peak_blocks <= n_max
    assert llm.stats.peak_running > 2  # more requests ran than there are slots
    assert sum(o.metrics.num_compressions for o in outputs) > 0
    assert_pool_full(llm)
    assert sorted(llm.engine.scheduler.free_query_slots) == [0, 1]
