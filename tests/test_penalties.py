"""Presence, frequency and repetition penalties from token counts kept on the device.

The sampler is checked against a float64 reference computed from full token lists;
the engine against transformers (``generate`` with ``repetition_penalty``, and a
forward loop applying the reference penalties), across preemption, asynchronous
scheduling and row reuse; then the parameters, the server and the benchmark.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import assert_pool_full, make_llm
from zipage import SamplingParams
from zipage.cli import main as cli_main
from zipage.engine.sequence import Sequence, SequenceStatus
from zipage.layers.sampler import Sampler, apply_penalties, exponential_noise
from zipage.runner.inputs import sampling_tensors
from zipage.runner.penalties import PenaltyState

CPU = torch.device("cpu")
BLOCK = 16


# -- references -----------------------------------------------------------------------------------
def reference_penalised(logits, prompt, output, repetition=1.0, frequency=0.0, presence=0.0) -> np.ndarray:
    """vLLM's penalties in float64, token by token from the full lists: repetition on every token of
    the prompt or output, then frequency per occurrence in the output, then presence."""
    x = np.array(logits, dtype=np.float64)
    for t in set(prompt) | set(output):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t, count in Counter(output).items():
        x[t] -= frequency * count
        x[t] -= presence
    return x


def winner(scores: np.ndarray, margin: float = 1e-3) -> int | None:
    """The argmax, or None when the runner-up is within ``margin`` (float32 may order them otherwise)."""
    top2 = np.argsort(-scores, kind="stable")[:2]
    return int(top2[0]) if scores[top2[0]] - scores[top2[1]] > margin else None


def _prompts(seed: int, lengths, vocab: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def engine(model_dir, **kwargs):
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("max_model_len", 256)
    return make_llm(model_dir, **kwargs)


def rows_in_use(llm) -> int:
    return len(llm.engine.runner.penalties.rows)


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("qwen3")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# -- the sampler against the float64 reference ----------------------------------------------------
def _random_request(rng: np.random.Generator, vocab: int, i: int) -> tuple[SamplingParams, list, list]:
    """Params with a random mix of penalties (or none) and sampling, a prompt and an output that
    repeat tokens (drawn from a small pool, so counts exceed one)."""
    pool = rng.choice(vocab, size=12, replace=False)
    prompt = rng.choice(pool, size=int(rng.integers(1, 15))).tolist()
    output = rng.choice(pool, size=int(rng.integers(0, 25))).tolist()
    penalties = {}
    if rng.random() < 0.7:
        used = rng.random(3) < 0.6
        if used[0] or not used.any():
            penalties["repetition_penalty"] = float(rng.uniform(0.5, 2.0))
        if used[1]:
            penalties["frequency_penalty"] = float(rng.uniform(-2.0, 2.0))
        if used[2]:
            penalties["presence_penalty"] = float(rng.uniform(-2.0, 2.0))
    sampled = rng.random() < 0.5
    params = SamplingParams(temperature=float(rng.uniform(0.5, 1.5)) if sampled else 0.0,
                            top_k=int(rng.integers(2, vocab)) if sampled and rng.random() < 0.5 else -1,
                            seed=i, max_tokens=64, **penalties)
    return params, prompt, output


@pytest.mark.parametrize("trial", range(4))
def test_sampler_penalties_match_float64_reference(trial):
    """Rows are built at a prefill (part of the output already there, as for a preempted request)
    and the rest counted one sampled token at a time; rows of other requests come and go first."""
    rng = np.random.default_rng(trial)
    vocab, batch = 61, 14
    state = PenaltyState(batch + 4, vocab, CPU)
    churn = [Sequence(f"old{i}", None, [1, 2], SamplingParams(presence_penalty=1.0), 8, 0) for i in range(6)]
    state.admit(churn)
    state.release(churn[::2])  # free rows scattered among held ones
    seqs, outputs = [], []
    for i in range(batch):
        params, prompt, output = _random_request(rng, vocab, i)
        seq = Sequence(str(i), None, prompt, params, 64, seed=1000 + i)
        seq.status = SequenceStatus.RUNNING  # admitted, as the scheduler does before a prefill
        split = int(rng.integers(0, len(output) + 1))
        seq.token_ids.extend(output[:split])
        seqs.append(seq)
        outputs.append(output)
    order = rng.permutation(batch)
    state.admit([seqs[i] for i in order])  # a prefill of every request
    while True:  # decode steps of those with tokens left: each adds one sampled token
        live = [s for s, out in zip(seqs, outputs) if len(s.token_ids) - s.num_prompt_tokens < len(out)]
        if not live:
            break
        st = sampling_tensors(live, vocab, set(), CPU, state.rows)
        sampled = [outputs[int(s.request_id)][len(s.token_ids) - s.num_prompt_tokens] for s in live]
        state.add_sampled(st, torch.tensor(sampled))
        for seq, token in zip(live, sampled):
            seq.token_ids.append(token)
    penalised = [s for s in seqs if s.sampling_params.has_penalties]
    assert 0 < len(penalised) < batch
    for seq in penalised:  # the device rows hold what the host's lists say
        row, prompt, output = state.rows[seq], seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids
        assert state.prompt_mask[row].tolist() == [t in prompt for t in range(vocab)]
        assert state.counts[row].tolist() == [output.count(t) for t in range(vocab)]

    logits = torch.from_numpy(rng.normal(0.0, 2.0, size=(batch, vocab)).astype(np.float32))
    st = sampling_tensors(seqs, vocab, set(), CPU, state.rows)
    references = [reference_penalised(logits[i].numpy(), s.token_ids[:s.num_prompt_tokens], s.output_token_ids,
                                      s.sampling_params.repetition_penalty, s.sampling_params.frequency_penalty,
                                      s.sampling_params.presence_penalty) for i, s in enumerate(seqs)]
    index = st.penalty_index.tolist()
    got = apply_penalties(logits[index], state.counts, state.prompt_mask, st.penalty_rows, st.repetition_penalty,
                          st.frequency_penalty, st.presence_penalty)
    np.testing.assert_allclose(got.double().numpy(), np.stack([references[i] for i in index]), rtol=1e-6, atol=1e-5)

    tokens = Sampler(state)(logits, st).tolist()
    noise = exponential_noise(st.seeds, st.steps, vocab).double().numpy()
    checked = 0
    for i, seq in enumerate(seqs):
        p, scores = seq.sampling_params, references[i]
        if p.temperature > 0:
            scores = scores / p.temperature - np.log(noise[i])
            if p.top_k > 0:  # only the top k of the penalised logits compete
                scores[np.argsort(-references[i], kind="stable")[p.top_k:]] = -np.inf
        expected = winner(scores)
        if expected is not None:
            assert tokens[i] == expected, f"row {i} ({p})"
            checked += 1
    assert checked >= batch - 2


def test_sampling_tensors_carry_penalties_only_for_penalised_rows():
    vocab = 20
    state = PenaltyState(4, vocab, CPU)
    plain = Sequence("plain", None, [1, 2], SamplingParams(temperature=0), 8, 0)
    both = Sequence("both", None, [3], SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=-1), 8, 0)
    rep = Sequence("rep", None, [4], SamplingParams(temperature=0, repetition_penalty=1.3), 8, 0)
    state.admit([plain, both, rep])
    assert set(state.rows) == {both, rep}
    st = sampling_tensors([plain, plain], vocab, set(), CPU, state.rows)
    assert st.penalty_rows is None and st.repetition_penalty is None  # the all-greedy fast path stays
    st = sampling_tensors([rep, plain, both], vocab, set(), CPU, state.rows)
    assert st.penalty_index.tolist() == [0, 2]
    assert st.penalty_rows.tolist() == [state.rows[rep], state.rows[both]]
    assert st.repetition_penalty.tolist() == pytest.approx([1.3, 1.0])
    assert st.frequency_penalty.tolist() == [0.0, -1.0] and st.presence_penalty.tolist() == [0.0, 0.5]
    st = sampling_tensors([both, rep], vocab, set(), CPU, state.rows)
    assert st.penalty_index is None  # every row penalised: no gather or scatter
    state.release([rep])
    with pytest.raises(RuntimeError, match="has penalties but no penalty row"):
        sampling_tensors([rep], vocab, set(), CPU, state.rows)


def test_rows_are_handed_out_freed_and_kept_while_running():
    state = PenaltyState(2, 10, CPU)
    a, b, c = (Sequence(n, None, [1], SamplingParams(repetition_penalty=1.2), 8, 0) for n in "abc")
    for seq in (a, b, c):
        seq.status = SequenceStatus.RUNNING
    state.admit([a, b])
    state.release([a])  # still running (preempted, then readmitted before the engine said so): kept
    assert set(state.rows) == {a, b}
    a.status = SequenceStatus.FINISHED
    state.release([a, a])
    state.admit([c])
    assert state.rows == {b: 1, c: 0}
    assert state.nbytes == 2 * 10 * 5  # an int32 count and a bool per (row, token)


def test_a_row_for_more_requests_than_rows_is_refused_by_name():
    state = PenaltyState(2, 10, CPU)
    a, b, c = (Sequence(n, None, [1, 2], SamplingParams(frequency_penalty=1.0), 8, 0) for n in "abc")
    for seq in (a, b, c):
        seq.status = SequenceStatus.RUNNING
    state.admit([a, b])
    with pytest.raises(RuntimeError, match="all 2 are held by running requests"):
        state.admit([c])
    a.status = SequenceStatus.FINISHED
    state.release([a])
    state.admit([c])
    assert set(state.rows) == {b, c}


# -- the engine against transformers --------------------------------------------------------------
def test_greedy_repetition_penalty_matches_transformers_generate(model_dir, hf_model, hf_greedy):
    n = 12
    prompts = _prompts(1, [5, 17, 30])
    penalties = [1.6, 0.7, 1.25]
    llm = engine(model_dir)
    outputs = _tokens(llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                            repetition_penalty=p) for p in penalties],
                                   use_tqdm=False))
    changed = 0
    for prompt, p, got in zip(prompts, penalties, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                         repetition_penalty=p, max_new_tokens=n, min_new_tokens=n,
                                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == expected, f"repetition_penalty={p}"
        changed += got != hf_greedy(model_dir, prompt, n)
    assert changed, "the penalties changed no output: the test has no teeth"
    assert_pool_full(llm)
    assert rows_in_use(llm) == 0


def _reference_greedy(model, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Greedy tokens from transformers' logits (the whole sequence each step) and reference penalties."""
    output = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].numpy()
        scores = reference_penalised(logits, prompt, output, params.repetition_penalty, params.frequency_penalty,
                                     params.presence_penalty)
        output.append(int(np.argmax(scores)))
    return output


