"""A runner fault ends only the requests it concerns; the engine loses nothing and serves on.

Two kinds of runner raise here, at every point where the engine calls one: prefill and
decode launch, the sampler (after the forward was queued), reading a step's tokens,
compression launch and compression collection.

- ``CheckingRunner`` (``tests/engine_double.py``), which checks every KV read and write:
  a fixed workload per point, then random workloads with a random fault.
- The real model runner on a tiny checkpoint, whose tokens come from the KV it reads: a
  failed step's prefix-cache entries, served to the next request with that prompt, would
  change its greedy tokens.

After each fault: the requests it concerns end with ``finish_reason == "error"`` and an
error naming the fault (offline, ``LLM.generate`` raises ``RequestsFailed`` naming them);
every other request produces the tokens it would have produced; the free pool returns to
full; and the failed requests, sent again, produce their reference tokens.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tests.conftest import assert_pool_full, make_llm
from tests.engine_double import FAULT_POINTS, InjectedFault
from tests.test_engine_properties import (PROPERTY_SETTINGS, Request, Workload, build_engine, check_done,
                                          check_state, reference, run, small_workload, step_checked,
                                          token_alphabet, workloads)
from zipage import CompressionConfig, RequestsFailed, SamplingParams

EXAMPLES = int(os.environ.get("ZIPAGE_PROPERTY_EXAMPLES", "0")) or 150


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("qwen3", with_weights=False)


def step_to_end(engine, runner, max_steps: int = 2000) -> dict:
    """Step until no request is left, checking the state after each step; the final outputs by id."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        finished, _ = step_checked(engine, runner)
        finals.update((o.request_id, o) for o in finished if o.finished)
        check_state(engine, runner)
    raise AssertionError(f"requests left after {max_steps} steps")


def check_after_fault(model_dir: str, workload: Workload, outputs, engine, runner, expected) -> set[str]:
    """The checks every fault test makes; returns the ids of the requests that failed."""
    failed = set()
    for r in workload.requests:
        tokens, text, reason, _ = outputs.result(r.rid)
        want = expected[r.rid]
        if reason == "error":
            failed.add(r.rid)
            error = outputs.final[r.rid].error
            assert "InjectedFault" in error and "failed" in error, f"request {r.rid}: error {error!r}"
            assert tokens == want[0][:len(tokens)], f"request {r.rid} (failed): {tokens} not a prefix of {want[0]}"
        elif reason == "abort":
            assert tokens == want[0][:len(tokens)], f"request {r.rid} (aborted): {tokens} not a prefix of {want[0]}"
        else:
            assert (tokens, text, reason) == want[:3], f"request {r.rid}: {(tokens, text, reason)} != {want[:3]}"
    check_done(engine, runner)
    # Sent again (same ids: tokens depend on the request and position), they give their reference;
    # but a sampled request without a seed of its own gets a new one from the engine.
    alphabet = token_alphabet(model_dir)
    again = [r for r in workload.requests if r.rid in failed
             and (r.params.get("temperature", 0.0) == 0.0 or r.params.get("seed") is not None)]
    for r in again:
        engine.add_request(r.prompt, r.sampling_params(alphabet), request_id=r.rid)
    finals = step_to_end(engine, runner)
    for r in again:
        out = finals[r.rid].outputs[0]
        assert (out.token_ids, out.text, out.finish_reason) == expected[r.rid][:3], f"request {r.rid} sent again"
    check_done(engine, runner)
    return failed


# -- one workload per point ----------------------------------------------------------------------
def _two_requests(point: str) -> Workload:
    """``a`` has a long prompt sharing its first block with ``b``; with compression both compress."""
    compress = point.startswith("compression")
    compression = dict(kv_budget_tokens=8, window=2, asynchronous=True) if compress else None
    shared = [3, 4, 5, 6]
    return small_workload(compression, delays=[1], num_blocks=24, requests=[
        Request("a", shared + list(range(20, 29)), dict(max_tokens=14, ignore_eos=True)),
        Request("b", shared + [7, 8], dict(max_tokens=14, ignore_eos=True)),
        Request("c", [9, 10, 11], dict(max_tokens=6, ignore_eos=True), arrival=3)])


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("point", FAULT_POINTS)
def test_a_fault_at_each_point_ends_only_its_requests(model_dir, point, async_scheduling):
    workload = _two_requests(point)
    workload.async_scheduling = async_scheduling
    expected = reference(model_dir, workload)
    at = 1 if point == "sampler" else 0  # the sampler's first call is the prefill's; its second a decode's
    outputs, engine, runner = run(model_dir, workload, async_scheduling=async_scheduling,
                                  num_blocks=workload.num_blocks, fault=(point, at))
    assert runner.fired == [(point, at)]
    failed = check_after_fault(model_dir, workload, outputs, engine, runner, expected)
    assert failed, f"the fault at {point} ended no request"
    assert "c" not in failed or point in ("prefill_launch", "collect", "sampler")
    assert engine.stats.num_failed_requests == len(failed)


