"""Chunked prefill: prompts computed in chunks of at most ``max_num_batched_tokens``, in steps
that also decode the running requests. Greedy tokens stay transformers' token for token."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.conftest import assert_pool_full, make_llm
from zipage import SamplingParams

NEW_TOKENS = 24


def _prompts(seed: int, vocab: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _greedy(max_tokens: int = NEW_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _run_steps(llm, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]):
    """Step the engine, adding each request at its step; return (outputs by id, step stats)."""
    engine, done, steps = llm.engine, {}, []
    step = 0
    while arrivals or engine.has_unfinished_requests():
        for request_id, prompt, params in arrivals.pop(step, []):
            engine.add_request(prompt, params, request_id=request_id)
        outputs, stats = engine.step()
        done.update((o.request_id, o) for o in outputs if o.finished)
        if stats is not None:
            steps.append(stats)
        step += 1
        assert step < 10_000
    return done, steps


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompts_in_many_chunks_match_transformers(checkpoint_dir, hf_greedy, async_scheduling):
    model_dir = checkpoint_dir("qwen3")
    llm = make_llm(model_dir, block_size=16, max_num_seqs=8, max_num_batched_tokens=7,
                   async_scheduling=async_scheduling)
    prompts = _prompts(11, llm.engine.vocab_size, [1, 7, 8, 23, 64, 101])
    # Arrivals while others decode: steps mix decodes with prompt chunks.
    arrivals = {0: [("0", prompts[0], _greedy()), ("1", prompts[4], _greedy())],
                3: [("2", prompts[5], _greedy()), ("3", prompts[1], _greedy())],
                9: [("4", prompts[2], _greedy()), ("5", prompts[3], _greedy())]}
    order = [prompts[0], prompts[4], prompts[5], prompts[1], prompts[2], prompts[3]]
    done, steps = _run_steps(llm, arrivals)
    for i, prompt in enumerate(order):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(model_dir, prompt, NEW_TOKENS), f"prompt of {len(prompt)}"
    assert all(s.num_tokens <= max(7, s.num_decodes) for s in steps), "a step beyond the token budget"
    assert any(s.is_prefill and s.num_decodes for s in steps), "no step mixed decodes with a prompt chunk"
    assert sum(s.num_tokens - s.num_decodes for s in steps) == sum(map(len, prompts))  # each prompt token once
    assert_pool_full(llm)


def test_chunked_prefix_cache_and_preemption_match_transformers(checkpoint_dir, hf_greedy):
    """Shared prefixes served from blocks earlier chunks computed, under a cache small enough to preempt."""
    import torch

    from zipage.models.registry import spec_from_config
    from zipage.runner.kv_cache import bytes_per_block
    from zipage.utils.loader import load_config

    model_dir = checkpoint_dir("llama")
    per_block = bytes_per_block(spec_from_config(load_config(model_dir)), 16, torch.float32)
    llm = make_llm(model_dir, block_size=16, max_model_len=192, kv_cache_memory_bytes=12 * per_block,
                   max_num_batched_tokens=10)
    vocab = llm.engine.vocab_size
    shared = _prompts(12, vocab, [48])[0]
    prompts = [shared + tail for tail in _prompts(13, vocab, [3, 20, 35])] + _prompts(14, vocab, [40, 9, 25])
    params = _greedy(max_tokens=48)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 48), f"prompt of {len(prompt)}"
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_hit_tokens > 0
    assert_pool_full(llm)


def test_chunking_off_prefills_whole_prompts_in_steps_of_their_own(checkpoint_dir, hf_greedy):
    model_dir = checkpoint_dir("qwen3")
    llm = make_llm(model_dir, block_size=16, max_num_seqs=8, enable_chunked_prefill=False)
    prompts = _prompts(15, llm.engine.vocab_size, [30, 70])
    done, steps = _run_steps(llm, {0: [("0", prompts[0], _greedy())], 2: [("1", prompts[1], _greedy())]})
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(model_dir, prompt, NEW_TOKENS)
    prefills = [s for s in steps if s.is_prefill]
    assert [s.num_tokens for s in prefills] == [30, 70] and all(s.num_decodes == 0 for s in prefills)
    assert_pool_full(llm)


def test_per_request_state_is_built_at_the_last_chunk(checkpoint_dir):
    """Prompt log probabilities gathered over chunks, penalties counted from the whole prompt,
    seeded sampling: all as with whole prompts."""
    model_dir = checkpoint_dir("qwen3")
    vocab = None
    results = []
    for chunked in (False, True):
        llm = make_llm(model_dir, block_size=16, max_num_seqs=8, enable_chunked_prefill=chunked,
                       **({"max_num_batched_tokens": 6} if chunked else {}))
        vocab = vocab or llm.engine.vocab_size
        prompts = _prompts(16, vocab, [2, 13, 40])
        params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=3),
                  SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5,
                                 presence_penalty=0.5),
                  SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=5, ignore_eos=True)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.prompt_logprobs) for o in outputs])
        assert_pool_full(llm)
    whole, chunked = results
    for (tokens_w, plp_w), (tokens_c, plp_c) in zip(whole, chunked):
        assert tokens_c == tokens_w
        assert (plp_w is None) == (plp_c is None)
        if plp_w is not None:
            assert len(plp_c) == len(plp_w) == 2 and plp_c[0] is None
            for pos_w, pos_c in zip(plp_w[1:], plp_c[1:]):
                assert pos_w.keys() == pos_c.keys()
                for token in pos_w:
                    assert pos_c[token].logprob == pytest.approx(pos_w[token].logprob, abs=1e-4)
                    assert pos_c[token].rank == pos_w[token].rank


def test_long_prompt_with_prompt_logprobs_over_chunks(checkpoint_dir):
    model_dir = checkpoint_dir("qwen3")
    logprobs = []
    for budget in (None, 5):
        llm = make_llm(model_dir, block_size=16, enable_chunked_prefill=budget is not None,
                       **({"max_num_batched_tokens": budget} if budget else {}))
        prompt = _prompts(17, llm.engine.vocab_size, [37])[0]
        (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1),
                              use_tqdm=False)
        assert len(out.prompt_logprobs) == 37 and out.prompt_logprobs[0] is None
        logprobs.append([p[t].logprob for p, t in zip(out.prompt_logprobs[1:], prompt[1:])])
    assert logprobs[1] == pytest.approx(logprobs[0], abs=1e-4)


def test_token_budget_below_the_context_needs_chunking():
    from zipage.config import SchedulerConfig

    config = SchedulerConfig(max_num_batched_tokens=512, max_model_len=4096)
    config.resolve(8192)  # chunked by default: any budget
    assert config.max_num_batched_tokens == 512
    default = SchedulerConfig(max_model_len=32768)
    default.resolve(32768)
    assert default.max_num_batched_tokens == 8192
    whole = SchedulerConfig(max_num_batched_tokens=512, max_model_len=4096, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens=512 must be >= max_model_len=4096 without "
                                         "chunked prefill"):
        whole.resolve(8192)
    with pytest.raises(ValueError, match="enable_chunked_prefill must be True or False, got 'yes'"):
        SchedulerConfig(enable_chunked_prefill="yes")


def test_prompt_longer_than_the_cache_is_compressed_between_chunks(checkpoint_dir):
    """With compression, a prompt the cache cannot hold whole is compressed between its chunks
    ("long", the default); with prefill compression off it is refused with the limit named."""
    import torch

    from zipage import CompressionConfig
    from zipage.models.registry import spec_from_config
    from zipage.runner.kv_cache import bytes_per_block
    from zipage.utils.loader import load_config

    model_dir = checkpoint_dir("qwen3")
    per_block = bytes_per_block(spec_from_config(load_config(model_dir)), 16, torch.float32)
    results = {}
    for mode in ("long", "off"):
        llm = make_llm(model_dir, block_size=16, max_model_len=512, kv_cache_memory_bytes=12 * per_block,
                       max_num_batched_tokens=40, compression=CompressionConfig(kv_budget_tokens=32, window=8,
                                                                                prefill_compression=mode))
        num_blocks = llm.engine.block_manager.num_blocks  # what the query and score caches leave
        assert 6 <= num_blocks <= 12 and num_blocks * 16 < 400
        vocab = llm.engine.vocab_size
        long_prompt, short_prompt = _prompts(18, vocab, [400, 30])
        if mode == "off":
            with pytest.raises(ValueError, match=f"prompt has 400 tokens; the KV cache holds prompts of at most "
                                                 f"{num_blocks * 16 - 16} tokens"):
                llm.generate([long_prompt], _greedy(), use_tqdm=False)
            continue
        engine = llm.engine
        engine.add_request(long_prompt, _greedy(max_tokens=30), request_id="long")
        engine.add_request(short_prompt, _greedy(max_tokens=30), request_id="short")
        seq = engine._requests["long"]
        assert seq.compress_prefill and not engine._requests["short"].compress_prefill
        most = 0
        done = {}
        while engine.has_unfinished_requests():
            outputs, _ = engine.step()
            done.update((o.request_id, o) for o in outputs if o.finished)
            most = max(most, len(seq.block_table))
        # N = 3 blocks plus one chunk of 40 tokens (3 blocks): never the 25 blocks of the whole prompt.
        assert most <= 3 + 3
        assert seq.metrics.num_compressions >= 10
        results = done
        assert [len(done[r].outputs[0].token_ids) for r in ("long", "short")] == [30, 30]
        assert_pool_full(llm)
    assert results


def test_a_step_compacting_a_prompt_carries_no_prompt_chunk(checkpoint_dir):
    """With asynchronous compression, two prompts compressed between their chunks take turns: a
    step either compacts prompts or computes prompt chunks (beside the decodes), never both, and
    both prompts still complete with every block back."""
    from zipage import CompressionConfig

    model_dir = checkpoint_dir("qwen3")
    llm = make_llm(model_dir, block_size=16, max_model_len=512, max_num_batched_tokens=40,
                   compression=CompressionConfig(kv_budget_tokens=32, window=8, prefill_compression="always"))
    scheduler = llm.engine.scheduler
    assert scheduler.asynchronous
    steps, schedule = [], scheduler.schedule

    def recorded():
        batch = schedule()
        if batch is not None:
            steps.append((any(task.seq.prefilling for task in batch.compressions),
                          any(seq.prefilling for seq in batch.seqs)))
        return batch

    scheduler.schedule = recorded
    prompts = _prompts(23, llm.engine.vocab_size, [200, 160, 20])
    done, _ = _run_steps(llm, {0: [("a", prompts[0], _greedy(max_tokens=8)), ("b", prompts[1], _greedy(max_tokens=8))],
                               1: [("c", prompts[2], _greedy(max_tokens=40))]})
    assert sorted(done) == ["a", "b", "c"] and all(len(o.outputs[0].token_ids) in (8, 40) for o in done.values())
    compacting = [chunk for compacts, chunk in steps if compacts]
    assert len(compacting) >= 4 and not any(compacting)
    assert sum(chunk for _, chunk in steps) >= 6
    assert_pool_full(llm)


def test_decodes_beside_chunks_take_the_decode_path(checkpoint_dir, hf_greedy):
    """In a step mixing decodes with a prompt chunk, the decodes attend through the backend's
    decode kernel (which reads each KV head once for its group of query heads) and the chunk
    through its prefill path; the tokens stay transformers'."""
    from zipage.attention.metadata import get_attention_metadata

    model_dir = checkpoint_dir("qwen3")
    # Chunks cost their tokens only (prefill_attention_span=0), so that their sizes are known.
    llm = make_llm(model_dir, block_size=16, max_num_seqs=4, max_num_batched_tokens=8, prefill_attention_span=0)
    backend = llm.engine.runner.backend
    calls = []
    decode, prefill = backend.decode, backend.prefill

    def record(kind, fn):
        def wrapped(q, *args, **kwargs):
            calls.append((kind, get_attention_metadata().is_prefill, q.shape[0]))
            return fn(q, *args, **kwargs)
        return wrapped

    backend.decode, backend.prefill = record("decode", decode), record("prefill", prefill)
    prompts = _prompts(19, llm.engine.vocab_size, [5, 40])
    done, steps = _run_steps(llm, {0: [("0", prompts[0], _greedy())], 2: [("1", prompts[1], _greedy())]})
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(model_dir, prompt, NEW_TOKENS)
    mixed = [c for c in calls if c[0] == "decode" and c[1]]  # the decode kernel inside a prefill-path step
    assert mixed and all(rows == 1 for _, _, rows in mixed)  # request 0 decodes while 1's chunks run
    chunk_rows = {rows for kind, _, rows in calls if kind == "prefill"}  # (once per layer)
    # request 0's prompt (5 tokens), then request 1's 40 in chunks of 8 - 1 decode: 7 x 5, then 5
    assert chunk_rows == {5, 7}
    assert any(s.is_prefill and s.num_decodes == 1 for s in steps)


