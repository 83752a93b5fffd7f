"""Property tests of the real ``LLMEngine`` loop, driven through ``CheckingRunner`` (no model).

Each example builds an engine on a tiny checkpoint (its config and tokenizer; no weights)
with a small cache, and mixes asynchronous scheduling or not, compression or not
(small budget and blocks, asynchronous or not, hybrid or not, few query slots), prefix
sharing, stop strings, stop token ids, EOS, ``ignore_eos``, ``min_tokens``, streaming,
arrivals and aborts at random steps. ``CheckingRunner`` checks every KV read and write
(see ``tests/engine_double.py``); after every step the test checks the block accounting,
the prefix cache and the query slots; at the end, that every request ended exactly once
and produced what a synchronous reference run with an ample cache and no aborts produced.

``ZIPAGE_PROPERTY_EXAMPLES=N`` runs N examples per property test instead of the default.
"""

from __future__ import annotations

import dataclasses

import os
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from tests.engine_double import CheckingRunner, token_alphabet
from zipage.config import CompressionConfig, EngineConfig
from zipage.engine.block_manager import chain_hash
from zipage.engine.llm_engine import LLMEngine
from zipage.engine.sequence import SequenceStatus
from zipage.sampling_params import SamplingParams

EXAMPLES = int(os.environ.get("ZIPAGE_PROPERTY_EXAMPLES", "0")) or 200
PROPERTY_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

STOP_STRINGS = ["ab", "ba", " a.", "c.", "\u00e9", "b\n", "aaa", "b b"]
STOP_PIECES = ["c", ".", "\n", "\xa9", "<eos>"]  # pieces whose token ids may be stop_token_ids


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("qwen3", with_weights=False)


# -- the one place that knows where the engine keeps its in-flight compression --------------------
def in_flight_compressions(engine) -> list:
    """The ``CompressionTask``s of the asynchronous compression batch in flight (empty if none):
    their requests are being compressed, and their ``pending_release`` blocks are still referenced."""
    compressions = engine.compressions  # compression/lifecycle.py; None without compression
    return compressions.in_flight if compressions is not None else []


# -- workloads ---------------------------------------------------------------------------------
@dataclass
class Request:
    rid: str
    prompt: list[int]
    params: dict  # SamplingParams fields; "stop_token_ids" as pieces (see STOP_PIECES)
    stream: bool = False
    arrival: int = 0  # the loop step before which it is added
    abort_at: int | None = None  # the loop step before which it is aborted

    def sampling_params(self, alphabet: dict[str, int]) -> SamplingParams:
        params = dict(self.params)
        params.setdefault("temperature", 0.0)
        params["stop_token_ids"] = [alphabet[p] for p in params.get("stop_token_ids", [])]
        return SamplingParams(**params)