def test_a_failed_launch_reads_the_step_in_flight_for_the_requests_it_preempted(model_dir):
    """The failed step's schedule preempted B, whose token of the step in flight was not read yet:
    the engine reads it before B is readmitted (a prefill needs every token on the host), so B
    carries on untouched."""
    alphabet = token_alphabet(model_dir)
    workload = small_workload(prefix_caching=False, num_blocks=3, async_scheduling=True, requests=[
        Request("A", [3, 4, 5, 6], dict(max_tokens=8, ignore_eos=True)),
        Request("B", [7, 8, 9, 10], dict(max_tokens=8, ignore_eos=True))])
    expected = reference(model_dir, workload)
    engine, runner = build_engine(model_dir, workload, True, 3)
    for r in workload.requests:
        engine.add_request(r.prompt, r.sampling_params(alphabet), request_id=r.rid)
    runner.inject("decode_launch", at=0)
    finals = step_to_end(engine, runner)
    assert finals["A"].outputs[0].finish_reason == "error"
    assert engine.scheduler.num_preemptions >= 1
    assert finals["B"].outputs[0].token_ids == expected["B"][0]
    check_done(engine, runner)


# -- random workloads, a random fault ------------------------------------------------------------
@settings(max_examples=EXAMPLES, **PROPERTY_SETTINGS)
@given(workload=workloads(), point=st.sampled_from(FAULT_POINTS), at=st.integers(0, 10))
def test_random_faults_end_only_their_requests(model_dir, workload, point, at):
    expected = reference(model_dir, workload)
    outputs, engine, runner = run(model_dir, workload, async_scheduling=workload.async_scheduling,
                                  num_blocks=workload.num_blocks, fault=(point, at))
    failed = check_after_fault(model_dir, workload, outputs, engine, runner, expected)
    event(f"fault {point}: " + ("fired" if runner.fired else "not reached"))
    if failed:
        event("requests failed")


# -- the real runner: tokens come from the KV they read ---------------------------------------------
BLOCK = 16
REAL_POINTS = {  # point: (runner attribute to wrap, which of its calls raises)
    "prefill_launch": ("launch", lambda args, kwargs: args[1]),
    "decode_launch": ("launch", lambda args, kwargs: not args[1]),
    "sampler": ("sample", lambda args, kwargs: True),  # of the runner's Sampler
    "collect": ("collect", lambda args, kwargs: True),
    "compression_launch": ("start_compression", lambda args, kwargs: True),
    "compression_collect": ("compression_done", lambda args, kwargs: True),
}


def _arm(obj, name: str, applies, at: int):
    """Make the ``at``-th call of ``obj.name`` for which ``applies(args, kwargs)`` raise, once."""
    real, seen, fired = getattr(obj, name), [0], []

    def wrapper(*args, **kwargs):
        if applies(args, kwargs) and not fired:
            seen[0] += 1
            if seen[0] - 1 == at:
                fired.append(name)
                raise InjectedFault(f"{name} call {at}")
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)
    return fired