def test_chunks_priced_by_the_models_attention_span_match_transformers(checkpoint_dir, hf_greedy):
    """prefill_attention_span=None takes the span from the model's sizes; the chunks of a long
    prompt then shrink as it advances, and the tokens stay transformers'."""
    from transformers import AutoConfig

    from zipage.engine.scheduler import model_attention_span

    model_dir = checkpoint_dir("qwen3")
    llm = make_llm(model_dir, block_size=16, max_num_seqs=4, max_num_batched_tokens=48, prefill_attention_span=None)
    span = llm.engine.config.scheduler.prefill_attention_span
    assert span == model_attention_span(AutoConfig.from_pretrained(model_dir)) > 0
    scheduler, sizes = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        batch = schedule()
        sizes.extend(s.chunk[1] for s in (batch.seqs if batch else []) if s.request_id == "long" and s.chunk)
        return batch

    scheduler.schedule = recording
    prompts = _prompts(23, llm.engine.vocab_size, [3, 2 * span])
    done, _ = _run_steps(llm, {0: [("short", prompts[0], _greedy())], 1: [("long", prompts[1], _greedy())]})
    for request_id, prompt in zip(("short", "long"), prompts):
        assert done[request_id].outputs[0].token_ids == hf_greedy(model_dir, prompt, NEW_TOKENS)
    assert sum(sizes) == 2 * span and sizes[0] > 2 * sizes[-2]
    assert_pool_full(llm)


