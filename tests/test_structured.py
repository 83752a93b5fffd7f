"""Structured output: grammars compiled by xgrammar, bitmasks applied by the sampler.

Checked against references: the device bitmask against a per-token loop; constrained
greedy decoding against transformers' logits masked by a separate matcher, token for
token; sampled outputs against the grammar (regex, choice, JSON schema); asynchronous
scheduling (where the sampler waits for the previous step's tokens) against
synchronous; and the pool returns to full after preemption and aborts.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import assert_pool_full, make_llm
from zipage import SamplingParams
from zipage.sampling_params import ParameterError
from zipage.structured import StructuredOutputsParams, apply_token_bitmask

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "b", "c"]}},
          "required": ["n", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("qwen3")


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir, max_num_seqs=8)


def test_bitmask_matches_a_per_token_loop():
    torch.manual_seed(0)
    batch, vocab = 5, 77
    logits = torch.randn(batch, vocab)
    rows = torch.tensor([3, 0, 4])
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, -(-vocab // 32)), dtype=torch.int32)
    out = apply_token_bitmask(logits, bitmask, rows)
    expected = logits.clone()
    for g, row in enumerate(rows.tolist()):
        for token in range(vocab):
            if not (int(bitmask[g, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    assert torch.equal(out, expected)
    assert torch.equal(logits[[1, 2]], out[[1, 2]])  # other rows untouched, input not modified


def _hf_constrained_greedy(model_dir, tokenizer, prompt_ids, params, vocab_size, eos, max_new):
    """transformers' logits, masked by a fresh matcher of the same grammar, argmax: the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    compiled = (compiler.compile_regex(params.regex) if params.regex else compiler.compile_json_schema(
        json.dumps(params.json)))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    ids, out = list(prompt_ids), []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        matcher.fill_next_token_bitmask(bitmask)
        allowed = xgr.testing.bitmask_to_bool_mask(bitmask, vocab_size)[0]
        token = int(logits.masked_fill(~allowed[:logits.shape[0]], float("-inf")).argmax())
        out.append(token)
        assert matcher.accept_token(token)
        if token in eos:
            break
        ids.append(token)
    return out


@pytest.mark.parametrize("constraint", [StructuredOutputsParams(regex=r"(ab|ba)+ [0-9]{2,4}"),
                                        StructuredOutputsParams(json=SCHEMA)])
def test_constrained_greedy_matches_masked_transformers(llm, model_dir, constraint):
    engine = llm.engine
    prompt = "the answer is"
    prompt_ids = engine.tokenizer.encode(prompt)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, structured_outputs=constraint),
                       use_tqdm=False)[0].outputs[0]
    reference = _hf_constrained_greedy(model_dir, engine.tokenizer, prompt_ids, constraint, engine.vocab_size,
                                       engine.eos_token_ids, 48)
    assert out.token_ids == reference
    if constraint.regex:
        assert out.finish_reason == "stop" and re.fullmatch(constraint.regex, out.text)
    else:  # a random model may write whitespace until max_tokens: a prefix of valid JSON either way
        assert out.text.lstrip().startswith("{")
        if out.finish_reason == "stop":
            value = json.loads(out.text)
            assert set(value) == {"n", "tag"} and isinstance(value["n"], int) and value["tag"] in "abc"


def _mixed_params(seed: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                           structured_outputs=StructuredOutputsParams(regex=r"[xyz]{2,6}-(yes|no)")),
            SamplingParams(temperature=0.9, seed=seed + 1, max_tokens=40, top_p=0.9,
                           structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"])),
            SamplingParams(temperature=1.0, seed=seed + 2, max_tokens=60,
                           structured_outputs={"json": SCHEMA}),
            SamplingParams(temperature=1.0, seed=seed + 3, max_tokens=60,
                           structured_outputs=StructuredOutputsParams(json_object=True)),
            SamplingParams(temperature=1.0, seed=seed + 4, max_tokens=12),  # unconstrained
            SamplingParams(temperature=0.7, seed=seed + 5, max_tokens=30, logprobs=2, repetition_penalty=1.3,
                           structured_outputs=StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ")"'))]


def _check(outputs) -> None:
    texts = [o.outputs[0].text for o in outputs]
    assert re.fullmatch(r"[xyz]{2,6}-(yes|no)", texts[0])
    assert texts[1] in ("alpha", "beta", "gamma delta")
    value = json.loads(texts[2])
    assert set(value) == {"n", "tag"} and isinstance(value["n"], int)
    if outputs[3].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(texts[3]), dict)
    assert re.fullmatch(r"\([a-c]+\)", texts[5])


def test_sampled_outputs_match_their_grammars_and_async_equals_sync(model_dir):
    prompts = ["one", "two three", "four", "five six seven", "eight", "nine"]
    results = {}
    for async_scheduling in (True, False):
        llm = make_llm(model_dir, max_num_seqs=4, async_scheduling=async_scheduling)
        outputs = llm.generate(prompts, _mixed_params(11), use_tqdm=False)
        _check(outputs)
        results[async_scheduling] = [o.outputs[0].token_ids for o in outputs]
        assert_pool_full(llm)
    assert results[True] == results[False]


def test_constraints_survive_preemption_and_prefix_caching(model_dir):
    """A cache too small for the batch preempts requests; they are recomputed and go on matching."""
    from zipage.models.registry import spec_from_config
    from zipage.runner.kv_cache import bytes_per_block
    from zipage.utils.loader import load_config

    prompts = ["shared prefix of some length " * 3 + str(i) for i in range(6)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex=r"[ab]{40,60}")) for i in range(6)]
    roomy = make_llm(model_dir, max_num_seqs=6, block_size=16, max_model_len=128)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    per_block = bytes_per_block(spec_from_config(load_config(model_dir)), 16, torch.float32)
    tight = make_llm(model_dir, max_num_seqs=6, block_size=16, max_model_len=128,
                     kv_cache_memory_bytes=12 * per_block)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for o in outputs:
        assert re.fullmatch(r"[ab]{40,60}", o.outputs[0].text) or (
            o.outputs[0].finish_reason == "length" and re.fullmatch(r"[ab]+", o.outputs[0].text))
    assert_pool_full(tight)


