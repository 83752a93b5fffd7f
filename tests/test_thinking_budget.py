"""Thinking budgets: ``</think>`` forced on the device once a request's budget is spent.

Checked against references: the device update against a host simulation of the same
rules on random token streams; the engine's greedy output against transformers
(tokens before the forced ``</think>`` are the unbudgeted output, those after it are
transformers' greedy continuation of the prompt and everything up to it); asynchronous
against synchronous scheduling; a preempted request against one that was not.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import assert_pool_full, make_llm
from zipage import SamplingParams
from zipage.layers.sampler import SamplingTensors
from zipage.runner.thinking import BEFORE, DONE, THINKING, ThinkingBudgets, replay

START, END = 7, 9


def _simulate(phase: int, count: int, budget: int, sampled: list[int]) -> tuple[list[int], int, int]:
    """The rules, one token at a time on the host: the final tokens and the state after them."""
    final = []
    for token in sampled:
        if phase == THINKING and count >= budget:
            token = END
        if phase == BEFORE and token == START:
            phase = THINKING
        elif phase == THINKING:
            if token == END:
                phase = DONE
            else:
                count += 1
        final.append(token)
    return final, phase, count


def test_device_update_matches_the_host_rules_on_random_streams():
    rng = random.Random(0)
    rows, steps, batch = 6, 40, 9
    budgets = ThinkingBudgets(rows, torch.device("cpu"))
    budgets.configure(START, END)
    state = {}  # batch row -> (state row, phase, count, budget)
    for row, (state_row, phase, budget) in enumerate([(0, BEFORE, 3), (5, THINKING, 0), (2, THINKING, 5),
                                                       (3, DONE, 2), (1, BEFORE, 0)]):
        budgets.state[state_row] = torch.tensor([phase, 0, budget], dtype=torch.int32)
        state[2 * row] = (state_row, phase, 0, budget)
    batch_rows = sorted(state)
    st = SamplingTensors(temperatures=torch.zeros(batch), top_k=None, top_p=None, min_p=None,
                         seeds=torch.zeros(batch, dtype=torch.int64), steps=torch.zeros(batch, dtype=torch.int64),
                         all_greedy=True, thinking_rows=torch.tensor(batch_rows),
                         thinking_index=torch.tensor([state[r][0] for r in batch_rows]))
    streams = {r: [] for r in range(batch)}
    finals = {r: [] for r in range(batch)}
    for _ in range(steps):
        sampled = torch.tensor([rng.choice([START, END, 1, 2, 3, 4]) for _ in range(batch)])
        out = budgets.force(st, sampled)
        for r in range(batch):
            streams[r].append(int(sampled[r]))
            finals[r].append(int(out[r]))
    for r in range(batch):
        if r not in state:
            assert finals[r] == streams[r]  # rows without a budget are untouched
            continue
        state_row, phase, count, budget = state[r]
        expected, phase, count = _simulate(phase, count, budget, streams[r])
        assert finals[r] == expected
        assert budgets.state[state_row].tolist() == [phase, count, budget]


def test_replay_of_prompt_and_output():
    assert replay([1, START, 2], [], START, END, 4) == (THINKING, 0)
    assert replay([1, START, 2, END, 3], [], START, END, 4) == (BEFORE, 0)  # an earlier turn's closed block
    assert replay([1], [START, 2, 3, END, 4], START, END, 4) == (DONE, 2)
    assert replay([START], [2, 3], START, END, 4) == (THINKING, 2)


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("qwen3", thinking="r1")  # the generation prompt opens <think>


def _prompt_ids(llm, text: str) -> list[int]:
    tok = llm.engine.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize("budget", [0, 3, 11])
def test_forced_end_of_thinking_matches_transformers(model_dir, hf_greedy, budget):
    llm = make_llm(model_dir)
    end = llm.engine.tokenizer.convert_tokens_to_ids("</think>")
    prompt = _prompt_ids(llm, "what is 12 + 30?")
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert end not in free[:budget + 1], "precondition: the model does not end its thinking by itself"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                thinking_token_budget=budget), use_tqdm=False)[0].outputs[0]
    ids = out.token_ids
    assert ids[:budget] == free[:budget]
    assert ids[budget] == end
    assert ids[budget + 1:] == hf_greedy(model_dir, prompt + ids[:budget + 1], 24 - budget - 1)
    assert "</think>" in llm.engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert_pool_full(llm)
    assert not llm.engine.runner.thinking.rows


def _batch(llm) -> tuple[list, list[SamplingParams]]:
    prompts = [_prompt_ids(llm, f"question number {i}") for i in range(6)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True,
                             thinking_token_budget=[2, None, 5, 0, None, 9][i], logprobs=1 if i == 2 else None,
                             presence_penalty=0.5 if i == 3 else 0.0) for i in range(6)]
    return prompts, params


def test_async_equals_sync_and_unbudgeted_requests_are_unchanged(model_dir):
    outputs = {}
    for async_scheduling in (True, False):
        llm = make_llm(model_dir, max_num_seqs=4, async_scheduling=async_scheduling)
        prompts, params = _batch(llm)
        outputs[async_scheduling] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_pool_full(llm)
    assert outputs[True] == outputs[False]
    end = llm.engine.tokenizer.convert_tokens_to_ids("</think>")
    for ids, p in zip(outputs[True], params):
        if p.thinking_token_budget is not None and end not in ids[:p.thinking_token_budget]:
            assert ids[p.thinking_token_budget] == end
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True) for i in (1, 4)]
    alone = llm.generate([prompts[1], prompts[4]], plain, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [outputs[True][1], outputs[True][4]]


def test_budgets_survive_preemption(model_dir):
    from zipage.models.registry import spec_from_config
    from zipage.runner.kv_cache import bytes_per_block
    from zipage.utils.loader import load_config

    roomy = make_llm(model_dir, max_num_seqs=6, block_size=16, max_model_len=128)
    prompts, params = _batch(roomy)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, ignore_eos=True,
                             thinking_token_budget=[20, None, 30, 25, 40, 35][i]) for i in range(6)]
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    per_block = bytes_per_block(spec_from_config(load_config(model_dir)), 16, torch.float32)
    tight = make_llm(model_dir, max_num_seqs=6, block_size=16, max_model_len=128,
                     kv_cache_memory_bytes=12 * per_block)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)] == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert_pool_full(tight)


def test_bad_budgets_are_refused(checkpoint_dir, model_dir):
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="thinking_token_budget"):
            SamplingParams(thinking_token_budget=bad)
    plain = make_llm(checkpoint_dir("qwen3"))  # a tokenizer without <think>
    with pytest.raises(ValueError, match="thinking_token_budget=4.*no <think>"):
        plain.generate(["x"], SamplingParams(thinking_token_budget=4), use_tqdm=False)
    assert_pool_full(plain)


def test_thinking_budget_over_http(model_dir):
    import httpx
    import openai

    from zipage.server.app import create_app
    from zipage.server.background import ServerThread

    llm = make_llm(model_dir)
    offline = make_llm(model_dir)
    messages = [{"role": "user", "content": "what is 12 + 30?"}]
    tok = offline.engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                               thinking_token_budget=3),
                                use_tqdm=False)[0].outputs[0]
    thinking, _, answer = expected.text.partition("</think>")
    app = create_app(llm.engine, "tiny", stream_interval=0, reasoning_parser="deepseek_r1")
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        response = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12,
                                                  extra_body={"ignore_eos": True, "thinking_token_budget": 3})
        message = response.choices[0].message
        assert message.model_extra["reasoning"] == thinking and (message.content or "") == answer
        # streamed, with the server's own budget field beside it: the same text
        chunks = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12,
                                                stream=True, extra_body={"ignore_eos": True, "thinking_token_budget": 3,
                                                                         "kv_budget_tokens": None})
        reasoning, content = "", ""
        for chunk in chunks:
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == (thinking, answer)
        for bad, words in ((-1, "thinking_token_budget must be in [0, inf), got -1"), ("x", "'x'")):
            error = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": messages, "thinking_token_budget": bad}).json()["error"]
            assert error["param"] == "thinking_token_budget" and words in error["message"], error
    assert_pool_full(llm)
