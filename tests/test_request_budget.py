"""Per-request compression: a request's own ``kv_budget_tokens``, or full KV (``compression=False``).

Each request of a batch with mixed budgets must get exactly the tokens it gets alone on an
engine configured with its budget (greedy), and the pool must come back whole.
"""

from __future__ import annotations

import random
import time

import pytest

from zipage import CompressionConfig, SamplingParams
from tests.conftest import assert_pool_full, make_llm
from tests.test_compression_engine import expected_compressions

BLOCK = 16
BUDGET = 4 * BLOCK  # the engine's: N = 5
MAX_MODEL_LEN = 512


def _prompt(seed: int, n: int, vocab: int = 384) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _params(max_tokens: int, **budget) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **budget)


# (prompt length, max tokens, the request's budget fields, the engine budget that gives the same alone)
MIXED = [
    # these two reach their limits (80 and 48 cached tokens) at the same steps: compressed in one batch
    (40, 130, {}, BUDGET),
    (8, 120, dict(kv_budget_tokens=BUDGET // 2), BUDGET // 2),
    (25, 110, dict(compression=False), None),
    (90, 60, dict(kv_budget_tokens=BLOCK), BLOCK),  # a long prompt, compressed at once to one block
    (12, 100, dict(kv_budget_tokens=BUDGET), BUDGET),
]


def _block_bytes(model_dir: str) -> int:
    """Bytes of one block (keys, values, history scores) of the float32 test model: to size tiny caches."""
    import torch

    from zipage.models.registry import spec_from_config
    from zipage.runner.kv_cache import bytes_per_block
    from zipage.utils.loader import load_config
    return bytes_per_block(spec_from_config(load_config(model_dir)), BLOCK, torch.float32, with_scores=True)


def _engine(model_dir, budget: int | None, **options):
    compression = None
    if budget is not None:
        compression = CompressionConfig(kv_budget_tokens=budget, asynchronous=options.pop("asynchronous", True))
    else:
        options.pop("asynchronous", None)
    return make_llm(model_dir, block_size=BLOCK, max_model_len=MAX_MODEL_LEN, compression=compression, **options)


@pytest.fixture(scope="module")
def alone(checkpoint_dir):
    """Each request of ``MIXED`` run alone on an engine configured with its budget."""
    model_dir = checkpoint_dir("qwen3")
    results = []
    for i, (p, t, _, budget) in enumerate(MIXED):
        out = _engine(model_dir, budget, async_scheduling=False, asynchronous=False).generate(
            [_prompt(i, p)], [_params(t)], use_tqdm=False)[0]
        results.append(out)
    return results


@pytest.mark.parametrize("async_scheduling,asynchronous", [(False, False), (True, True), (True, False)])
def test_mixed_budgets_match_each_request_alone(checkpoint_dir, alone, async_scheduling, asynchronous):
    model_dir = checkpoint_dir("qwen3")
    llm = _engine(model_dir, BUDGET, async_scheduling=async_scheduling, asynchronous=asynchronous)
    outputs = llm.generate([_prompt(i, p) for i, (p, *_) in enumerate(MIXED)],
                           [_params(t, **fields) for _, t, fields, _ in MIXED], use_tqdm=False)
    for (p, t, fields, budget), out, ref in zip(MIXED, outputs, alone):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, f"request with {fields or 'defaults'}"
        if budget is None:
            assert out.metrics.num_compressions == 0
            assert out.metrics.peak_blocks == -(-(p + t - 1) // BLOCK)  # grew with its length
        else:
            n = budget // BLOCK + 1
            expected = expected_compressions(p, t, n, BLOCK)
            assert (out.metrics.num_compressions, out.metrics.evicted_tokens) == expected and expected[0] > 0
            assert out.metrics.peak_blocks <= n
    assert_pool_full(llm)
    assert sorted(llm.engine.scheduler.free_query_slots) == list(range(llm.engine.runner.num_query_slots))


def test_mixed_budgets_under_memory_pressure_finish_and_free_everything(checkpoint_dir):
    """Few blocks: requests of every kind are preempted and recomputed; each stays within its budget."""
    model_dir = checkpoint_dir("qwen3")
    llm = make_llm(model_dir, block_size=BLOCK, max_model_len=256, kv_cache_memory_bytes=16 * _block_bytes(model_dir),
                   compression=CompressionConfig(kv_budget_tokens=BUDGET, query_slots=2))
    kinds = [{}, dict(kv_budget_tokens=BLOCK), dict(compression=False), dict(kv_budget_tokens=2 * BLOCK)]
    lengths = [(20, 90), (9, 70), (30, 60), (5, 80), (14, 40), (3, 100), (40, 50), (7, 30)]
    outputs = llm.generate([_prompt(50 + i, p) for i, (p, _) in enumerate(lengths)],
                           [_params(t, **kinds[i % 4]) for i, (_, t) in enumerate(lengths)], use_tqdm=False)
    for i, ((p, t), out) in enumerate(zip(lengths, outputs)):
        assert len(out.outputs[0].token_ids) == t
        fields = kinds[i % 4]
        if fields.get("compression") is False:
            assert out.metrics.num_compressions == 0
        else:
            assert out.metrics.peak_blocks <= fields.get("kv_budget_tokens", BUDGET) // BLOCK + 1
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_full(llm)
    assert sorted(llm.engine.scheduler.free_query_slots) == [0, 1]


def test_full_kv_request_is_capped_at_what_the_cache_holds(checkpoint_dir):
    """With compression, max_model_len may exceed the cache; a full-KV request must still fit it alone."""
    model_dir = checkpoint_dir("qwen3")
    llm = make_llm(model_dir, block_size=BLOCK, max_model_len=512, kv_cache_memory_bytes=12 * _block_bytes(model_dir),
                   compression=CompressionConfig(kv_budget_tokens=2 * BLOCK))
    capacity = llm.engine.block_manager.num_blocks * BLOCK
    assert capacity < 512
    full, compressed = llm.generate([_prompt(1, 10)] * 2, [_params(600, compression=False), _params(600)],
                                    use_tqdm=False)
    assert len(full.outputs[0].token_ids) == capacity - 10
    assert len(compressed.outputs[0].token_ids) == 512 - 10
    assert_pool_full(llm)


# -- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,message", [
    (dict(kv_budget_tokens=0), r"kv_budget_tokens must be None .* integer >= 1, got 0"),
    (dict(kv_budget_tokens=32.0), r"kv_budget_tokens must be None .* got 32.0"),
    (dict(kv_budget_tokens=True), r"kv_budget_tokens must be None .* got True"),
    (dict(compression="no"), r"compression must be True or False, got 'no'"),
    (dict(compression=False, kv_budget_tokens=32), r"kv_budget_tokens=32 asks for compression, but compression=False"),
])
def test_sampling_params_reject_bad_budget_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_engine_rejects_budgets_it_cannot_give(checkpoint_dir):
    model_dir = checkpoint_dir("qwen3")
    llm = _engine(model_dir, BUDGET)
    allowed = rf"multiple of block_size={BLOCK} in \[{BLOCK}, {BUDGET}\]"
    for budget in (BUDGET + BLOCK, BLOCK + 1, 8, 10 * BUDGET):
        with pytest.raises(ValueError, match=rf"kv_budget_tokens={budget} must be a {allowed}"):
            llm.generate([[5, 6, 7]], _params(4, kv_budget_tokens=budget), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # the whole batch is checked before any of it is added
    with pytest.raises(ValueError, match="kv_budget_tokens=8"):
        llm.generate([[5, 6, 7]] * 2, [_params(4), _params(4, kv_budget_tokens=8)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_pool_full(llm)

    full = make_llm(model_dir, block_size=BLOCK, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(ValueError, match=r"kv_budget_tokens=32: this engine runs without compression"):
        full.generate([[5, 6, 7]], _params(4, kv_budget_tokens=32), use_tqdm=False)
    # compression=False is then a no-op
    a, b = full.generate([[5, 6, 7]] * 2, [_params(8), _params(8, compression=False)], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_pool_full(full)


# -- over HTTP -----------------------------------------------------------------------------------
def test_server_takes_the_budget_fields_on_both_endpoints(checkpoint_dir):
    import httpx

    from zipage.server.app import create_app
    from zipage.server.background import ServerThread

    model_dir = checkpoint_dir("qwen3")
    compression = dict(kv_budget_tokens=2 * BLOCK, window=8)
    llm = make_llm(model_dir, block_size=BLOCK, max_model_len=256, compression=CompressionConfig(**compression))
    prompt = _prompt(7, 20)
    # references: alone, offline, on engines configured with each budget (and full KV)
    refs = {}
    for name, config in (("small", CompressionConfig(**dict(compression, kv_budget_tokens=BLOCK))), ("full", None)):
        engine = make_llm(model_dir, block_size=BLOCK, max_model_len=256, async_scheduling=False, compression=config)
        refs[name] = engine.generate([prompt], _params(60), use_tqdm=False)[0].outputs[0].text
    app = create_app(llm.engine, "tiny")
    with ServerThread(app) as server:
        def post(path, **fields):
            body = dict(model="tiny", max_tokens=60, temperature=0, ignore_eos=True, **fields)
            return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)

        for fields, ref in ((dict(kv_budget_tokens=BLOCK), "small"), (dict(compression=False), "full")):
            response = post("completions", prompt=prompt, **fields)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == refs[ref], fields
        chat = post("chat/completions", messages=[{"role": "user", "content": "hi"}], kv_budget_tokens=BLOCK)
        assert chat.status_code == 200, chat.text
        # the official client, streamed and not: the same text as the budget's reference
        import openai
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        extra = {"ignore_eos": True, "kv_budget_tokens": BLOCK}
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0, extra_body=extra)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=60, temperature=0, extra_body=extra, stream=True) if c.choices)
        assert whole.choices[0].text == streamed == refs["small"]
        bad = [
            (dict(kv_budget_tokens=3 * BLOCK), "kv_budget_tokens",
             f"kv_budget_tokens=48 must be a multiple of block_size={BLOCK} in [16, 32]"),
            (dict(kv_budget_tokens=20), "kv_budget_tokens", "kv_budget_tokens=20 must be a multiple"),
            (dict(kv_budget_tokens=0), "kv_budget_tokens", "kv_budget_tokens must be in [1, inf), got 0"),
            (dict(kv_budget_tokens="32"), "kv_budget_tokens", "'32'"),
            (dict(compression="no"), "compression", "'no'"),
            (dict(compression=False, kv_budget_tokens=BLOCK), None, "compression=False asks for full KV"),
        ]
        for fields, param, words in bad:
            for path, body in (("completions", dict(prompt="hi")),
                               ("chat/completions", dict(messages=[{"role": "user", "content": "hi"}]))):
                response = post(path, **body, **fields)
                assert response.status_code == 400, (path, fields, response.text)
                error = response.json()["error"]
                assert error["param"] == param and words in error["message"], (path, fields, error)
        deadline = time.monotonic() + 20
        while app.state.engine.call_threadsafe(llm.engine.has_unfinished_requests):
            assert time.monotonic() < deadline, "requests still in the engine"
            time.sleep(0.05)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        # per budget: the small-budget completions (three) and chat, the full-KV completion; 60 tokens each
        assert f'zipage_requests_finished_by_kv_budget_total{{kv_budget="{BLOCK}"}} 4.0' in metrics
        assert 'zipage_requests_finished_by_kv_budget_total{kv_budget="full"} 1.0' in metrics
        assert 'zipage_generation_tokens_by_kv_budget_total{kv_budget="full"} 60.0' in metrics
        assert f'zipage_requests_running_by_kv_budget{{kv_budget="{BLOCK}"}} 0.0' in metrics
        assert f'zipage_compressions_by_kv_budget_total{{kv_budget="{BLOCK}"}}' in metrics
        # the gauges inference gateways read, under vLLM's names
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
            assert f'{name}{{model_name="tiny"}} 0.0' in metrics
        values = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith(("vllm:kv_cache_usage_perc{", "vllm:gpu_cache_usage_perc{"))}
        assert set(values) == {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}
        assert 0 <= values["vllm:kv_cache_usage_perc"] == values["vllm:gpu_cache_usage_perc"] <= 1
    assert_pool_full(llm)