PRESENCE_FREQUENCY = [dict(presence_penalty=1.5), dict(frequency_penalty=0.9), dict(presence_penalty=-0.6),
                      dict(presence_penalty=0.4, frequency_penalty=0.5, repetition_penalty=1.3)]


def test_presence_and_frequency_match_a_transformers_reference_loop(model_dir, hf_model):
    n = 8
    prompts = _prompts(2, [6, 11, 24, 3])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw) for kw in PRESENCE_FREQUENCY]
    llm = engine(model_dir, max_num_seqs=3)  # admitted over several prefills, beside decodes
    outputs = _tokens(llm.generate(prompts, params, use_tqdm=False))
    for prompt, p, got in zip(prompts, params, outputs):
        assert got == _reference_greedy(hf_model, prompt, n, p), p
    plain = _tokens(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                 use_tqdm=False))
    assert sum(a != b for a, b in zip(plain, outputs)) >= 3, "the penalties barely changed the outputs"
    assert_pool_full(llm)
    assert rows_in_use(llm) == 0


# -- preemption, asynchronous scheduling, row reuse -----------------------------------------------
def mixed(max_tokens: int) -> list[SamplingParams]:
    """Greedy and seeded sampling, each penalty alone and together, one request without."""
    kwargs = [dict(temperature=0, presence_penalty=0.8, frequency_penalty=0.4),
              dict(temperature=0.9, seed=7, repetition_penalty=1.3),
              dict(temperature=0),
              dict(temperature=0.7, seed=3, top_p=0.9, frequency_penalty=1.2),
              dict(temperature=0, repetition_penalty=1.2, presence_penalty=-0.5),
              dict(temperature=0, frequency_penalty=0.3)]
    return [SamplingParams(max_tokens=max_tokens + 3 * i, ignore_eos=True, **kw) for i, kw in enumerate(kwargs)]