class _Table:
    def __init__(self, blocks):
        self.blocks = np.asarray(blocks, dtype=np.int32)

    def __len__(self):
        return len(self.blocks)

    def array(self):
        return self.blocks


def test_the_numbers_of_a_mixed_step_follow_their_definitions():
    """A step's host numbers, the decoding rows written at once and the chunks one by one,
    against what each token's row must hold: its id and position, the cache slot of its cache
    index (positions may run ahead of cache indices after a compression), the keys it attends to,
    and the query-cache row of a token in its run's last window; the decoding rows as a decode
    step of the same requests writes them."""
    from types import SimpleNamespace

    from zipage.runner.inputs import InputBuilder

    bs, window, slots = 4, 3, 6
    rng = np.random.default_rng(0)

    def builder():
        return InputBuilder(torch.device("cpu"), block_size=bs, max_num_seqs=8, max_num_batched_tokens=64,
                            max_table_blocks=12, window=window, num_query_slots=slots)

    def seq(kv_len, num_tokens, chunk=None, query_slot=None, samples=True):
        blocks = rng.permutation(100)[:-(-(kv_len + (chunk[1] if chunk else 1)) // bs)]
        return SimpleNamespace(block_table=_Table(blocks), token_ids=rng.integers(0, 500, num_tokens), chunk=chunk,
                               num_tokens=num_tokens, kv_len=kv_len, query_slot=query_slot, samples=samples,
                               num_pending=0)

    decoding = [seq(9, 30, query_slot=2), seq(0, 1), seq(15, 15, query_slot=5), seq(4, 7)]
    chunks = [seq(8, 40, chunk=(20, 7), query_slot=1, samples=False), seq(0, 5, chunk=(0, 5), query_slot=None)]
    mixed = builder()
    shape = mixed.fill_prefill(decoding + chunks)
    d, n = len(decoding), len(decoding) + 7 + 5
    assert (shape.num_seqs, shape.num_tokens, shape.num_decodes, shape.num_sampled) == (6, n, d, 5)
    assert (shape.max_seqlen_q, shape.max_seqlen_k, shape.has_cached_prefix, shape.chunk_keys) == (7, 16, True, 20)
    assert mixed.cu_seqlens.np[:7].tolist() == [0, 1, 2, 3, 4, 11, 16]
    assert mixed.logits_rows.np[:5].tolist() == [0, 1, 2, 3, 15]  # the first chunk's prompt goes on: no sample
    row = 0
    for i, s in enumerate(decoding + chunks):
        start, q_len = s.chunk or (s.num_tokens - 1, 1)
        assert mixed.context_lens.np[i] == s.kv_len + q_len
        for j in range(q_len):
            position, index = start + j, s.kv_len + j
            assert mixed.input_ids.np[row] == s.token_ids[position] and mixed.positions.np[row] == position
            assert mixed.slot_mapping.np[row] == s.block_table.blocks[index // bs] * bs + index % bs
            in_window = s.query_slot is not None and position >= start + q_len - window
            expected = s.query_slot * window + position % window if in_window else slots * window
            assert mixed.query_slots.np[row] == expected
            row += 1
    alone = builder()
    alone.fill_decode(decoding)
    for name in ("input_ids", "positions", "slot_mapping", "context_lens", "query_slots"):
        assert np.array_equal(getattr(alone, name).np[:d], getattr(mixed, name).np[:d]), name
    with pytest.raises(AssertionError, match="decoding rows come before prompt chunks"):
        builder().fill_prefill(chunks[:1] + decoding)
