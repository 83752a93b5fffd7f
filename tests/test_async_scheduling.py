"""Asynchronous scheduling: each step is scheduled and launched before the previous
step's tokens are read, and must give exactly what an engine that waits for every
step's tokens gives.

Every other engine test runs with it too (it is the default); these compare the two
engines on what the lookahead changes: requests that a stop token or string ends
(found one step late, the extra token dropped), length limits, penalties (which need
every token: the engine waits), seeded sampling, aborts and streaming while a step is
in flight, and compression with preemption under a tiny cache.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zipage import CompressionConfig, SamplingParams
from tests.conftest import assert_pool_full, make_llm

BLOCK = 16


def _prompt(seed: int, n: int, vocab: int = 384) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _summary(outputs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outputs]


def _record_launches(llm) -> list[str]:
    """Log the runner's launches (with or without a step in flight) and collections."""
    runner, events = llm.engine.runner, []
    launch, collect = runner.launch, runner.collect

    def logged_launch(*args, previous=None, **kwargs):
        events.append("launch ahead" if previous is not None else "launch")
        return launch(*args, previous=previous, **kwargs)

    def logged_collect(step):
        events.append("collect")
        return collect(step)

    runner.launch, runner.collect = logged_launch, logged_collect
    return events


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("qwen3")


def test_stops_lengths_penalties_and_sampling_match_the_waiting_engine(model_dir):
    prompts = [_prompt(i, n) for i, n in enumerate([5, 30, 17, 44, 9, 23, 12])]
    reference = make_llm(model_dir, block_size=BLOCK, max_model_len=256, async_scheduling=False)
    greedy = [o.outputs[0] for o in reference.generate(
        prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)]
    params = [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[greedy[0].token_ids[6]]),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[greedy[1].token_ids[0]]),  # the first token
        SamplingParams(temperature=0, max_tokens=40, stop=[greedy[2].text[10:14]]),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=12, stop_token_ids=[greedy[4].token_ids[3]]),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, repetition_penalty=1.5, ignore_eos=True),
    ]
    runs = {}
    for asynchronous in (False, True):
        llm = make_llm(model_dir, block_size=BLOCK, max_model_len=256, max_num_seqs=4,
                       async_scheduling=asynchronous)
        assert llm.engine.async_scheduling is asynchronous
        runs[asynchronous] = _summary(llm.generate(prompts, params, use_tqdm=False))
        assert_pool_full(llm)
    assert runs[True] == runs[False]
    reasons = [r[2] for r in runs[True]]
    assert reasons[:3] == ["stop"] * 3 and reasons[3] == reasons[5] == reasons[6] == "length"
    assert len(runs[True][4][0]) >= 12
    assert len(runs[True][1][0]) == 1  # stopped by its first token, found after the next step launched


