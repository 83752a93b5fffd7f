"""A model-free runner for the real ``LLMEngine`` loop that checks every KV read and write.

``CheckingRunner`` implements the runner interface ``LLMEngine`` drives (``launch`` /
``collect`` / ``execute``, ``compress`` / ``start_compression`` / ``compression_done``,
``close``, ``forget``) without a model. It models what a GPU runner would do to the
caches and checks, at every call, that the engine's bookkeeping would have made that
work correct.

What it models
--------------
- Tokens: the token sampled at output position ``p`` of request ``r`` is a fixed function
  of ``(r, p)`` (and of the request's sampling parameters): a logits row built from a hash
  of ``(r, p)`` goes through the real ``Sampler`` with the real ``sampling_tensors`` and, as
  the model runner keeps them, penalised requests' token counts (``PenaltyState``: a row
  per request, rebuilt at each prefill, freed by ``forget``), so ``min_tokens`` bans,
  seeded sampling and penalties are exercised. The batch,
  the timing, the cache size, preemption and compression change nothing: an asynchronous
  run, a synchronous run and runs with different caches give the same tokens. The tokens
  are ids of the tiny checkpoint's tokenizer (``a``, ``b``, `` a``, ``.``, EOS, half of an
  ``é`` ...) so that stop tokens, EOS and stop strings all happen.
- The KV store (after ``tests/test_hybrid_scheduling.py``'s ``HybridEngine``): every cache
  slot holds what the forward wrote there. While a request's cache is a token prefix an
  entry is ``("tok", position, prefix)``: the same in every request with that prefix, which
  is what the prefix cache may share. After a compaction its kept entries become
  ``("kept", request, incarnation, compaction, index)`` and its new tokens
  ``("ctok", request, incarnation, position, token)``: never shareable. ``expected[r]`` is
  what request ``r``'s cache must hold, index by index (``None`` while an asynchronous
  compaction rewrites it). A launched step's writes are recorded when it is launched, as a
  GPU stream orders them before any later work.
- A compaction reads its sources when it is launched and writes its targets when it
  completes: at once for ``compress``; for ``start_compression`` after the number of polls
  (``compression_done(handle)`` calls, one per engine step) that ``compression_delays``
  gives, or at once with ``wait``.
- The query cache: ring row ``(slot, position % window)`` holds the query of
  ``(request, incarnation, position)`` written by a slot holder's forward; a compaction
  needs its whole window there.

What it checks (an ``AssertionError`` naming the request, block and position)
------------------------------------------------------------------------------
- every cached entry a launched request reads (its block table up to ``kv_len``; for a
  prefill, the prefix-cache hit too) is what that request wrote or legitimately shares:
  a poisoned prefix cache, a compacted block served as a prefix, a block another request
  overwrote all fail;
- no write lands in a block an in-flight compaction reads or writes, nor in a block that
  another running request holds (except the blocks a prefill computes for requests
  admitted in the same step), nor without a block to land in;
- a launched request is running, once in the step, with every token on the host for a
  prefill; a decode's input token is the one the double sampled for that position, and a
  pending input (asynchronous scheduling) must come from the step passed as ``previous``;
- a request that holds no query slot caches only below its slotless limit;
- a compaction reads exactly its request's expected cache and finds its window's queries,
  which nothing overwrites until it completes; a request being compacted is not launched;
  with ``attach(block_manager)``, no block an in-flight compaction reads is freed before it
  completes;
- ``check_cache(seq)`` and ``check_prefix_cache(block_manager)`` let a test check the
  whole state between steps.

A failed check raises ``AssertionError`` inside the runner call and is also kept in
``violations``: an engine that contains runner failures (ends the requests concerned with
an error) would otherwise hide it; ``check_violations()`` raises the first one.

Fault injection: ``inject(point, at=n)`` makes the ``n``-th call (0-based, counted per
point from the runner's creation) of ``point`` raise ``InjectedFault``, once (``fired``
lists those raised). See ``FAULT_POINTS``. A fault leaves the double consistent for an
engine that carries on, and models what the failure did to the caches:

- a launch fault (``prefill_launch``, ``decode_launch``) writes nothing;
- a ``sampler`` fault keeps the step's KV writes (the forward ran) but not its requests'
  cache lengths, so that a retried step checks out;
- a ``collect`` fault makes the step's writes garbage (``("lost", ...)`` entries, which no
  request expects, prefix-cache readers included), and those of the later steps fed with
  its tokens; their requests' caches become unknown, and so does the result of a compaction
  in flight that read them;
- a ``compression_launch`` or ``compression_collect`` fault leaves the compacted requests'
  caches unknown (their block tables were already replaced); a failed batch in flight
  never writes its targets.

A request whose cache is unknown fails any later launch or compaction of it.
"""