def _prompts():
    import random
    rng = random.Random(5)
    shared = [rng.randrange(3, 384) for _ in range(2 * BLOCK)]
    return [shared + [rng.randrange(3, 384) for _ in range(n)] for n in (9, 3, 20)]


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("point", list(REAL_POINTS))
def test_real_runner_fault_leaves_no_block_and_no_poisoned_cache(checkpoint_dir, point, async_scheduling):
    model_dir = checkpoint_dir("qwen3")
    compression = CompressionConfig(max_blocks_per_seq=3, asynchronous=True)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts()

    def engine():
        return make_llm(model_dir, block_size=BLOCK, max_model_len=256, async_scheduling=async_scheduling,
                        compression=compression)

    expected = [o.outputs[0].token_ids for o in engine().generate(prompts, params, use_tqdm=False)]
    llm = engine()
    name, applies = REAL_POINTS[point]
    at = 1 if point == "sampler" else 0
    fired = _arm(llm.engine.runner.sampler if point == "sampler" else llm.engine.runner, name, applies, at)
    with pytest.raises(RequestsFailed) as info:
        llm.generate(prompts, params, use_tqdm=False)
    assert fired, f"the fault at {point} was not reached"
    outputs = info.value.outputs
    failed = [i for i, o in enumerate(outputs) if o.outputs[0].finish_reason == "error"]
    assert failed and all("InjectedFault" in outputs[i].error for i in failed)
    assert all(f"request {outputs[i].request_id}" in str(info.value) for i in failed[:3])
    for i, out in enumerate(outputs):
        tokens = out.outputs[0].token_ids
        assert tokens == (expected[i][:len(tokens)] if i in failed else expected[i]), f"prompt {i}"
    assert_pool_full(llm)
    # The failed prompts again (their prefill's cache entries were withdrawn if that step failed;
    # a compacted cache is never served): the tokens an untouched engine gives.
    again = llm.generate([prompts[i] for i in failed], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [expected[i] for i in failed]
    assert_pool_full(llm)


def test_a_lost_prefill_fails_the_requests_that_read_its_blocks_in_the_next_step(model_dir):
    """A's prefill is in flight when B (sharing A's first block) and C are admitted; reading A's
    tokens then fails: A's KV is in doubt, so B, which read it, ends too, and C carries on."""
    alphabet = token_alphabet(model_dir)
    shared = [3, 4, 5, 6]
    workload = small_workload(async_scheduling=True, requests=[
        Request("A", shared + [11, 12], dict(max_tokens=6, ignore_eos=True)),
        Request("B", shared + [13, 14], dict(max_tokens=6, ignore_eos=True)),
        Request("C", [15, 16, 17], dict(max_tokens=6, ignore_eos=True))])
    expected = reference(model_dir, workload)
    engine, runner = build_engine(model_dir, workload, True, workload.num_blocks)
    a, b, c = workload.requests
    engine.add_request(a.prompt, a.sampling_params(alphabet), request_id="A")
    step_checked(engine, runner)  # A's prefill, in flight
    for r in (b, c):
        engine.add_request(r.prompt, r.sampling_params(alphabet), request_id=r.rid)
    runner.inject("collect", at=0)
    finals = step_to_end(engine, runner)
    assert engine.block_manager.prefix_hit_tokens >= 4  # B was served A's first block
    assert [finals[r].outputs[0].finish_reason for r in "ABC"] == ["error", "error", "length"]
    assert finals["C"].outputs[0].token_ids == expected["C"][0]
    check_done(engine, runner)


def test_a_request_whose_compaction_fails_while_it_ends_gets_one_final_output(model_dir):
    """Aborting a request waits for its compaction in flight; when that wait raises, the request
    ends once, with the error (the abort returns nothing more)."""
    wl = small_workload(dict(kv_budget_tokens=4, window=2, asynchronous=True), async_scheduling=False,
                        delays=[5], requests=[Request("a", list(range(3, 12)), dict(max_tokens=6, ignore_eos=True)),
                                              Request("b", [3, 4], dict(max_tokens=8, ignore_eos=True))])
    engine, runner = build_engine(model_dir, wl, False, wl.num_blocks)
    for r in wl.requests:
        engine.add_request(r.prompt, r.sampling_params(token_alphabet(model_dir)), request_id=r.rid)
    outputs = []
    while runner.in_flight is None:
        outputs += step_checked(engine, runner)[0]
    runner.inject("compression_collect", at=runner.calls["compression_collect"])
    assert engine.abort_request("a") is None
    while engine.has_unfinished_requests():
        outputs += step_checked(engine, runner)[0]
    ends = {rid: [o.outputs[0].finish_reason for o in outputs if o.request_id == rid and o.finished]
            for rid in "ab"}
    assert ends == {"a": ["error"], "b": ["length"]}
    check_done(engine, runner)
