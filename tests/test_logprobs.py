"""Log probabilities: offline against a float64 log_softmax of transformers' logits, the sampler's
raw and processed modes, and the server's OpenAI shapes through the official client."""

from __future__ import annotations

import math
import random

import openai
import pytest
import torch

from tests.conftest import assert_pool_full, make_llm
from tests.test_sampler import make_tensors
from zipage import SamplingParams
from zipage.config import EngineConfig
from zipage.layers.sampler import Sampler
from zipage.server.app import create_app
from zipage.server.background import ServerThread

TOLERANCE = 1e-4  # float32 on the CPU against float64 of float32 logits
MODEL = "tiny"
TIMEOUT = 60


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("qwen3")


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    """``hf_logprobs(prompt, output)``: float64 log_softmax [len(output), vocab] of transformers'
    logits at the positions that predicted each output token."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(prompt: list[int], output: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + output[:-1]])
        with torch.no_grad():
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
        return torch.log_softmax(logits[len(prompt) - 1:].double(), dim=-1)

    return run


def _prompts(vocab: int, lengths) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _check_position(position: dict, token: int, ref: torch.Tensor, k: int, sampled_rank_one: bool) -> None:
    """One position's {id: Logprob} against the reference row ``ref`` [vocab] (float64)."""
    assert token in position
    for token_id, lp in position.items():
        assert abs(lp.logprob - ref[token_id].item()) < TOLERANCE, (token_id, lp.logprob, ref[token_id].item())
    sampled = position[token]
    # Its rank is one more than the tokens more likely than it (up to rounding at the tolerance).
    above = (ref > ref[token] + TOLERANCE).sum().item()
    near = (ref > ref[token] - TOLERANCE).sum().item()
    assert above + 1 <= sampled.rank <= near, (sampled.rank, above, near)
    if sampled_rank_one:
        assert sampled.rank == 1
    top = sorted((lp.rank, token_id) for token_id, lp in position.items()
                 if lp.rank <= k and not (token_id == token and sampled.rank > k))
    assert [rank for rank, _ in top] == list(range(1, k + 1))
    ref_top = ref.topk(k + 1)
    if k and ref_top.values[k - 1] - ref_top.values[k] > TOLERANCE:  # the reference's top k is unambiguous
        assert {token_id for _, token_id in top} == set(ref_top.indices[:k].tolist())
    assert len(position) == k + (sampled.rank > k)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_logprobs_match_transformers(model_dir, hf_logprobs, async_scheduling):
    llm = make_llm(model_dir, block_size=16, max_num_seqs=8, async_scheduling=async_scheduling)
    prompts = _prompts(llm.engine.vocab_size, [1, 5, 17, 40])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # A request without logprobs in the same batch gets none, and the same tokens.
    outputs = llm.generate(prompts + prompts[:1], [params] * len(prompts) + [plain], use_tqdm=False)
    assert outputs[-1].outputs[0].logprobs is None
    assert outputs[-1].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        ref = hf_logprobs(prompt, completion.token_ids)
        for i, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert token == ref[i].argmax().item()
            _check_position(position, token, ref[i], 5, sampled_rank_one=True)
            assert all(isinstance(lp.decoded_token, str) for lp in position.values())
        assert completion.logprobs[0][completion.token_ids[0]].decoded_token == \
            llm.tokenizer.decode([completion.token_ids[0]])
    assert_pool_full(llm)


def test_sampled_logprobs_are_raw_with_ranks_and_k0(model_dir, hf_logprobs):
    """Sampling at a high temperature picks tokens of rank > 1; raw logprobs ignore temperature and
    top-p; logprobs=0 gives the sampled token alone; the streamed logprobs add up to generate's."""
    llm = make_llm(model_dir, block_size=16, max_num_seqs=8)
    prompts = _prompts(llm.engine.vocab_size, [3, 9, 20])
    params = [SamplingParams(temperature=1.5, top_p=0.95, max_tokens=8, ignore_eos=True, seed=s, logprobs=k)
              for s, k in zip(range(3), [0, 3, 20])]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    ranks = []
    for prompt, sp, out in zip(prompts, params, outputs):
        completion = out.outputs[0]
        ref = hf_logprobs(prompt, completion.token_ids)
        for i, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
            _check_position(position, token, ref[i], sp.logprobs, sampled_rank_one=False)
            ranks.append(position[token].rank)
    assert max(ranks) > 1  # some sampled token was not the most likely one
    assert all(len(p) == 1 for p in outputs[0].outputs[0].logprobs)

    ids = [llm.engine.add_request(p, sp, stream=True) for p, sp in zip(prompts, params)]
    streamed = {i: [] for i in ids}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step()[0]:
            assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
            streamed[out.request_id] += out.outputs[0].logprobs
    for rid, out in zip(ids, outputs):
        assert streamed[rid] == out.outputs[0].logprobs
    assert_pool_full(llm)