from __future__ import annotations

import copy
import functools
import random
from collections import Counter
from dataclasses import dataclass, field

import torch
import xxhash

from zipage.engine.block_manager import chain_hash
from zipage.engine.sequence import Sequence, SequenceStatus
from zipage.layers.sampler import Sampler
from zipage.runner.inputs import sampling_tensors
from zipage.runner.penalties import PenaltyState

FAULT_POINTS = (
    "prefill_launch",  # launch of a prefill, before anything is written
    "decode_launch",  # launch of a decode step, before anything is written
    "sampler",  # inside launch, after the step's KV and query writes were recorded
    "collect",  # reading a launched step's tokens
    "compression_launch",  # compress / start_compression, before anything is read
    "compression_collect",  # compression_done
)


class InjectedFault(RuntimeError):
    """Raised by ``CheckingRunner`` at a point armed with ``inject``."""


def _checked(method):
    """Record a failed check before raising it: an engine that contains runner failures (ends the
    requests with an error and carries on) must not hide it from the test (``check_violations``)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except AssertionError as failure:
            self.violations.append(failure)
            raise
    return wrapper


# -- tokens -------------------------------------------------------------------------------------
# Texts of the tokens the double samples (each one token of the tiny checkpoint's tokenizer) and
# their weights. "\xc3" and "\xa9" are the two bytes of "é": one alone decodes to U+FFFD.
PIECES = {"a": 6, "b": 6, "c": 3, " a": 4, " ": 3, ".": 3, "\n": 1, "\xc3": 1, "\xa9": 1}
SAFE_PIECE = "x"  # never a stop token in the tests: the fallback when the others are banned
EOS_WEIGHT = 1
SPECIAL_WEIGHT = 1  # <|im_start|>: a special token, skipped in text


@functools.lru_cache(maxsize=None)
def token_alphabet(model_dir: str) -> dict[str, int]:
    """Token id of each piece in ``PIECES`` (plus ``SAFE_PIECE``, "<eos>" and "<special>")."""
    from zipage.utils.loader import load_tokenizer

    tok = load_tokenizer(model_dir)
    halves = tok.encode("\u00e9")
    assert len(halves) == 2, f"'\u00e9' is not two byte-level tokens of {model_dir}: {halves}"
    ids = {"\xc3": halves[0], "\xa9": halves[1]}
    for piece in [*PIECES, SAFE_PIECE]:
        if piece not in ids:
            encoded = tok.encode(piece)
            assert len(encoded) == 1, f"{piece!r} is not one token of {model_dir}: {encoded}"
            ids[piece] = encoded[0]
    ids["<eos>"] = tok.eos_token_id
    ids["<special>"] = tok.convert_tokens_to_ids("<|im_start|>")
    return ids


def _hash(*parts) -> int:
    return xxhash.xxh64_intdigest("/".join(map(str, parts)).encode())


class TokenModel:
    """Logits that are a function of (request id, output position) only."""

    def __init__(self, alphabet: dict[str, int], vocab_size: int):
        self.vocab_size = vocab_size
        self.safe = alphabet[SAFE_PIECE]
        weighted = [(alphabet[p], w) for p, w in PIECES.items()]
        weighted += [(alphabet["<eos>"], EOS_WEIGHT), (alphabet["<special>"], SPECIAL_WEIGHT)]
        self.choices = [t for t, w in weighted for _ in range(w)]

    def preferences(self, request_id: str, position: int) -> list[int]:
        """The tokens the logits favour, best first (distinct)."""
        h = _hash(request_id, position)
        first = self.choices[h % len(self.choices)]
        second = self.choices[(h >> 20) % len(self.choices)]
        return list(dict.fromkeys([first, second, self.safe]))

    def logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Row i: the preferences of ``seqs[i]``'s next position, close enough that penalties
        reorder them (4 / 1.3 < 3.5), far above every other token."""
        rows = torch.full((len(seqs), self.vocab_size), -30.0)
        for i, seq in enumerate(seqs):
            for rank, token in enumerate(self.preferences(seq.request_id, seq.num_tokens)):
                rows[i, token] = 4.0 - 0.5 * rank
        return rows