@dataclass
class Workload:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    prefix_caching: bool
    async_scheduling: bool
    compression: dict | None  # CompressionConfig fields
    query_slots: int
    delays: list[int]  # polls an asynchronous compaction batch stays in flight
    max_num_batched_tokens_extra: int
    requests: list[Request] = field(default_factory=list)
    chunk: int | None = None  # chunked prefill with this token budget per step; None: whole prompts
    prefill_compression: str = "long"  # CompressionConfig's, with chunks

    @property
    def max_model_len(self) -> int:
        longest = max(2, max(len(r.prompt) + r.params["max_tokens"] for r in self.requests))
        if self.compression is None:
            return longest
        # EngineConfig rejects a context too short for any compression (budget, working block, one more)
        return max(longest, self.compression["kv_budget_tokens"] + self.block_size + 2)

    def ample_blocks(self) -> int:
        """A cache that holds every request at full length at once."""
        bs = self.block_size
        return sum(-(-(len(r.prompt) + r.params["max_tokens"]) // bs) for r in self.requests) + 2


def _blocks(n: int, bs: int) -> int:
    return -(-n // bs)


@st.composite
def requests(draw, i: int, prefixes, bs: int, long_prompt: int, tight: bool) -> Request:
    """One request; ``tight``: long and rarely stopped early, arriving together (cache pressure).
    Its prompt shares a prefix with others, is short, or is long (at least ``long_prompt``
    tokens: with compression, compressed at its first decode)."""
    tok = st.integers(3, 383)
    kind = draw(st.sampled_from(["shared", "shared", "short", "long"]))
    if kind == "shared":
        base = draw(st.sampled_from(prefixes))
        cut = draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        prompt = base[:cut] + draw(st.lists(tok, max_size=bs))
    elif kind == "long":
        prompt = draw(st.lists(tok, min_size=long_prompt, max_size=long_prompt + 2 * bs))
    else:
        prompt = draw(st.lists(tok, max_size=bs))
    if not prompt:
        prompt = [draw(tok)]
    max_tokens = draw(st.integers(12, 40) if tight else st.one_of(st.integers(1, 12), st.integers(1, 40)))
    sampled = draw(st.integers(0, 3)) == 0
    stops = st.just([]) if tight else st.one_of(st.just([]), st.lists(st.sampled_from(STOP_STRINGS), max_size=2))
    stop_ids = st.just([]) if tight else st.one_of(st.just([]), st.lists(st.sampled_from(STOP_PIECES), max_size=2))
    params = dict(
        max_tokens=max_tokens,
        min_tokens=draw(st.one_of(st.just(0), st.integers(0, min(max_tokens, 6)))),
        ignore_eos=draw(st.booleans() if tight else st.integers(0, 3).map(lambda n: n == 0)),
        stop=draw(st.one_of(stops, st.lists(st.sampled_from(STOP_STRINGS), max_size=1))),
        stop_token_ids=draw(st.one_of(stop_ids, st.lists(st.sampled_from(STOP_PIECES), max_size=1))),
        include_stop_str_in_output=draw(st.booleans()),
        skip_special_tokens=draw(st.integers(0, 4)) != 0,
        temperature=0.8 if sampled else 0.0,
        seed=draw(st.one_of(st.none(), st.integers(0, 1000))) if sampled else None,
    )
    if draw(st.integers(0, 5)) == 0:  # penalties: token counts kept by the runner, rebuilt after preemption
        params.update(draw(st.sampled_from([dict(repetition_penalty=1.3), dict(presence_penalty=0.7),
                                            dict(frequency_penalty=0.4, presence_penalty=-0.2)])))
    return Request(
        rid=f"r{i}", prompt=prompt, params=params, stream=draw(st.booleans()),
        arrival=draw(st.integers(0, 3) if tight else st.one_of(st.just(0), st.integers(0, 4), st.integers(0, 15))),
        abort_at=draw(st.one_of(st.none(), st.none(), st.integers(0, 40))))


@st.composite
def workloads(draw, compress: bool | None = None) -> Workload:
    """A random workload; ``compress``: with compression (True), without (False), either (None)."""
    bs = draw(st.sampled_from([4, 8]))
    tight = draw(st.booleans())
    max_num_seqs = draw(st.integers(3, 5) if tight else st.integers(1, 5))
    compression, M, N = None, 0, 0
    if compress if compress is not None else draw(st.booleans()):
        N = draw(st.integers(2, 4 if bs == 4 else 3))
        compression = dict(kv_budget_tokens=(N - 1) * bs, window=draw(st.integers(2, min(4, bs))),
                           asynchronous=draw(st.booleans()), hybrid=draw(st.booleans()),
                           max_blocks_per_compression=draw(st.sampled_from([N, 2 * N, 600])))
        M = draw(st.integers(1, min(3, max_num_seqs)))
    prefixes = [draw(st.lists(st.integers(3, 383), min_size=1, max_size=3 * bs)) for _ in range(2)]
    count = st.integers(4, 7) if tight else st.one_of(st.integers(1, 3), st.integers(3, 7))
    long_prompt = N * bs if compression is not None else bs
    reqs = [draw(requests(i, prefixes, bs, long_prompt, tight)) for i in range(draw(count))]
    if compression is not None:  # mixed budgets: the engine's, a smaller one of its own, or full KV
        for r in reqs:
            r.params.update(draw(st.sampled_from(
                [{}, {}, {}, dict(compression=False)] + [dict(kv_budget_tokens=k * bs) for k in range(1, N)])))
    prompt_blocks = max(_blocks(len(r.prompt), bs) for r in reqs)
    full_kv = [r for r in reqs if compression is None or r.params.get("compression") is False]
    if compression is None:  # every request must fit the cache at full length
        low = _blocks(max(len(r.prompt) + r.params["max_tokens"] for r in reqs), bs)
    else:  # a prompt must fit with a block to spare; M requests at full budget fit (as the model
        # runner sizes M), or, overcommitted, do not (slot holders then compete for blocks too)
        low = max(N + 1, prompt_blocks + 1, 0 if draw(st.booleans()) else M * N,
                  *(_blocks(len(r.prompt) + r.params["max_tokens"], bs) for r in full_kv))  # a full-KV one alone
    num_blocks = low + draw(st.integers(0, 2) if tight else st.one_of(st.just(0), st.integers(0, 12)))
    return Workload(block_size=bs, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                    prefix_caching=draw(st.integers(0, 3)) != 0, async_scheduling=draw(st.booleans()),
                    compression=compression, query_slots=M,
                    delays=draw(st.lists(st.integers(0, 3), min_size=1, max_size=3)),
                    max_num_batched_tokens_extra=draw(st.integers(0, 40)), requests=reqs,
                    chunk=draw(st.one_of(st.none(), st.integers(1, 3 * bs), st.integers(1, 40))),
                    prefill_compression=draw(st.sampled_from(["long", "always", "off"])))


# -- driving the engine --------------------------------------------------------------------------
class Outputs:
    """Every output the engine returned, checked as it comes: one final output per request,
    nothing after it, partial outputs only for streamed requests."""

    def __init__(self, workload: Workload, allow_errors: bool = False):
        self.allow_errors = allow_errors  # requests may end with finish_reason "error" (a fault test)
        self.streamed = {r.rid: r.stream for r in workload.requests}
        self.prompts = {r.rid: r.prompt for r in workload.requests}
        self.parts: dict[str, list] = {}
        self.final: dict[str, object] = {}

    def take(self, outputs) -> None:
        for out in outputs:
            rid = out.request_id
            if not self.allow_errors:
                assert out.outputs[0].finish_reason != "error", f"request {rid} failed: {out.error}"
            assert rid not in self.final, f"request {rid}: an output after its final one ({out})"
            if not out.finished:
                assert self.streamed[rid], f"request {rid} is not streamed but got a partial output"
            self.parts.setdefault(rid, []).append(out)
            if out.finished:
                self.final[rid] = out

    def result(self, rid: str) -> tuple:
        """(token ids, text, finish reason, stop reason): the stream's parts joined."""
        parts = self.parts[rid]
        prompt_ids = [t for p in parts for t in p.prompt_token_ids]
        assert prompt_ids == self.prompts[rid], f"request {rid}: its outputs give prompt ids {prompt_ids}"
        final = self.final[rid].outputs[0]
        return ([t for p in parts for t in p.outputs[0].token_ids], "".join(p.outputs[0].text for p in parts),
                final.finish_reason, final.stop_reason)


def build_engine(model_dir: str, workload: Workload, async_scheduling: bool, num_blocks: int):
    config = EngineConfig.from_kwargs(
        model_dir, device="cpu", seed=0, block_size=workload.block_size, max_model_len=workload.max_model_len,
        max_num_seqs=workload.max_num_seqs, enable_prefix_caching=workload.prefix_caching,
        max_num_batched_tokens=(workload.chunk if workload.chunk is not None
                                else workload.max_model_len + workload.max_num_batched_tokens_extra),
        enable_chunked_prefill=workload.chunk is not None, async_scheduling=async_scheduling,
        compression=(CompressionConfig(**workload.compression, prefill_compression=workload.prefill_compression
                                       if workload.chunk is not None else "long") if workload.compression else None))
    runner = CheckingRunner(config, num_blocks, workload.query_slots, compression_delays=workload.delays)
    engine = LLMEngine(config, runner=runner)
    runner.attach(engine.block_manager)
    return engine, runner


def step_checked(engine, runner):
    """``engine.step()``, failing on any check the runner failed during it (the engine may have
    caught the ``AssertionError`` and ended requests with an error instead)."""
    try:
        result = engine.step()
    finally:
        runner.check_violations()
    return result


def check_state(engine, runner) -> None:
    """Between steps: blocks, prefix cache, caches of the running requests, query slots."""
    bm, sched = engine.block_manager, engine.scheduler
    compressing = in_flight_compressions(engine)
    holders = Counter()
    for seq in sched.running:
        table = list(seq.block_table)
        assert seq.status is SequenceStatus.RUNNING, f"{seq} in the running list"
        assert len(set(table)) == len(table), f"request {seq.request_id} holds a block twice: {table}"
        holders.update(table)
        runner.check_cache(seq)
        if seq.compress_prefill and seq.prefilling:  # at most N blocks plus one chunk, and a slot
            chunk_blocks = -(-engine.config.scheduler.max_num_batched_tokens // bm.block_size)
            hit_blocks = seq.num_prefix_hit_tokens // bm.block_size  # shared blocks served by the prefix cache
            assert len(table) <= max(seq.max_blocks + chunk_blocks, hit_blocks + chunk_blocks + 1), \
                f"request {seq.request_id} holds {len(table)} blocks while its prompt is compressed between chunks"
            assert seq.query_slot is not None, f"request {seq.request_id} compresses its prompt without a slot"
    for task in compressing:
        assert task.seq in sched.running, f"request {task.seq.request_id} is compressed but not running"
        holders.update(task.pending_release)
    wrong = {b: (bm.ref_counts[b], holders[b]) for b in range(bm.num_blocks) if bm.ref_counts[b] != holders[b]}
    assert not wrong, f"block: (ref count, references held by block tables and the compaction in flight): {wrong}"
    assert set(bm.free_blocks) == {b for b in range(bm.num_blocks) if holders[b] == 0}, \
        f"free pool {sorted(bm.free_blocks)} is not the unreferenced blocks"
    runner.check_prefix_cache(bm)
    for seq in sched.waiting:
        assert len(seq.block_table) == 0 and seq.query_slot is None and seq.kv_len == 0, f"waiting {seq}"
    held = [s.query_slot for s in sched.running if s.query_slot is not None]
    assert len(set(held)) == len(held), f"two requests hold one query slot: {held}"
    assert sorted(held + sched.free_query_slots) == list(range(runner.num_query_slots)), \
        f"query slots leaked: held {held}, free {sched.free_query_slots}"


def check_done(engine, runner) -> None:
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert not in_flight_compressions(engine), "a compaction is still in flight"
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks not returned"
    assert bm.ref_counts == [0] * bm.num_blocks, f"ref counts left: {bm.ref_counts}"
    assert sorted(engine.scheduler.free_query_slots) == list(range(runner.num_query_slots))
    # The runner was told of every request that ended (its per-request state, penalty rows, goes).
    forgotten = {rid for call in runner.forgotten for rid in call}
    assert not set(runner.seen) - forgotten, f"requests never forgotten: {set(runner.seen) - forgotten}"
    assert not runner.penalties.rows, f"penalty rows still held: {runner.penalties.rows}"


def run(model_dir: str, workload: Workload, *, async_scheduling: bool, num_blocks: int, aborts: bool = True,
        streams: bool = True, check: bool = True, fault: tuple[str, int] | None = None):
    """Drive the engine through the workload; return (outputs, engine, runner).
    ``fault``: ``(point, call)`` armed with ``CheckingRunner.inject``; requests may then fail."""
    engine, runner = build_engine(model_dir, workload, async_scheduling, num_blocks)
    if fault is not None:
        runner.inject(*fault)
    alphabet = token_alphabet(model_dir)
    outputs = Outputs(workload, allow_errors=fault is not None)
    if not streams:
        outputs.streamed = dict.fromkeys(outputs.streamed, False)
    arrivals = sorted(workload.requests, key=lambda r: r.arrival)
    added = set()
    total = sum(len(r.prompt) + r.params["max_tokens"] for r in workload.requests)
    limit = 20 * total + max(r.arrival for r in workload.requests) + 50
    step = 0
    while True:
        while arrivals and arrivals[0].arrival <= step:
            r = arrivals.pop(0)
            engine.add_request(r.prompt, r.sampling_params(alphabet), request_id=r.rid,
                               stream=r.stream and streams)
            added.add(r.rid)
        for r in workload.requests:
            if aborts and r.abort_at == step and r.rid in added:
                final = engine.abort_request(r.rid)
                outputs.take([final] if final is not None else [])
        if not engine.has_unfinished_requests() and not arrivals:
            break
        assert step < limit, f"no end after {step} steps"
        if engine.has_unfinished_requests():
            finished, _ = step_checked(engine, runner)
            outputs.take(finished)
            if check:
                check_state(engine, runner)
        step += 1
    if check:
        check_done(engine, runner)
    missing = [r.rid for r in workload.requests if r.rid not in outputs.final]
    assert not missing, f"requests without a final output: {missing}"
    return outputs, engine, runner


def reference(model_dir: str, workload: Workload) -> dict[str, tuple]:
    """The synchronous engine with a cache for everything, whole-prompt prefills, no aborts and
    no streaming."""
    workload = dataclasses.replace(workload, chunk=None)
    outputs, _, _ = run(model_dir, workload, async_scheduling=False, num_blocks=workload.ample_blocks(),
                        aborts=False, streams=False, check=False)
    return {r.rid: outputs.result(r.rid) for r in workload.requests}


def compare(workload: Workload, outputs: Outputs, expected: dict[str, tuple]) -> None:
    for r in workload.requests:
        got, want = outputs.result(r.rid), expected[r.rid]
        if got[2] == "abort":
            assert r.abort_at is not None, f"request {r.rid} aborted without an abort"
            assert got[0] == want[0][:len(got[0])], \
                f"request {r.rid} (aborted): tokens {got[0]} are not a prefix of {want[0]}"
            # Up to the stop string that ended the reference (the aborted request had not completed it).
            uncut = want[1] + want[3] if isinstance(want[3], str) and not r.params.get("include_stop_str_in_output") \
                else want[1]
            assert uncut.startswith(got[1].rstrip("\ufffd")), \
                f"request {r.rid} (aborted): text {got[1]!r} is not a prefix of {uncut!r}"
        else:
            assert got == want, f"request {r.rid}: {got} != reference {want}"


# -- the property test ---------------------------------------------------------------------------
@settings(max_examples=EXAMPLES, **PROPERTY_SETTINGS)
@given(workload=workloads())
def test_engine_loop_keeps_its_invariants_and_matches_the_synchronous_engine(model_dir, workload):
    expected = reference(model_dir, workload)
    outputs, engine, runner = run(model_dir, workload, async_scheduling=workload.async_scheduling,
                                  num_blocks=workload.num_blocks)
    compare(workload, outputs, expected)
    record_events(workload, outputs, engine, runner)


@st.composite
def prefill_compression_workloads(draw) -> Workload:
    """Compressed workloads in small chunks whose compressing requests often have prompts longer
    than N blocks: compressed between their chunks ("always"), or when the cache cannot hold
    them whole ("long")."""
    wl = draw(workloads(compress=True))
    bs, n = wl.block_size, wl.compression["kv_budget_tokens"] // wl.block_size + 1
    for r in wl.requests:
        if r.params.get("compression") is not False and draw(st.booleans()):
            extra = draw(st.integers(n * bs - len(r.prompt), (n + 3) * bs))
            r.prompt = r.prompt + draw(st.lists(st.integers(3, 383), min_size=max(0, extra), max_size=max(0, extra)))
    return dataclasses.replace(wl, chunk=draw(st.integers(1, 2 * bs)),
                               prefill_compression=draw(st.sampled_from(["always", "long"])))


@settings(max_examples=max(EXAMPLES // 2, 1), **PROPERTY_SETTINGS)
@given(workload=prefill_compression_workloads())
def test_prompts_compressed_between_chunks_keep_the_invariants(model_dir, workload):
    """As above, with prompts compressed between their chunks: each chunk caches its KV behind
    the kept tokens, a compaction reads the chunk's window, and a request holds at most N blocks
    plus one chunk while it is prefilled."""
    expected = reference(model_dir, workload)
    outputs, engine, runner = run(model_dir, workload, async_scheduling=workload.async_scheduling,
                                  num_blocks=workload.num_blocks)
    compare(workload, outputs, expected)
    record_events(workload, outputs, engine, runner)


def record_events(workload: Workload, outputs: Outputs, engine, runner) -> None:
    """What an example exercised (``--hypothesis-show-statistics``)."""
    event("asynchronous scheduling" if workload.async_scheduling else "synchronous scheduling")
    if workload.chunk is not None:
        event("chunked prefill")
        if any(len(r.prompt) > workload.chunk for r in workload.requests):
            event("a prompt in several chunks")
    if runner.prefill_compactions:
        event("compressed between prompt chunks")
    if engine.scheduler.num_preemptions:
        event("preempted")
    if any(incarnation for _, incarnation, _ in runner.pooled):
        event("compressed after a preemption")
    if sum(runner.compactions.values()):
        event("compressed " + ("asynchronously" if workload.compression["asynchronous"] else "synchronously"))
    if engine.block_manager.prefix_hit_tokens:
        event("prefix cache hit")
    for r in workload.requests:
        _, _, reason, stop = outputs.result(r.rid)
        event(f"finish: {reason}" + (" (stop string)" if isinstance(stop, str) else
                                     " (stop token)" if isinstance(stop, int) else ""))


# -- the double itself -----------------------------------------------------------------------------
def small_workload(compression: dict | None = None, **overrides) -> Workload:
    wl = Workload(block_size=4, num_blocks=16, max_num_seqs=4, prefix_caching=True, async_scheduling=True,
                  compression=compression, query_slots=2 if compression else 0, delays=[1],
                  max_num_batched_tokens_extra=0)
    for name, value in overrides.items():
        setattr(wl, name, value)
    return wl


def test_tokens_depend_on_request_and_position_only(model_dir):
    prompt = [5, 6, 7, 8, 9, 10]
    wl = small_workload(requests=[Request("a", prompt, dict(max_tokens=20, ignore_eos=True)),
                                  Request("b", prompt[:3], dict(max_tokens=20, ignore_eos=True, temperature=0.8,
                                                                seed=3)),
                                  Request("c", prompt, dict(max_tokens=20, ignore_eos=True), arrival=5)])
    alone = {}
    for r in wl.requests:
        outputs, _, _ = run(model_dir, small_workload(requests=[Request(r.rid, r.prompt, r.params)]),
                            async_scheduling=False, num_blocks=16)
        alone[r.rid] = outputs.result(r.rid)
    together, _, runner = run(model_dir, wl, async_scheduling=True, num_blocks=8)  # preempts
    assert {r.rid: together.result(r.rid) for r in wl.requests} == alone
    assert len(set(alone["a"][0])) > 3  # the tokens vary


def test_stops_happen(model_dir):
    """The token function produces EOS, stop tokens and stop strings often enough to matter."""
    alphabet = token_alphabet(model_dir)
    reqs = [Request(f"e{i}", [7, 8, i + 3], dict(max_tokens=40)) for i in range(6)]
    reqs += [Request(f"s{i}", [9, i + 3], dict(max_tokens=40, stop=["ab"], ignore_eos=True)) for i in range(6)]
    reqs += [Request(f"t{i}", [i + 3], dict(max_tokens=40, stop_token_ids=["c"], ignore_eos=True, min_tokens=5))
             for i in range(6)]
    wl = small_workload(requests=reqs, num_blocks=64, max_num_seqs=8)
    outputs, _, _ = run(model_dir, wl, async_scheduling=True, num_blocks=64)
    results = {r.rid: outputs.result(r.rid) for r in reqs}
    assert sum(results[f"e{i}"][2] == "stop" for i in range(6)) >= 2
    assert sum(results[f"s{i}"][3] == "ab" for i in range(6)) >= 2
    stopped = [results[f"t{i}"] for i in range(6) if results[f"t{i}"][3] == alphabet["c"]]
    assert len(stopped) >= 2 and all(len(tokens) > 5 for tokens, *_ in stopped)  # min_tokens held


def _engine_for(model_dir, wl, num_blocks=None):
    engine, runner = build_engine(model_dir, wl, wl.async_scheduling, num_blocks or wl.num_blocks)
    alphabet = token_alphabet(model_dir)
    for r in wl.requests:
        engine.add_request(r.prompt, r.sampling_params(alphabet), request_id=r.rid, stream=r.stream)
    return engine, runner


def _run_to_end(engine, runner, max_steps=500):
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        step_checked(engine, runner)
    raise AssertionError("no end")


def test_double_catches_a_poisoned_prefix_cache(model_dir):
    prompt = list(range(3, 15))  # three full blocks
    wl = small_workload(requests=[Request("a", prompt, dict(max_tokens=2, ignore_eos=True))], async_scheduling=False)
    engine, runner = _engine_for(model_dir, wl)
    _run_to_end(engine, runner)
    bm = engine.block_manager
    # Swap the prefix-cache entries of the first two blocks: a hit now serves the wrong KV.
    (h0, b0), (h1, b1) = list(bm.hash_to_block.items())[:2]
    bm.hash_to_block[h0], bm.hash_to_block[h1] = b1, b0
    bm.block_hash[b0], bm.block_hash[b1] = h1, h0
    engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), request_id="victim")
    with pytest.raises(AssertionError, match=rf"request victim \(prefill\) reads block {b1} at cache index 0"):
        step_checked(engine, runner)


def test_double_catches_a_compacted_block_served_as_a_prefix(model_dir):
    prompt = list(range(3, 12))  # 9 tokens, N = 2 blocks of 4: compressed at its first decode
    wl = small_workload(dict(kv_budget_tokens=4, window=2, asynchronous=False), async_scheduling=False,
                        requests=[Request("a", prompt, dict(max_tokens=6, ignore_eos=True))])
    engine, runner = _engine_for(model_dir, wl)
    seq = engine._requests["a"]
    while not seq.metrics.num_compressions:
        step_checked(engine, runner)
    bm = engine.block_manager
    first = seq.block_table[0]  # compacted in place: it no longer holds the prompt's first block
    bm.hash_to_block[seq.block_hashes[0]] = first  # a bug that keeps it registered
    bm.block_hash[first] = seq.block_hashes[0]
    with pytest.raises(AssertionError, match=rf"registered block {first} holds \('kept', 'a'"):
        runner.check_prefix_cache(bm)
    engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), request_id="b")
    with pytest.raises(AssertionError, match=rf"request b \(prefill\) reads block {first} at cache index 0"):
        step_checked(engine, runner)


def _a_compaction_in_flight(model_dir):
    """``a`` being compacted (for 5 more polls) while ``b`` decodes; (engine, runner)."""
    prompt = list(range(3, 12))
    wl = small_workload(dict(kv_budget_tokens=4, window=2, asynchronous=True), async_scheduling=False,
                        delays=[5], requests=[Request("a", prompt, dict(max_tokens=6, ignore_eos=True)),
                                              Request("b", [3, 4], dict(max_tokens=20, ignore_eos=True))])
    engine, runner = _engine_for(model_dir, wl)
    while runner.in_flight is None:
        step_checked(engine, runner)
    return engine, runner


def test_double_catches_a_write_into_an_in_flight_compaction(model_dir):
    engine, runner = _a_compaction_in_flight(model_dir)
    a, b = engine._requests["a"], engine._requests["b"]
    task = runner.in_flight.tasks[0]
    assert task.seq is a and b.status is SequenceStatus.RUNNING
    # A bug that hands b, for the block its next token goes to, a block the compaction still reads.
    assert b.kv_len < 4
    b.block_table.replace([task.source_blocks[-1]])
    with pytest.raises(AssertionError, match=rf"request b writes block {task.source_blocks[-1]} .* while the "
                                             r"compaction of \['a'\] reads or writes it"):
        step_checked(engine, runner)


def test_double_catches_a_freed_source_of_an_in_flight_compaction(model_dir):
    engine, runner = _a_compaction_in_flight(model_dir)
    (task,) = in_flight_compressions(engine)
    engine.block_manager.release(task.pending_release)  # released early, as a bug would
    with pytest.raises(AssertionError, match=rf"block {task.pending_release[0]}, read by the in-flight "
                                             r"compaction of a, was freed"):
        step_checked(engine, runner)


def test_double_catches_a_wrong_pending_input(model_dir):
    wl = small_workload(requests=[Request("a", [3, 4, 5], dict(max_tokens=8, ignore_eos=True))])
    engine, runner = _engine_for(model_dir, wl)
    step_checked(engine, runner)  # prefill, in flight
    engine._launched = None  # a bug that forgets the step in flight: its token is then unknown
    with pytest.raises(AssertionError, match=r"request a: its input token \(position 3\) is pending"):
        step_checked(engine, runner)


def test_double_catches_a_preempted_request_in_the_step(model_dir):
    wl = small_workload(requests=[Request("a", [3, 4, 5], dict(max_tokens=8, ignore_eos=True)),
                                  Request("b", [6, 7], dict(max_tokens=8, ignore_eos=True))])
    engine, runner = _engine_for(model_dir, wl)
    step_checked(engine, runner)  # the prefill
    schedule = engine.scheduler.schedule

    def schedule_with_a_placed_victim():  # a bug: preempts a request already placed in the step
        batch = schedule()
        engine.scheduler.preempt(batch.seqs[0])
        return batch

    engine.scheduler.schedule = schedule_with_a_placed_victim
    with pytest.raises(AssertionError, match=r"request a launched while waiting"):
        step_checked(engine, runner)


def test_double_catches_kv_a_failed_step_lost_in_the_prefix_cache(model_dir):
    wl = small_workload(requests=[Request("a", [3, 4, 5], dict(max_tokens=8, ignore_eos=True))])
    engine, runner = _engine_for(model_dir, wl)
    step_checked(engine, runner)  # the prefill of positions 0-2, in flight
    step_checked(engine, runner)  # the decode of position 3, which fills block 0, in flight
    a, bm = engine._requests["a"], engine.block_manager
    # A bug: caches block 0 before the step that writes its last KV is read back.
    h, block = chain_hash(None, a.token_ids[:4]), a.block_table[0]
    bm.hash_to_block[h], bm.block_hash[block] = block, h
    runner.inject("collect", at=runner.calls["collect"])  # and that step fails
    step_checked(engine, runner)  # the engine ends "a" with an error; the bug's entry stays
    with pytest.raises(AssertionError, match=r"registered block \d+ holds \('lost', 'a'"):
        runner.check_prefix_cache(bm)


# -- fault injection (what the engine does after a fault: tests/test_engine_faults.py) ----------------
def test_inject_fires_once_at_the_armed_call(model_dir):
    wl = small_workload(requests=[Request("a", [3, 4, 5], dict(max_tokens=8, ignore_eos=True))],
                        async_scheduling=False)
    engine, runner = _engine_for(model_dir, wl)
    runner.inject("decode_launch", at=2)
    for _ in range(3):  # the prefill, decodes 0 and 1
        step_checked(engine, runner)
    assert runner.fired == []
    outputs, _ = step_checked(engine, runner)  # decode 2: the engine ends the request it concerns
    assert runner.fired == [("decode_launch", 2)] and runner.calls["decode_launch"] == 3
    assert [o.outputs[0].finish_reason for o in outputs] == ["error"] and "InjectedFault" in outputs[0].error


# -- bookkeeping of the compressions that ran -------------------------------------------------------
def compressed_preempted_compressed(asynchronous: bool) -> Workload:
    """r2's long prompt is compressed at its first decode; r0 and r1 then need blocks and r2, the
    newest, is preempted; readmitted, it is compressed again: its first compression since then
    must be max-pooled, and its counters must count the compressions that ran."""
    reqs = [Request("r0", [3], dict(max_tokens=30, ignore_eos=True)),
            Request("r1", [4], dict(max_tokens=30, ignore_eos=True)),
            Request("r2", [5] * 12, dict(max_tokens=30, ignore_eos=True))]
    return Workload(block_size=4, num_blocks=5, max_num_seqs=3, prefix_caching=True, async_scheduling=True,
                    compression=dict(kv_budget_tokens=8, window=2, asynchronous=asynchronous, hybrid=False),
                    query_slots=3, delays=[1], max_num_batched_tokens_extra=0, requests=reqs)


@settings(max_examples=max(EXAMPLES // 2, 10), phases=[Phase.explicit, Phase.generate], **PROPERTY_SETTINGS)
@example(workload=compressed_preempted_compressed(asynchronous=False))
@example(workload=compressed_preempted_compressed(asynchronous=True))
@given(workload=workloads(compress=True))
def test_compression_metrics_match_the_compactions_that_ran(model_dir, workload):
    """``num_compressions`` and ``evicted_tokens`` count the compactions the runner ran, and a
    request's first compression since its cache was (re)computed is max-pooled."""
    outputs, engine, runner = run(model_dir, workload, async_scheduling=workload.async_scheduling,
                                  num_blocks=workload.num_blocks, check=False)
    pooling = engine.config.compression is not None and engine.config.compression.pooling_width is not None
    every = engine.config.compression is not None and engine.config.compression.pool_every_compression
    first_of_incarnation = set()
    for rid, incarnation, pool in runner.pooled:
        first = (rid, incarnation) not in first_of_incarnation
        first_of_incarnation.add((rid, incarnation))
        which = "its first" if first else "a later"
        assert pool == (pooling and (first or every)), \
            f"request {rid} (incarnation {incarnation}): pool={pool} at {which} compression since its prefill"
    for r in workload.requests:
        metrics = outputs.final[r.rid].metrics
        assert metrics.num_compressions == runner.compactions[r.rid], f"request {r.rid}: num_compressions"
        assert metrics.evicted_tokens == runner.evicted[r.rid], f"request {r.rid}: evicted_tokens"


def test_penalties_change_tokens_and_survive_preemption(model_dir):
    """The runner keeps penalised requests' token counts (rebuilt at a recompute): they change the
    tokens, and a preempted, asynchronous run gives the same ones as a request alone."""
    prompt = [7, 8, 9]
    plain = Request("p", prompt, dict(max_tokens=30, ignore_eos=True))
    penalised = Request("p", prompt, dict(max_tokens=30, ignore_eos=True, presence_penalty=0.7))
    results = {}
    for name, r in (("plain", plain), ("penalised", penalised)):
        outputs, _, _ = run(model_dir, small_workload(requests=[r], async_scheduling=False), async_scheduling=False,
                            num_blocks=16)
        results[name] = outputs.result("p")[0]
    assert results["plain"] != results["penalised"]
    crowd = [Request(f"q{i}", [i + 3] * 5, dict(max_tokens=30, ignore_eos=True, repetition_penalty=1.3))
             for i in range(3)] + [penalised]  # the newest: preempted first
    outputs, _, _ = run(model_dir, small_workload(requests=crowd), async_scheduling=True, num_blocks=12)
    assert outputs.final["p"].metrics.num_preemptions > 0
    assert outputs.result("p")[0] == results["penalised"]