def test_processed_mode_is_the_distribution_sampled_from(model_dir, hf_logprobs):
    """Processed logprobs: after temperature and top-k, so only the k kept tokens are finite."""
    llm = make_llm(model_dir, block_size=16, logprobs_mode="processed")
    prompt = _prompts(llm.engine.vocab_size, [12])[0]
    params = SamplingParams(temperature=0.5, top_k=4, max_tokens=5, ignore_eos=True, seed=3, logprobs=6)
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ref = hf_logprobs(prompt, completion.token_ids)
    for i, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        kept = ref[i].topk(4).indices
        processed = torch.full_like(ref[i], -math.inf)
        processed[kept] = torch.log_softmax(ref[i][kept] / 0.5, dim=-1)
        assert token in kept.tolist()
        for token_id, lp in position.items():
            expected = processed[token_id].item()
            assert lp.logprob == expected if expected == -math.inf else abs(lp.logprob - expected) < 10 * TOLERANCE
        assert sum(math.isfinite(lp.logprob) for lp in position.values()) == 4


def test_prompt_logprobs_match_transformers_and_skip_the_prefix_cache(model_dir, monkeypatch):
    """Every prompt token after the first, against float64 log_softmax of transformers' logits; a
    prompt longer than one chunk; a one-token prompt; a cached prefix not used; preemption-free."""
    from transformers import AutoModelForCausalLM

    import zipage.runner.model_runner as model_runner
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_CHUNK", 7)  # several chunks per prompt
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = make_llm(model_dir, block_size=16, max_num_seqs=8)
    prompts = _prompts(llm.engine.vocab_size, [1, 5, 40, 40])
    prompts[3][:32] = prompts[2][:32]  # two full blocks shared with the prompt before it
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([prompts[2]], plain, use_tqdm=False)  # its blocks are now in the prefix cache
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=k, logprobs=1)
              for k in (0, 3, 5, 2)]
    outputs = llm.generate(prompts + [prompts[2]], params + [plain], use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        assert out.metrics.num_cached_prompt_tokens == 0  # computed whole
        if len(prompt) > 1:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                ref = torch.log_softmax(model(ids, attention_mask=torch.ones_like(ids)).logits[0].double(), -1)
            for i in range(1, len(prompt)):
                _check_position(out.prompt_logprobs[i], prompt[i], ref[i - 1], p.prompt_logprobs, False)
                assert all(lp.decoded_token is not None for lp in out.prompt_logprobs[i].values())
    assert outputs[4].prompt_logprobs is None and outputs[4].metrics.num_cached_prompt_tokens == 32
    assert_pool_full(llm)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None or an integer in \[0, 20\], got 21"):
        SamplingParams(prompt_logprobs=21)


def test_sampler_modes_on_penalised_and_banned_rows():
    """Raw: log_softmax of the logits; processed: of the banned (-inf), tempered, top-k'd logits.
    Only the rows asked get logprobs, and only [rows, k + 1] values come back."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    st = make_tensors([0.0, 0.7, 1.3, 0.0], top_k=[50, 5, 50, 50], banned=[(0, int(logits[0].argmax()))])
    st.logprob_rows, st.max_logprobs = torch.tensor([0, 1, 3]), 3
    for mode in ("raw", "processed"):
        tokens, logprobs = Sampler(logprobs_mode=mode).sample(logits, st)
        assert logprobs.token_ids.shape == logprobs.logprobs.shape == (3, 4)
        assert torch.equal(logprobs.token_ids[:, 0], tokens[[0, 1, 3]])
        source = logits.clone().double()
        if mode == "processed":
            source[0, int(logits[0].argmax())] = -math.inf
            source[1] = source[1] / 0.7
            source[1, source[1].argsort(descending=True)[5:]] = -math.inf
        expected = torch.log_softmax(source, dim=-1)
        for j, row in enumerate([0, 1, 3]):
            values = expected[row][logprobs.token_ids[j]]
            assert torch.allclose(logprobs.logprobs[j].double(), values, atol=1e-5)
            assert torch.equal(logprobs.token_ids[j, 1:], expected[row].topk(3).indices)
            greater = (expected[row] > expected[row][tokens[row]]).sum().item()
            assert logprobs.ranks[j].item() == greater + 1
        # The banned token is the raw row's most likely; the processed row excludes it.
        assert logprobs.ranks[0].item() == (2 if mode == "raw" else 1)
        assert (logprobs.token_ids[0, 1].item() == int(logits[0].argmax())) == (mode == "raw")


def test_bad_logprobs_settings_are_refused(model_dir):
    for bad in (21, -1, True, 2.5):
        with pytest.raises(ValueError, match=r"logprobs must be None or an integer in \[0, 20\], got "):
            SamplingParams(logprobs=bad)
    with pytest.raises(ValueError, match="logprobs_mode must be 'raw' or 'processed', got 'logits'"):
        EngineConfig(model=model_dir, logprobs_mode="logits")


# -- server ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(model_dir):
    llm = make_llm(model_dir, block_size=16, max_num_seqs=8, max_model_len=512)
    app = create_app(llm.engine, MODEL)
    with ServerThread(app) as server:
        server.llm, server.pre = llm, app.state.preprocessor
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=TIMEOUT)
        yield server


@pytest.fixture(scope="module")
def offline(model_dir):
    """An engine of the same checkpoint outside the server, for the numbers the server should show."""
    return make_llm(model_dir, block_size=16)


def test_chat_logprobs_streamed_and_not(served, offline):
    client = served.client
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Count to five"}], temperature=0,
                   max_tokens=12, logprobs=True, top_logprobs=3, n=2)
    response = client.chat.completions.create(**request)
    for choice in response.choices:
        content = choice.logprobs.content
        assert len(content) == response.usage.completion_tokens // 2
        for entry in content:
            assert len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely
            assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6
            assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                     reverse=True)
            assert entry.bytes == list(entry.token.encode())
    # The engine's own numbers, offline.
    ids = served.pre.encode_chat(request["messages"], None)
    expected = offline.generate([ids], SamplingParams(temperature=0, max_tokens=12, logprobs=3),
                                use_tqdm=False)[0].outputs[0]
    assert [e.logprob for e in response.choices[0].logprobs.content] == \
        pytest.approx([p[t].logprob for t, p in zip(expected.token_ids, expected.logprobs)], abs=1e-5)

    streamed: list = []
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            if choice.index == 0 and choice.logprobs is not None:
                streamed += choice.logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == \
        [(e.token, e.logprob) for e in response.choices[0].logprobs.content]
    # Without logprobs, none.
    plain = client.chat.completions.create(model=MODEL, messages=request["messages"], max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_streamed_and_not(served, offline):
    client = served.client
    request = dict(model=MODEL, prompt="The quick brown fox", temperature=0, max_tokens=10, logprobs=2)
    response = client.completions.create(**request)
    lp = response.choices[0].logprobs
    n = response.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and top[token] == value == max(top.values())
    expected = offline.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=10, logprobs=2),
                                use_tqdm=False)[0].outputs[0]
    assert lp.token_logprobs == pytest.approx([p[t].logprob for t, p in zip(expected.token_ids, expected.logprobs)],
                                              abs=1e-5)
    streamed_tokens, streamed_values, offsets = [], [], []
    for chunk in client.completions.create(**request, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed_tokens += chunk.choices[0].logprobs.tokens
            streamed_values += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert (streamed_tokens, streamed_values, offsets) == (lp.tokens, lp.token_logprobs, lp.text_offset)


def test_prompt_logprobs_over_http(served, offline):
    client = served.client
    prompt = "The quick brown fox"
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                                use_tqdm=False)[0].prompt_logprobs
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 2})
    got = response.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(expected)
    for position, reference in zip(got[1:], expected[1:]):
        assert {int(t) for t in position} == set(reference)
        for token_id, entry in position.items():
            ref = reference[int(token_id)]
            assert entry["logprob"] == pytest.approx(ref.logprob, abs=1e-5) and entry["rank"] == ref.rank
            assert entry["decoded_token"] == ref.decoded_token
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    positions = chat.model_extra["prompt_logprobs"]
    assert positions[0] is None and len(positions) == chat.usage.prompt_tokens
    assert all(len(p) == 1 and next(iter(p.values()))["rank"] >= 1 for p in positions[1:])


@pytest.mark.parametrize("path, body, param, words", [
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs", "in [0, 20], got 21"),
    ("chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "non-streamed"),
    ("chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs", "in [0, 20], got 21"),
    ("chat/completions", {"top_logprobs": 2}, None, "top_logprobs=2 needs logprobs=true"),
    ("completions", {"logprobs": 21}, "logprobs", "in [0, 20], got 21"),
    ("completions", {"logprobs": True}, "logprobs", "integer"),
])
def test_bad_logprobs_requests_get_400(served, path, body, param, words):
    import httpx
    base = ({"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat")
            else {"prompt": "hi"})
    response = httpx.post(f"{served.url}/v1/{path}", json={"model": MODEL, **base, **body}, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
