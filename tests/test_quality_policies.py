"""Baseline eviction policies (CompressionConfig.policy): the scorers, their float64
reference, and the engine end to end (against the reference simulation where the
policy is deterministic)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from zipage import CompressionConfig, SamplingParams
from zipage.compression import policy
from zipage.compression import reference as ref
from tests.conftest import assert_pool_full, make_llm
from tests.test_compression_policy import CASES, TALL, _assert_same_selection, _case
from tests.test_compression_reference import BLOCK, ReferenceCompressedDecoder


def _resolved(**options) -> CompressionConfig:
    config = CompressionConfig(**options)
    config.resolve(options.pop("block_size", 16) if "block_size" in options else 16)
    return config


# ---------------------------------------------------------------- configuration


def test_unknown_policy_names_the_field():
    with pytest.raises(ValueError, match="policy must be one of"):
        CompressionConfig(policy="snapkv")


def test_baselines_switch_off_what_they_do_not_use():
    zipage = _resolved(kv_budget_tokens=32)
    assert (zipage.redundancy, zipage.global_score_decay, zipage.pooling_width) == ("lightning", 0.8, 5)
    attention = _resolved(kv_budget_tokens=32, policy="attention")
    assert attention.redundancy == "off" and attention.global_score_decay is None
    assert attention.pooling_width == 5 and attention.pool_every_compression
    for name in ("recency", "random"):
        config = _resolved(kv_budget_tokens=32, policy=name, attention_sink=4)
        assert (config.redundancy, config.global_score_decay, config.pooling_width) == ("off", None, None)
        assert config.attention_sink == 4


# ---------------------------------------------------------------- scorers


def test_position_scores_keep_the_sink_and_the_newest_tokens():
    lengths = torch.tensor([10, 7])
    scores = policy.position_scores(lengths, 2, 3, 12)
    assert scores.shape == (2, 2, 3, 12) and scores.dtype == torch.float32
    assert scores[0, 1, 2].tolist() == [float(j) for j in range(10)] + [0.0, 0.0]
    assert (scores[1, :, :, 7:] == 0).all()
    torch.testing.assert_close(scores, ref.position_scores(lengths, 2, 3, 12).float())
    config = _resolved(kv_budget_tokens=16, window=2, attention_sink=2, policy="recency")
    kept = policy.choose_by_scores(scores, lengths, config, keep=5)
    assert kept[0, 0, 0].tolist() == [0, 1, 7, 8, 9]
    assert kept[1, 1, 2].tolist() == [0, 1, 4, 5, 6]


def test_random_scores_are_seeded_independent_and_padding_free():
    lengths = torch.tensor([40, 25])
    draw = lambda seed: policy.random_scores(lengths, 2, 2, 44, torch.Generator().manual_seed(seed))  # noqa: E731
    a, b, c = draw(3), draw(3), draw(4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert ((a >= 0) & (a < 1)).all()
    assert (a[0, :, :, 40:] == 0).all() and (a[1, :, :, 25:] == 0).all()
    config = _resolved(kv_budget_tokens=16, window=4, attention_sink=1, policy="random")
    kept = policy.choose_by_scores(a, lengths, config, keep=12)
    for r, n in enumerate(lengths.tolist()):
        for layer in range(2):
            for head in range(2):
                row = kept[r, layer, head].tolist()
                assert row == sorted(set(row)) and len(row) == 12 and max(row) < n
                assert {0, n - 4, n - 3, n - 2, n - 1} <= set(row)
    # token-level eviction: layers and heads keep different tokens
    assert not torch.equal(kept[0, 0, 0], kept[0, 1, 1])


@pytest.mark.parametrize("name", ["attention", "recency"])
@pytest.mark.parametrize("index", [1, 3, 5])
def test_score_tokens_matches_reference(name, index):
    case = (CASES + TALL)[index]
    queries, keys, lengths = _case(case)
    w, b = case[6], case[7]
    keep = max(w + 1, int(lengths.min()) - 2)
    config = CompressionConfig(max_blocks_per_seq=4, window=w, attention_sink=1, policy=name)
    config.resolve(b)
    R, L, H, n_max = keys.shape[:4]
    previous = torch.rand(R, L, H, n_max, generator=torch.Generator().manual_seed(index))
    num_previous = lengths // 2  # ignored: these policies keep no history
    scale = 1 / math.sqrt(keys.shape[-1])
    kept, history = policy.score_tokens(queries, keys, lengths, previous, num_previous, config, scale, keep, b,
                                        pool=False)
    want_kept, want_history, want_scores = ref.score_tokens_with_scores(queries, keys, lengths, previous,
                                                                        num_previous, config, scale, keep, b,
                                                                        pool=False)
    _assert_same_selection(kept, want_kept, want_scores, keep)
    valid = torch.arange(n_max) < lengths.view(-1, 1, 1, 1)
    torch.testing.assert_close(history.double()[valid.expand_as(history)],
                               want_history[valid.expand_as(want_history)], rtol=1e-5, atol=1e-8)
    if name == "attention":  # the same as the pipeline with history and redundancy off, pooled every time
        plain = CompressionConfig(window=w, attention_sink=1, redundancy="off", global_score_decay=None)
        again, _ = policy.score_tokens(queries, keys, lengths, None, num_previous, plain, scale, keep, b, pool=True)
        assert torch.equal(kept, again)


def test_random_policy_has_no_reference():
    config = _resolved(kv_budget_tokens=16, policy="random")
    queries, keys, lengths = _case(CASES[0])
    with pytest.raises(ValueError, match="random"):
        ref.score_tokens_with_scores(queries, keys, lengths, None, lengths * 0, config, 0.25, 4, 4, False)


# ---------------------------------------------------------------- the engine


def _prompt(seed: int, n: int, vocab: int = 384) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.mark.parametrize("name", ["attention", "recency", "random"])
def test_engine_bounds_blocks_under_every_policy(checkpoint_dir, name):
    config = CompressionConfig(max_blocks_per_seq=3, policy=name, attention_sink=4)
    llm = make_llm(checkpoint_dir("qwen3"), block_size=BLOCK, max_model_len=512, compression=config)
    prompts = [_prompt(i, n) for i, n in enumerate([5, 40, 70])]
    params = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        assert len(out.outputs[0].token_ids) == 90
        assert out.metrics.num_compressions > 0 and out.metrics.peak_blocks <= 3
    assert llm.engine.runner.compressor.score_cache is None  # no history score for baselines
    assert_pool_full(llm)
    if name == "random":  # seeded: a second engine evicts the same tokens
        again = make_llm(checkpoint_dir("qwen3"), block_size=BLOCK, max_model_len=512, compression=config)
        repeat = again.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in repeat] == [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", ["attention", "recency"])
def test_engine_matches_reference_simulation(checkpoint_dir, name):
    """The engine's logits after every compression equal those of a float64 model that
    attends to exactly the tokens the reference policy keeps."""
    model_dir = checkpoint_dir("qwen3")
    config = CompressionConfig(max_blocks_per_seq=4, window=8, attention_sink=2, policy=name,
                               asynchronous=False)  # a compressed request decodes in the same step
    # without asynchronous scheduling each step returns its own token, checked in lock step
    llm = make_llm(model_dir, block_size=BLOCK, compression=config, enforce_eager=True,
                   async_scheduling=False)
    engine = llm.engine
    model = engine.runner.model
    captured = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: captured.append(compute_logits(hidden)) or captured[-1]
    prompt = _prompt(5, 21, engine.vocab_size)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), request_id="r")
    seq = engine._requests["r"]
    decoder = ReferenceCompressedDecoder(model_dir, llm.config.compression, len(prompt))
    for position, token in enumerate(prompt[:-1]):
        decoder.step(token, position)
    tokens = list(prompt)
    while engine.has_unfinished_requests():
        expected = decoder.step(tokens[-1], len(tokens) - 1)
        engine.step()
        got = captured[-1][-1].double().cpu()
        assert seq.metrics.num_compressions == decoder.num_compressions
        assert (got - expected).abs().max().item() < 1e-4, f"logits differ at position {len(tokens) - 1}"
        tokens.append(int(got.argmax()))
    assert decoder.num_compressions >= 3