def test_penalties_survive_preemption(model_dir):
    from zipage.models.registry import spec_from_config
    from zipage.runner.kv_cache import bytes_per_block
    from zipage.utils.loader import load_config

    prompts, params = _prompts(4, [20, 33, 9, 40, 25, 12]), mixed(24)
    expected = _tokens(engine(model_dir, max_model_len=128).generate(prompts, params, use_tqdm=False))
    per_block = bytes_per_block(spec_from_config(load_config(model_dir)), BLOCK, torch.float32)
    llm = engine(model_dir, max_model_len=128, kv_cache_memory_bytes=8 * per_block)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_full(llm)
    assert rows_in_use(llm) == 0


def _launch_log(llm) -> list[bool]:
    """For each launch: whether a step was in flight and the launched batch had a penalised request."""
    runner, log = llm.engine.runner, []
    launch = runner.launch

    def logged(seqs, *args, previous=None, **kwargs):
        log.append(previous is not None and any(s.sampling_params.has_penalties for s in seqs))
        return launch(seqs, *args, previous=previous, **kwargs)

    runner.launch = logged
    return log


def test_asynchronous_scheduling_gives_the_same_tokens(model_dir):
    """Greedy and seeded sampling with penalties, launched ahead or waiting for every step. The
    first batch has presence and frequency penalties only: launched ahead even by an engine that
    still waits for each step's tokens when a request has a repetition penalty."""
    prompts = _prompts(5, [7, 19, 31, 4, 12, 26])
    first = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=0.7),
             SamplingParams(temperature=1.0, seed=11, max_tokens=14, ignore_eos=True, frequency_penalty=0.6,
                            presence_penalty=0.2)]
    params = mixed(16)
    runs = {}
    for asynchronous in (False, True):
        llm = engine(model_dir, max_num_seqs=4, async_scheduling=asynchronous)
        log = _launch_log(llm)
        runs[asynchronous] = (_tokens(llm.generate(prompts[:2], first, use_tqdm=False)),
                              _tokens(llm.generate(prompts, params, use_tqdm=False)))
        assert any(log) is asynchronous  # penalised requests were launched ahead
        assert_pool_full(llm)
        assert rows_in_use(llm) == 0
    assert runs[True] == runs[False]