def test_steps_are_launched_before_the_previous_tokens_are_read(model_dir):
    llm = make_llm(model_dir, block_size=BLOCK, max_model_len=256)
    events = _record_launches(llm)
    llm.generate([_prompt(1, 9), _prompt(2, 20)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    # One prefill, then 11 decode steps each launched while the one before is in flight.
    assert events[:3] == ["launch", "launch ahead", "collect"]
    assert events.count("launch ahead") == 11 and events.count("launch") == 1
    assert events.count("collect") == 12
    assert_pool_full(llm)


def test_penalties_launch_ahead_and_match_the_waiting_engine(model_dir):
    """The runner counts sampled tokens on the device, so penalised requests launch ahead too."""
    params = SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.2, presence_penalty=0.5,
                            frequency_penalty=0.5, ignore_eos=True)
    waiting = make_llm(model_dir, block_size=BLOCK, max_model_len=256, async_scheduling=False)
    expected = waiting.generate([_prompt(3, 9)], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = make_llm(model_dir, block_size=BLOCK, max_model_len=256)
    events = _record_launches(llm)
    assert llm.generate([_prompt(3, 9)], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert events[:3] == ["launch", "launch ahead", "collect"]  # the second step before the first's tokens
    assert events.count("launch ahead") == 5


def test_abort_and_streaming_with_a_step_in_flight(model_dir):
    prompts = [_prompt(10 + i, n) for i, n in enumerate([7, 19, 31])]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = _summary(make_llm(model_dir, block_size=BLOCK, max_model_len=256, async_scheduling=False)
                        .generate(prompts, params, use_tqdm=False))
    llm = make_llm(model_dir, block_size=BLOCK, max_model_len=256)
    engine = llm.engine
    ids = [engine.add_request(p, params, stream=True) for p in prompts]
    streamed = {i: [] for i in ids}
    finish = {}
    steps = 0
    while engine.has_unfinished_requests():
        outputs, _ = engine.step()
        steps += 1
        if steps == 8:
            assert engine._launched is not None  # the abort lands while a step is in flight
            final = engine.abort_request(ids[1])
            outputs.append(final)
        for out in outputs:
            streamed[out.request_id] += out.outputs[0].token_ids
            if out.finished:
                finish[out.request_id] = out.outputs[0].finish_reason
    assert finish == {ids[0]: "length", ids[1]: "abort", ids[2]: "length"}
    assert streamed[ids[0]] == expected[0][0] and streamed[ids[2]] == expected[2][0]
    aborted = streamed[ids[1]]
    assert 0 < len(aborted) < 30 and aborted == expected[1][0][:len(aborted)]
    engine.step()  # collects the step in flight, whose requests have all finished
    assert_pool_full(llm)


@pytest.mark.parametrize("asynchronous_compression", [True, False])
def test_compression_and_preemption_under_a_tiny_cache_match(model_dir, asynchronous_compression):
    from zipage.models.registry import spec_from_config
    from zipage.runner.kv_cache import bytes_per_block
    from zipage.utils.loader import load_config

    spec = spec_from_config(load_config(model_dir))
    n_max, window = 3, 8
    per_block = bytes_per_block(spec, BLOCK, torch.float32, with_scores=True)
    per_slot = spec.num_layers * window * spec.num_heads * spec.head_dim * 4
    budget = 2 * (n_max * per_block + per_slot) + 2 * per_block  # two query slots, two blocks to spare
    lengths = [(20, 90), (9, 70), (30, 60), (5, 80), (14, 40), (3, 100)]
    prompts = [_prompt(40 + i, p) for i, (p, _) in enumerate(lengths)]
    runs, stats = {}, {}
    for asynchronous in (False, True):
        llm = make_llm(model_dir, block_size=BLOCK, max_model_len=256, kv_cache_memory_bytes=budget,
                       async_scheduling=asynchronous, compression=CompressionConfig(
                           max_blocks_per_seq=n_max, window=window, asynchronous=asynchronous_compression))
        outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=t, ignore_eos=True)
                                         for _, t in lengths], use_tqdm=False)
        runs[asynchronous] = _summary(outputs)
        stats[asynchronous] = [o.metrics.num_compressions for o in outputs]
        assert_pool_full(llm)
        assert sorted(llm.engine.scheduler.free_query_slots) == [0, 1]
    assert runs[True] == runs[False]
    assert stats[True] == stats[False] and sum(stats[True]) > 0


def test_host_time_leaves_out_the_wait_for_tokens(model_dir):
    """A step's host time counts scheduling and bookkeeping, not the wait for the device."""
    import time

    llm = make_llm(model_dir, block_size=BLOCK, max_model_len=256)
    runner = llm.engine.runner
    collect = runner.collect

    def slow_device(step):
        time.sleep(0.05)
        return collect(step)

    runner.collect = slow_device
    for i in range(2):
        llm.engine.add_request(_prompt(i, 12), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    host = []
    while llm.engine.has_unfinished_requests():
        _, stats = llm.engine.step()
        if stats is not None:
            host.append(stats.host_s)
    assert len(host) == 6 and max(host) < 0.05
    assert_pool_full(llm)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_workloads_match_the_waiting_engine(model_dir, data):
    """Random requests (lengths, stop tokens, sampling) under a small cache, with or without
    compression: both engines give the same outputs and return every block."""
    from zipage.models.registry import spec_from_config
    from zipage.runner.kv_cache import bytes_per_block
    from zipage.utils.loader import load_config

    compress = data.draw(st.booleans(), label="compress")
    num_blocks = data.draw(st.integers(9, 16), label="blocks")
    spec = spec_from_config(load_config(model_dir))
    cache_bytes = num_blocks * bytes_per_block(spec, BLOCK, torch.float32, with_scores=compress)
    requests = data.draw(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 90), st.integers(3, 383),
                                            st.booleans(), st.integers(0, 3)), min_size=2, max_size=6),
                         label="requests")
    prompts = [_prompt(100 + i, n) for i, (n, *_) in enumerate(requests)]
    params = [SamplingParams(temperature=0.9 if sampled else 0.0, seed=i, max_tokens=t,
                             stop_token_ids=[stop] if stop % 8 == 0 else [], min_tokens=min(min_tokens, t))
              for i, (_, t, stop, sampled, min_tokens) in enumerate(requests)]
    compression = CompressionConfig(max_blocks_per_seq=3, window=8) if compress else None
    runs = {}
    for asynchronous in (False, True):
        llm = make_llm(model_dir, block_size=BLOCK, max_model_len=128, kv_cache_memory_bytes=cache_bytes,
                       max_num_seqs=4, async_scheduling=asynchronous, compression=compression)
        runs[asynchronous] = _summary(llm.generate(prompts, params, use_tqdm=False))
        assert_pool_full(llm)
    assert runs[True] == runs[False]