def test_a_grammar_that_cannot_compile_names_the_field(llm):
    with pytest.raises(ParameterError) as error:
        llm.engine.add_request("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    assert error.value.param == "structured_outputs" and "regex" in str(error.value)
    with pytest.raises(ParameterError, match="json"):
        llm.engine.add_request("x", SamplingParams(structured_outputs={"json": {"type": "no-such-type"}}))
    assert_pool_full(llm)


@pytest.mark.parametrize("bad, message", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["b"]), "exactly one"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice="ab"), "non-empty list"),
    (dict(regex=""), "non-empty string"),
    (dict(json=3), "JSON schema"),
    (dict(nonsense=1), "unexpected keyword"),
])
def test_bad_structured_outputs_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=bad)


def test_aborting_a_constrained_request_leaves_nothing_behind(llm):
    engine = llm.engine
    params = SamplingParams(temperature=1.0, max_tokens=30, structured_outputs={"regex": "[0-9]{20,30}"})
    ids = [engine.add_request("prompt", params) for _ in range(3)]
    engine.step()
    engine.step()
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    while engine._launched is not None:  # the step in flight when they ended
        engine._collect_launched()
    assert_pool_full(llm)


def test_json_without_free_whitespace_ends_where_any_whitespace_runs_on(model_dir):
    """Greedy, the random model writes whitespace until max_tokens under JSON's own whitespace rule;
    with structured_outputs_disable_any_whitespace it must write the object, compactly."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "b", "c"]}},
              "required": ["ok", "tag"], "additionalProperties": False}  # bounded: no integer to run on
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs={"json": schema})
    loose = make_llm(model_dir).generate(["the answer is"], params, use_tqdm=False)[0].outputs[0]
    assert loose.finish_reason == "length"  # the precondition that makes the option worth having
    strict = make_llm(model_dir, structured_outputs_disable_any_whitespace=True)
    out = strict.generate(["the answer is"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    assert set(value) == {"ok", "tag"} and out.text == json.dumps(value)  # one space after ',' and ':' only
    with pytest.raises(ValueError, match="structured_outputs_disable_any_whitespace must be True or False"):
        make_llm(model_dir, structured_outputs_disable_any_whitespace="yes")
    from zipage.cli import build_parser
    args = build_parser().parse_args(["serve", "m", "--structured-outputs-disable-any-whitespace"])
    assert args.structured_outputs_disable_any_whitespace is True


@pytest.mark.parametrize("point", ["deferred_sample", "grammar_accept"])
def test_a_fault_in_the_grammar_path_ends_only_its_requests(model_dir, point, monkeypatch):
    """A deferred sampler that raises fails the requests of its step; a matcher that raises fails its
    own request. The others give their tokens, every block returns, and the failed ones run again."""
    from zipage import RequestsFailed
    from zipage.structured import RequestGrammar

    prompts = [f"request {i} of five" for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             structured_outputs={"regex": "[ab]{30,40}"} if i % 2 == 0 else None)
              for i in range(5)]
    expected = [o.outputs[0].token_ids for o in make_llm(model_dir, max_num_seqs=3).generate(
        prompts, params, use_tqdm=False)]
    llm = make_llm(model_dir, max_num_seqs=3)
    calls = [0]
    if point == "deferred_sample":
        real = llm.engine.runner.sample

        def sample(step):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected fault in a deferred sampler")
            return real(step)
        monkeypatch.setattr(llm.engine.runner, "sample", sample)
    else:
        real = RequestGrammar.accept

        def accept(self, token_id):
            calls[0] += 1
            if calls[0] == 7:
                raise RuntimeError("injected fault in a matcher")
            return real(self, token_id)
        monkeypatch.setattr(RequestGrammar, "accept", accept)
    with pytest.raises(RequestsFailed) as info:
        llm.generate(prompts, params, use_tqdm=False)
    outputs = info.value.outputs
    failed = [i for i, o in enumerate(outputs) if o.outputs[0].finish_reason == "error"]
    assert failed and len(failed) < 5 and all("injected fault" in outputs[i].error for i in failed)
    if point == "grammar_accept":
        assert len(failed) == 1 and "processing an output token" in outputs[failed[0]].error
    for i, out in enumerate(outputs):
        tokens = out.outputs[0].token_ids
        assert tokens == (expected[i][:len(tokens)] if i in failed else expected[i]), f"request {i}"
    assert_pool_full(llm)
    monkeypatch.undo()
    again = llm.generate([prompts[i] for i in failed], [params[i] for i in failed], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [expected[i] for i in failed]
    assert_pool_full(llm)


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(llm):
    """Once the grammar has accepted its end, nothing may follow: the request stops there."""
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=30, ignore_eos=True,
                            structured_outputs={"regex": "ab(c|d)"})
    out = llm.generate(["x", "y"], [params, params], use_tqdm=False)
    for o in out:
        assert o.outputs[0].finish_reason == "stop" and re.fullmatch("ab(c|d)", o.outputs[0].text)
    assert_pool_full(llm)