# -- handles ------------------------------------------------------------------------------------
@dataclass(eq=False)
class LaunchedStep:
    """A launched step: its requests, their sampled tokens and where each sits."""

    index: int  # launches so far
    seqs: list[Sequence]
    is_prefill: bool
    tokens: list[int]
    positions: list[int]  # output position of each request's token
    incarnations: list[int]
    writes: list = field(default_factory=list)  # (request id, block, offset, entry) it wrote
    fed_by: LaunchedStep | None = None  # the step whose tokens some of its inputs were (pending)
    fed: set[str] = field(default_factory=set)  # the requests whose input came from ``fed_by``
    collected: bool = False

    def row_of(self, seq: Sequence) -> int | None:
        return next((i for i, s in enumerate(self.seqs) if s is seq), None)


@dataclass(eq=False)
class CompressionBatch:
    """A compaction batch between launch and completion."""

    tasks: list
    reads: list  # per task: (entries read from the sources, entries kept)
    blocks: set[int]  # every source and target block
    slots: set[int]  # the query slots whose window it reads
    polls_left: int
    tainted: set[str] = field(default_factory=set)  # requests whose sources a failed step made garbage
    done: bool = False


def _incarnation(seq: Sequence) -> int:
    return seq.metrics.num_preemptions  # a recomputed request starts afresh