def test_forget_frees_rows_for_reuse_with_steps_in_flight(model_dir):
    """Two rows for eight penalised requests of different lengths, one aborted mid-way: rows are
    reused while the steps that last held them may still be in flight."""
    prompts = _prompts(6, [5, 9, 14, 3, 21, 8, 11, 6])
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=5 + 2 * i, ignore_eos=True,
                             presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
              for i in range(len(prompts))]
    alone = _tokens(engine(model_dir, max_num_seqs=1).generate(prompts, params, use_tqdm=False))  # one at a time
    llm = engine(model_dir, max_num_seqs=2)
    ids = [llm.engine.add_request(p, s) for p, s in zip(prompts, params)]
    outputs, running_steps, peak = {}, 0, 0
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step()[0]:
            outputs[out.request_id] = out.outputs[0]
        peak = max(peak, rows_in_use(llm))
        running_steps += any(s.request_id == ids[3] for s in llm.engine.scheduler.running)
        if running_steps == 3 and ids[3] not in outputs:  # aborted while running, a step in flight
            outputs[ids[3]] = llm.engine.abort_request(ids[3]).outputs[0]
    assert peak == 2 and rows_in_use(llm) == 0
    assert outputs[ids[3]].finish_reason == "abort"
    for i, request_id in enumerate(ids):
        if i != 3:
            assert outputs[request_id].token_ids == alone[i], f"request {i}"
    assert_pool_full(llm)


# -- parameters, server, benchmark ----------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("presence_penalty", -2.01),
                                          ("frequency_penalty", 3), ("frequency_penalty", float("nan")),
                                          ("repetition_penalty", 0.0)])
def test_bad_penalties_name_the_field_the_value_and_the_range(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be .*in [\[(]") as error:
        SamplingParams(**{field: value})
    assert repr(value) in str(error.value)


def test_server_takes_presence_and_frequency_penalties(model_dir):
    from zipage.server.app import create_app
    from zipage.server.background import ServerThread

    llm = engine(model_dir, max_num_seqs=4)
    prompt = _prompts(7, [9])[0]
    params = dict(temperature=0, max_tokens=8, ignore_eos=True, presence_penalty=1.2, frequency_penalty=-0.4)
    expected = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text
    with ServerThread(create_app(llm.engine, "tiny")) as server:
        def post(path, **body):
            return httpx.post(f"{server.url}/v1/{path}", json=dict(model="tiny", **body), timeout=60)

        response = post("completions", prompt=prompt, **params)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected
        chat = [{"role": "user", "content": "hi"}]
        assert post("chat/completions", messages=chat, max_tokens=4, presence_penalty=-2,
                    frequency_penalty=None).status_code == 200
        for path, body, field in [("completions", dict(prompt="hi", presence_penalty=3), "presence_penalty"),
                                  ("chat/completions", dict(messages=chat, frequency_penalty=-2.5),
                                   "frequency_penalty")]:
            response = post(path, **body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == field and f"{field} must be in [-2.0, 2.0], got" in error["message"]


def test_decode_benchmark_runs_penalties_beside_plain(tmp_path):
    out = tmp_path / "decode.json"
    assert cli_main(["bench", "decode", "--shape", "tiny", "--batch", "2", "--context", "16", "--steps", "4",
                     "--modes", "eager", "--device", "cpu", "--block-size", "16", "--penalties",
                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["sampling"]) for r in rows] == [(2, "plain"), (2, "penalties")]
    assert rows[0]["vs_plain"] == 1.0 and rows[1]["vs_plain"] == rows[1]["mean_tokens_per_s"] / rows[0]["mean_tokens_per_s"]