# -- the runner ---------------------------------------------------------------------------------
class CheckingRunner:
    """The runner interface of ``LLMEngine`` with a checked, simulated KV cache and no model."""

    supports_async_scheduling = True

    def __init__(self, config, num_blocks: int, num_query_slots: int = 0, compression_delays=(0,),
                 vocab_size: int | None = None):
        """``config``: the engine's ``EngineConfig`` (block size, compression window);
        ``compression_delays``: polls an asynchronous compaction batch stays in flight, cycled
        over the batches."""
        from zipage.utils.loader import load_config

        self.num_blocks = num_blocks
        self.num_query_slots = num_query_slots if config.compression is not None else 0
        self.vocab_size = vocab_size if vocab_size is not None else load_config(config.model).vocab_size
        self.last_prepare_s = 0.0
        self.trace = None
        self.block_size = config.cache.block_size
        comp = config.compression
        self.window = comp.window if comp is not None else None
        self.compression = comp
        self.tokens = TokenModel(token_alphabet(config.model), self.vocab_size)
        # As the model runner: penalised requests' token counts, a row each (freed by ``forget``).
        self.penalties = PenaltyState(config.scheduler.max_num_seqs, self.vocab_size, torch.device("cpu"))
        self.sampler = Sampler(self.penalties)
        self.compression_delays = list(compression_delays)
        self.block_manager = None  # see attach

        self.store: dict[int, list] = {b: [None] * self.block_size for b in range(num_blocks)}
        self.expected: dict[str, list | None] = {}  # request id -> its cache, index by index
        self.qcache: dict[tuple[int, int], tuple] = {}  # (slot, position % window) -> (request, inc, position)
        self.sampled: dict[tuple[str, int], int] = {}  # (request id, position) -> token
        self.seqs: dict[str, Sequence] = {}  # the unfinished requests launched, by id
        self.seen: set[str] = set()  # every request launched
        self.in_flight: CompressionBatch | None = None
        self.uncollected: list[LaunchedStep] = []
        self.forgotten: list[list[str]] = []  # request ids of each forget call
        self.num_launches = 0
        self._writes: list = []  # of the launch being checked
        self.num_compaction_batches = 0
        self.num_compactions_started = 0
        self.prefill_compactions = 0  # compactions of prompts between their chunks
        self.compactions: Counter = Counter()  # request id -> compactions completed (all incarnations)
        self.evicted: Counter = Counter()  # request id -> tokens those evicted
        self.pooled: list[tuple[str, int, bool]] = []  # (request, incarnation, pool flag) per compaction
        self.calls: Counter = Counter()  # fault point -> calls so far
        self._faults: dict[str, set[int]] = {}
        self.fired: list[tuple[str, int]] = []  # (point, call) of every injected fault raised
        self.violations: list[AssertionError] = []  # every failed check, also those the engine caught
        self.failed_compactions: set[tuple[str, int]] = set()  # (request, incarnation) whose compaction raised
        self.closed = False

    def attach(self, block_manager) -> None:
        """Also check that no block an in-flight compaction reads is freed before it completes."""
        self.block_manager = block_manager

    # -- fault injection ----------------------------------------------------------------------
    def inject(self, point: str, at: int = 0) -> None:
        """Make the ``at``-th call (0-based, counted from the runner's creation) of ``point``
        raise ``InjectedFault``, once."""
        assert point in FAULT_POINTS, f"unknown fault point {point!r}; choose from {FAULT_POINTS}"
        assert at >= self.calls[point], f"{point}: call {at} has already happened"
        self._faults.setdefault(point, set()).add(at)

    def _fault_point(self, point: str) -> None:
        n = self.calls[point]
        self.calls[point] += 1
        armed = self._faults.get(point, set())
        if n in armed:
            armed.discard(n)
            self.fired.append((point, n))
            raise InjectedFault(f"injected fault at {point} call {n}")

    # -- the forward --------------------------------------------------------------------------
    def execute(self, seqs, is_prefill: bool, eos_token_ids, async_callback=None) -> list[int]:
        step = self.launch(seqs, is_prefill, eos_token_ids)
        if async_callback is not None:
            async_callback()
        return self.collect(step)

    @_checked
    def launch(self, seqs, is_prefill: bool, eos_token_ids, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Check and record one step's KV reads and writes, then sample its tokens."""
        self._fault_point("prefill_launch" if is_prefill else "decode_launch")
        seqs = list(seqs)
        self._check_batch(seqs, previous)
        assert is_prefill == any(s.chunk is not None for s in seqs), "is_prefill: whether the step has prompt chunks"
        if is_prefill:
            decodes = [s for s in seqs if s.chunk is None]
            assert seqs[:len(decodes)] == decodes, "decodes come before prompt chunks"
        inputs = {seq.request_id: self._input_token(seq, previous) for seq in seqs}
        before = {s.request_id: copy.copy(self.expected.get(s.request_id)) for s in seqs}
        self._writes = []
        self._forward(seqs, inputs)
        try:
            self._fault_point("sampler")
        except InjectedFault:
            # The KV was written (the store keeps it), but the step never ran to its end: the
            # requests' caches are as before it, so that a retried step finds what it expects.
            self.expected.update(before)
            raise
        sampled = [s for s in seqs if s.samples]  # an earlier chunk of a prompt yields no token
        tokens = self._sample(sampled, eos_token_ids)
        step = LaunchedStep(self.num_launches, sampled, is_prefill, tokens, [s.num_tokens for s in sampled],
                            [_incarnation(s) for s in sampled], writes=self._writes, fed_by=previous,
                            fed={s.request_id for s in seqs if s.num_pending})
        self.num_launches += 1
        self.uncollected.append(step)
        return step

    def _check_batch(self, seqs: list[Sequence], previous: LaunchedStep | None) -> None:
        assert seqs, "a launch without requests"
        assert len({id(s) for s in seqs}) == len(seqs), f"a request twice in one step: {seqs}"
        if previous is not None:
            assert not previous.collected, f"launch {previous.index}, passed as previous, was already collected"
            assert previous in self.uncollected, f"launch {previous.index}, passed as previous, is unknown"
        self._check_in_flight_sources()
        for seq in seqs:
            rid = seq.request_id
            self.seqs[rid] = seq
            self.seen.add(rid)
            assert seq.status is SequenceStatus.RUNNING, f"request {rid} launched while {seq.status.value}"
            assert not self._compacting(seq), f"request {rid} is launched while its compaction is in flight"

    def _forward(self, seqs: list[Sequence], inputs: dict[str, int | None]) -> None:
        """As in a forward: every layer stores the whole step's KV before attention reads it."""
        holders = self._block_holders()
        chunks = [s for s in seqs if s.chunk is not None]
        for seq in seqs:
            if seq.chunk is not None:
                self._write_prefill(seq, holders, chunks)
            else:
                self._write_decode(seq, holders, inputs[seq.request_id])
        for seq in seqs:
            upto = seq.kv_len + (seq.chunk[1] if seq.chunk is not None else 1)
            self._check_reads(seq, upto, "prefill" if seq.chunk is not None else "decode")

    @_checked
    def collect(self, step: LaunchedStep) -> list[int]:
        try:
            self._fault_point("collect")
        except InjectedFault:
            self._lose(step)
            raise
        assert not step.collected, f"launch {step.index} collected twice"
        assert step in self.uncollected, f"launch {step.index} is unknown to the runner"
        step.collected = True
        self.uncollected.remove(step)
        return list(step.tokens)

    def _lose(self, step: LaunchedStep) -> None:
        """A step whose tokens could not be read failed on the device: the KV it wrote is garbage,
        and so is that of the steps launched after it from its tokens. Their requests' caches
        are unknown; an entry that is still there becomes ``("lost", ...)``, which no request
        expects: reading it (through the prefix cache too) fails."""
        self.uncollected = [s for s in self.uncollected if s is not step]
        lost = [(step, None)] + [(later, later.fed) for later in self.uncollected if later.fed_by is step]
        for launched, only in lost:
            for rid, block, offset, entry in launched.writes:
                if only is not None and rid not in only:
                    continue
                self.expected[rid] = None
                if self.store[block][offset] == entry:
                    self.store[block][offset] = ("lost", rid, launched.index, offset)
                for task in self.in_flight.tasks if self.in_flight is not None else []:
                    if block in task.source_blocks:  # the compaction read garbage: its result is garbage
                        self.in_flight.tainted.add(task.seq.request_id)

    def _input_token(self, seq: Sequence, previous: LaunchedStep | None) -> int | None:
        """The decode input token the device would use, checked against what was sampled."""
        rid, pos = seq.request_id, seq.num_tokens - 1
        if seq.chunk is not None:
            assert seq.num_pending == 0, f"request {rid}: prefilled with {seq.num_pending} token(s) not on the host"
            return None
        assert seq.num_pending in (0, 1), f"request {rid}: {seq.num_pending} pending tokens at a decode"
        if seq.num_pending:
            row = previous.row_of(seq) if previous is not None else None
            assert row is not None, (f"request {rid}: its input token (position {pos}) is pending but not "
                                     f"in the step passed as previous")
            assert previous.positions[row] == pos and previous.incarnations[row] == _incarnation(seq), \
                f"request {rid}: the previous step sampled position {previous.positions[row]}, not {pos}"
            return previous.tokens[row]
        token = seq.token_ids[-1]
        if pos >= seq.num_prompt_tokens:
            assert self.sampled.get((rid, pos)) == token, \
                f"request {rid}: input token {token} at position {pos}, sampled {self.sampled.get((rid, pos))}"
        return token

    def _sample(self, seqs: list[Sequence], eos_token_ids) -> list[int]:
        """The real sampler on logits of (request, position), as the model runner calls it."""
        if not seqs:
            return []
        self.penalties.admit([s for s in seqs if s.chunk is not None])  # prompts whose last chunk ran
        st = sampling_tensors(seqs, self.vocab_size, set(eos_token_ids), torch.device("cpu"), self.penalties.rows)
        sampled = self.sampler(self.tokens.logits(seqs), st)
        self.penalties.add_sampled(st, sampled)
        tokens = sampled.tolist()
        for seq, token in zip(seqs, tokens):
            key = (seq.request_id, seq.num_tokens)
            before = self.sampled.setdefault(key, token)
            assert before == token, (f"request {seq.request_id}: position {seq.num_tokens} sampled as {token}, "
                                     f"earlier as {before} (the token must depend on request and position only)")
        return tokens

    # -- KV writes and reads ------------------------------------------------------------------
    def _entry(self, seq: Sequence, position: int, tokens: list[int]):
        if seq.kv_is_token_prefix:
            return ("tok", position, tuple(tokens[:position + 1]))
        return ("ctok", seq.request_id, _incarnation(seq), position, tokens[position])

    def _block_holders(self) -> dict[int, list[str]]:
        """Block -> running requests whose block table holds it (from the requests' own state)."""
        holders: dict[int, list[str]] = {}
        for rid, seq in list(self.seqs.items()):
            if seq.is_finished:
                del self.seqs[rid]
                continue
            for block in seq.block_table:
                holders.setdefault(block, []).append(rid)
        return holders

    def _write(self, seq: Sequence, index: int, position: int, entry, holders, batch=()) -> None:
        rid, bs = seq.request_id, self.block_size
        table = list(seq.block_table)
        assert index // bs < len(table), \
            f"request {rid}: no block for cache index {index} (position {position}); block table {table}"
        block = table[index // bs]
        if self.compression is not None and seq.query_slot is None and seq.max_blocks is not None:
            limit = self.compression.slotless_limit(bs, seq.max_blocks)  # its own budget's
            assert index < limit, (f"request {rid} caches index {index} (position {position}) "
                                   f"without a query slot (limit {limit})")
        if self.in_flight is not None:
            owners = [t.seq.request_id for t in self.in_flight.tasks
                      if block in t.source_blocks or block in t.target_blocks]
            assert not owners, (f"request {rid} writes block {block} (cache index {index}, position {position}) "
                                f"while the compaction of {owners} reads or writes it")
        batch_ids = {s.request_id for s in batch}
        others = [h for h in holders.get(block, []) if h != rid and h not in batch_ids]
        assert not others, (f"request {rid} writes block {block} (cache index {index}, position {position}) "
                            f"that {others} also hold")
        self.store[block][index % bs] = entry
        self._writes.append((rid, block, index % bs, entry))

    def _save_query(self, seq: Sequence, position: int) -> None:
        if self.window is None or seq.query_slot is None:
            return
        if self.in_flight is not None:
            assert seq.query_slot not in self.in_flight.slots, \
                f"request {seq.request_id} overwrites the window of an in-flight compaction (slot {seq.query_slot})"
        self.qcache[(seq.query_slot, position % self.window)] = (seq.request_id, _incarnation(seq), position)

    def _write_prefill(self, seq: Sequence, holders, batch) -> None:
        rid, tokens = seq.request_id, seq.token_ids
        start, n = seq.chunk
        end, kv_start = start + n, seq.kv_len
        # Cache index = position, unless the prompt was compressed between its chunks.
        assert kv_start == start or (seq.compress_prefill and not seq.kv_is_token_prefix and kv_start < start), \
            f"request {rid}: chunk {seq.chunk} of {seq}"
        assert end <= seq.num_tokens and seq.num_pending == 0, f"request {rid}: chunk {seq.chunk} of {seq}"
        hit = seq.num_prefix_hit_tokens
        assert hit % self.block_size == 0 and 0 <= hit <= start < end, f"request {rid}: prefix hit of {hit} tokens"
        if start > hit:  # a later chunk: the earlier ones' KV is cached
            expected = self.expected.get(rid)
            assert expected is not None and len(expected) == kv_start, \
                f"request {rid}: chunk {seq.chunk} after {expected} (kv_len {kv_start})"
            assert (rid, _incarnation(seq)) not in self.failed_compactions, \
                f"request {rid} is prefilled on although its compaction failed (its cache is unknown)"
        else:
            expected = [self._entry(seq, pos, tokens) for pos in range(start)]  # served by the prefix cache
        new = [self._entry(seq, pos, tokens) for pos in range(start, end)]
        for i, pos in enumerate(range(start, end)):
            self._write(seq, kv_start + i, pos, new[i], holders, batch)
        if self.window is not None:
            for pos in range(max(start, end - self.window), end):
                self._save_query(seq, pos)
        self.expected[rid] = list(expected) + new

    def _write_decode(self, seq: Sequence, holders, input_token: int) -> None:
        rid = seq.request_id
        expected = self.expected.get(rid)
        assert (rid, _incarnation(seq)) not in self.failed_compactions, \
            f"request {rid} decodes although its compaction failed (its cache is unknown)"
        assert expected is not None, f"request {rid} decodes but its cache is unknown (never prefilled, or lost)"
        assert len(expected) == seq.kv_len, \
            f"request {rid}: kv_len {seq.kv_len}, but {len(expected)} entries were cached"
        pos = seq.num_tokens - 1
        tokens = seq.token_ids.tolist() + [input_token] * seq.num_pending
        entry = self._entry(seq, pos, tokens)
        self._write(seq, seq.kv_len, pos, entry, holders)
        self._save_query(seq, pos)
        expected.append(entry)

    def _check_reads(self, seq: Sequence, upto: int, what: str) -> None:
        """Every cached entry [0, upto) of ``seq`` is what it wrote or legitimately shares."""
        rid, bs = seq.request_id, self.block_size
        expected = self.expected[rid]
        assert len(expected) == upto, f"request {rid}: {what} reads {upto} entries, {len(expected)} cached"
        table = list(seq.block_table)
        for index in range(upto):
            block = table[index // bs]
            got = self.store[block][index % bs]
            assert got == expected[index], (f"request {rid} ({what}) reads block {block} at cache index {index}: "
                                            f"{_short(got)}, expected {_short(expected[index])}")

    def check_cache(self, seq: Sequence) -> None:
        """Between steps: a running request's cache holds what it should (unless being compacted)."""
        if self.expected.get(seq.request_id) is None or self._compacting(seq):
            return
        self._check_reads(seq, seq.kv_len, "cache")

    def _compacting(self, seq: Sequence) -> bool:
        return self.in_flight is not None and any(t.seq is seq for t in self.in_flight.tasks)

    # -- compaction ---------------------------------------------------------------------------
    @_checked
    def compress(self, tasks) -> None:
        """A synchronous compaction: before the step's forward writes anything."""
        self._compression_fault_point("compression_launch", tasks)
        assert self.in_flight is None, "a synchronous compaction while an asynchronous one is in flight"
        reads = self._read_sources(tasks)
        self._write_targets(tasks, reads)

    @_checked
    def start_compression(self, tasks) -> CompressionBatch:
        self._compression_fault_point("compression_launch", tasks)
        assert self.in_flight is None, "a second compaction batch while one is in flight"
        reads = self._read_sources(tasks)
        blocks = {b for t in tasks for b in [*t.source_blocks, *t.target_blocks]}
        delay = self.compression_delays[self.num_compaction_batches % len(self.compression_delays)]
        self.num_compaction_batches += 1
        self.in_flight = CompressionBatch(list(tasks), reads, blocks, {t.seq.query_slot for t in tasks}, delay)
        for task in tasks:
            self.expected[task.seq.request_id] = None
        return self.in_flight

    @_checked
    def compression_done(self, handle: CompressionBatch, wait: bool = False) -> bool:
        assert handle is self.in_flight and not handle.done, "compression_done of a batch not in flight"
        self._compression_fault_point("compression_collect", handle.tasks)
        if not wait and handle.polls_left > 0:
            handle.polls_left -= 1
            return False
        self._check_in_flight_sources()
        self._write_targets(handle.tasks, handle.reads, handle.tainted)
        handle.done = True
        self.in_flight = None
        return True

    def _compression_fault_point(self, point: str, tasks) -> None:
        """A failed compaction leaves its requests' caches unknown (their block tables were
        already replaced by the targets): none of them may be read again. A failed batch in
        flight is over: it never writes its targets."""
        try:
            self._fault_point(point)
        except InjectedFault:
            for task in tasks:
                self.expected[task.seq.request_id] = None
                self.failed_compactions.add((task.seq.request_id, _incarnation(task.seq)))
            if point == "compression_collect":
                self.in_flight = None
            raise

    def _check_window(self, task) -> None:
        seq = task.seq
        assert seq.query_slot is not None, f"request {seq.request_id} is compacted without a query slot"
        for pos in range(task.last_position - self.window + 1, task.last_position + 1):
            got = self.qcache.get((seq.query_slot, pos % self.window))
            assert got == (seq.request_id, _incarnation(seq), pos), \
                f"request {seq.request_id}: the query of position {pos} is not in slot {seq.query_slot} (found {got})"

    def _read_sources(self, tasks) -> list:
        bs, reads = self.block_size, []
        for i, task in enumerate(tasks):
            seq, rid = task.seq, task.seq.request_id
            self.prefill_compactions += seq.prefilling  # between two chunks of its prompt
            self.seqs[rid] = seq
            self._check_window(task)
            expected = self.expected.get(rid)
            assert expected is not None, f"request {rid} is compacted but its cache is unknown"
            assert len(expected) == task.num_tokens, \
                f"request {rid}: compacts {task.num_tokens} entries, {len(expected)} cached"
            assert task.keep <= task.num_tokens and len(task.target_blocks) * bs == task.keep, \
                f"request {rid}: keeps {task.keep} of {task.num_tokens} in {len(task.target_blocks)} blocks"
            assert list(seq.block_table)[:len(task.target_blocks)] == list(task.target_blocks), \
                f"request {rid}: block table {list(seq.block_table)} does not start with targets {task.target_blocks}"
            old = []
            for index in range(task.num_tokens):
                block = task.source_blocks[index // bs]
                got = self.store[block][index % bs]
                assert got == expected[index], (f"request {rid}: its compaction reads block {block} at cache index "
                                                f"{index}: {_short(got)}, expected {_short(expected[index])}")
                old.append(got)
            for later in tasks[i + 1:]:
                assert not set(task.target_blocks) & set(later.source_blocks), \
                    f"request {rid}'s targets are sources of {later.seq.request_id} in the same batch"
            n = self.num_compactions_started
            self.num_compactions_started += 1
            rng = random.Random(_hash(rid, _incarnation(seq), n))
            kept_at = sorted(rng.sample(range(task.num_tokens), task.keep))
            kept = [("kept", rid, _incarnation(seq), n, j) for j in kept_at]
            self.pooled.append((rid, _incarnation(seq), bool(task.pool)))
            reads.append((old, kept))
        return reads

    def _write_targets(self, tasks, reads, tainted=frozenset()) -> None:
        """Complete a compaction: write the kept entries (``tainted`` requests': garbage)."""
        bs = self.block_size
        for task, (old, _) in zip(tasks, reads):  # nothing wrote the sources (nor the window) meanwhile
            if task.seq.request_id in tainted:
                continue
            self._check_window(task)
            now = [self.store[task.source_blocks[j // bs]][j % bs] for j in range(task.num_tokens)]
            assert now == old, f"request {task.seq.request_id}: its sources changed while being compacted"
        for task, (_, kept) in zip(tasks, reads):
            rid = task.seq.request_id
            if rid in tainted:
                kept = [("lost", rid, "compaction", j) for j in range(len(kept))]
            for j, entry in enumerate(kept):
                self.store[task.target_blocks[j // bs]][j % bs] = entry
            self.expected[rid] = list(kept) if rid not in tainted else None
            self.compactions[rid] += 1
            self.evicted[rid] += task.num_tokens - task.keep

    def _check_in_flight_sources(self) -> None:
        if self.in_flight is None or self.block_manager is None:
            return
        bm = self.block_manager
        for task in self.in_flight.tasks:
            for block in task.source_blocks:
                assert bm.ref_counts[block] > 0 and block not in bm.free_blocks, \
                    f"block {block}, read by the in-flight compaction of {task.seq.request_id}, was freed"

    # -- between steps ------------------------------------------------------------------------
    def check_violations(self) -> None:
        """Raise the first check that failed inside a runner call, even if the engine caught it."""
        if self.violations:
            raise AssertionError(f"the runner's check failed: {self.violations[0]}") from self.violations[0]

    def check_prefix_cache(self, bm) -> None:
        """Every block registered in the prefix cache holds the token-prefix KV its hash names."""
        bs = self.block_size
        assert sum(h is not None for h in bm.block_hash) == len(bm.hash_to_block), "stale block hashes"
        for h, block in bm.hash_to_block.items():
            assert bm.block_hash[block] == h, f"block {block}: hash_to_block and block_hash disagree"
            entries = self.store[block]
            last = entries[-1]
            assert last is not None and last[0] == "tok", f"registered block {block} holds {_short(last)}"
            _, pos, prefix = last
            first = pos - (bs - 1)
            assert pos % bs == bs - 1, f"registered block {block} ends at position {pos}"
            for offset, entry in enumerate(entries):
                want = ("tok", first + offset, prefix[:first + offset + 1])
                assert entry == want, f"registered block {block} holds {_short(entry)} at offset {offset}"
            assert _prefix_hash(prefix, pos // bs + 1, bs) == h, \
                f"registered block {block} is registered under another prefix than it holds"

    # -- lifecycle ----------------------------------------------------------------------------
    def forget(self, seqs) -> None:
        """The engine no longer runs these requests (finished, aborted or preempted): recorded, and
        their penalty rows freed, as the model runner does (requests never seen are fine)."""
        seqs = list(seqs)
        self.forgotten.append([s.request_id for s in seqs])
        self.penalties.release(seqs)
        for seq in seqs:  # a finished request's id may come back as a new request
            if seq.is_finished:
                self.failed_compactions = {(rid, inc) for rid, inc in self.failed_compactions
                                           if rid != seq.request_id}

    def close(self) -> None:
        self.closed = True


@functools.lru_cache(maxsize=4096)
def _prefix_hash(tokens: tuple, num_blocks: int, bs: int) -> int:
    prev = None if num_blocks == 1 else _prefix_hash(tokens, num_blocks - 1, bs)
    return chain_hash(prev, list(tokens[(num_blocks - 1) * bs:num_blocks * bs]))


def _short(entry) -> str:
    """An entry for a message: a token prefix shows only its length and tail."""
    if entry is not None and entry[0] == "tok" and len(entry[2]) > 6:
        return f"('tok', {entry[1]}, (...{len(entry[2])} tokens, ending {entry[2][-4:]}))"
    return repr(entry)
