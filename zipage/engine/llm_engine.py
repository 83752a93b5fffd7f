"""The engine loop: add requests, step (collect -> schedule -> launch -> finish), abort.

``LLM`` (offline) and the server both drive this class.

A failure is contained to the requests it concerns. When the runner raises while
launching a compression, a prefill or a decode step, while sampling, or while the
engine reads a step's tokens or polls a compression, those requests end with
``finish_reason == "error"`` (the output's ``error`` says what failed) and every other
request carries on: their blocks return to the pool, the prefix-cache entries the
failed step made are withdrawn before anyone can hit them, and compressions are
abandoned through their one owner (``compression/lifecycle.py``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from zipage.compression.planner import request_max_blocks
from zipage.config import EngineConfig
from zipage.engine.block_manager import BlockManager
from zipage.engine.detokenizer import IncrementalDetokenizer
from zipage.engine.scheduler import ScheduledBatch, Scheduler, model_attention_span
from zipage.engine.sequence import Sequence
from zipage.outputs import CompletionOutput, RequestOutput
from zipage.sampling_params import ParameterError, SamplingParams
from zipage.utils.loader import load_config, load_tokenizer

logger = logging.getLogger(__name__)

OCCUPANCY_STEPS = 10_000  # steps whose occupancy ``EngineStats`` keeps (the most recent)


@dataclass
class StepStats:
    is_prefill: bool  # the step computes prompt tokens (with chunked prefill, beside decodes)
    num_seqs: int
    num_tokens: int  # tokens computed this step
    num_preempted: int
    num_compressed: int = 0
    num_running: int = 0  # running requests once the step was scheduled
    num_waiting: int = 0  # requests waiting (new or preempted) once the step was scheduled
    kv_tokens: int = 0  # decode: cached tokens the step's attention read (the sum of context lengths)
    num_decodes: int = 0  # requests that decode in the step (the others compute prompt chunks)
    compression_s: float = 0.0  # wall time of this step's (synchronous) compression
    host_s: float = 0.0  # CPU time of the step outside the model and sampler (scheduling, inputs, outputs)
    waited_s: float = 0.0  # time the call waited for the device's tokens (of this step or the one before)
    start: float = 0.0  # ``time.perf_counter()`` when the call began and when it ended
    end: float = 0.0


@dataclass
class EngineStats:
    """Engine-wide numbers since the engine started, in bounded memory."""

    num_steps: int = 0
    peak_running: int = 0
    num_compressions: int = 0
    compression_s: float = 0.0
    num_failed_requests: int = 0  # ended with finish_reason "error"
    host_s: float = 0.0  # the steps' host time (``StepStats.host_s``), summed
    # the last OCCUPANCY_STEPS steps: (seconds since start, blocks in use, running requests)
    occupancy: deque = field(default_factory=lambda: deque(maxlen=OCCUPANCY_STEPS))


@dataclass
class InFlightStep:
    """A step on the device whose tokens are not read yet (asynchronous scheduling)."""

    handle: object  # the runner's
    seqs: list[Sequence]  # every request the step computes for
    cache_entries: list  # provisional prefix-cache entries its prefill made
    sampled: list[Sequence]  # those it samples a token for, in the order of its tokens


class LLMEngine:
    def __init__(self, config: EngineConfig, runner=None):
        """``runner``: the model runner to drive (default: built from ``config``); ``bench replay``
        and the tests pass doubles with the same methods."""
        from zipage.runner.tensor_parallel import make_runner

        self.config = config
        self.hf_config = load_config(config.model, config.trust_remote_code)
        model_max_len = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        config.resolve(model_max_len)
        if config.scheduler.prefill_attention_span is None:
            config.scheduler.prefill_attention_span = model_attention_span(self.hf_config)
        self.tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        self.runner = runner if runner is not None else make_runner(config, self.hf_config)
        self.vocab_size = self.runner.vocab_size
        capacity = self.runner.num_blocks * config.cache.block_size
        # The longest prompt any request may have. Without compression a request must fit the
        # cache at full length; with it, a prompt cached whole (not compressed between its chunks,
        # or a full-KV request's) must leave the cache a block, and it is compressed at its first
        # decode step.
        self.max_prompt_tokens = self.max_whole_prompt_tokens = config.scheduler.max_model_len - 1
        if config.compression is not None:
            self.max_whole_prompt_tokens = min(self.max_prompt_tokens, capacity - config.cache.block_size)
            if config.compression.prefill_compression == "off" or not config.scheduler.enable_chunked_prefill:
                self.max_prompt_tokens = self.max_whole_prompt_tokens
        elif config.scheduler.max_model_len > capacity:
            raise ValueError(f"max_model_len={config.scheduler.max_model_len} does not fit the KV cache "
                             f"({capacity} tokens); lower max_model_len or give the cache more memory")
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            min_recomputed_tokens=config.compression.window if config.compression else 1)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, config.compression,
                                   self.runner.num_query_slots)
        self.compressions = self.scheduler.compressions  # None without compression
        self.async_scheduling = (config.scheduler.async_scheduling
                                 and getattr(self.runner, "supports_async_scheduling", False))
        # Asynchronous scheduling launches a step before the last one's tokens are read.
        self._run = self._run_ahead if self.async_scheduling else self._run_in_step
        self._launched: InFlightStep | None = None  # asynchronous scheduling: the step in flight
        self._wait_for_launched = False  # the next schedule needs its tokens (see _count_launched)
        self._waited_s = 0.0
        self._outbox: list[RequestOutput] = []  # outputs made outside a step's own flow (failures)
        self.stats = EngineStats()
        # A deque here (set by whoever wants it, e.g. a benchmark) receives every step's StepStats.
        self.step_log: deque | None = None
        self._start_time = time.perf_counter()
        self.eos_token_ids = self._eos_token_ids()
        self._seed_rng = random.Random(config.seed)
        self._request_counter = itertools.count()
        self._requests: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._streamed: dict[str, int] = {}  # streamed request id -> output token ids returned so far
        # a token's text alone, for log probabilities (cached: the same few thousand recur)
        self._grammar_compiler = None  # structured output (built at first use)
        self._num_constrained = 0  # unfinished requests with a grammar (spares the step a scan when 0)
        self._grammar_lock = threading.Lock()
        self._token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: self.tokenizer.decode([token_id], skip_special_tokens=False))

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        for source in (self.hf_config, getattr(self.tokenizer, "generation_config", None)):
            value = getattr(source, "eos_token_id", None)
            ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        try:
            from transformers import GenerationConfig
            gen = GenerationConfig.from_pretrained(self.config.model)
            value = gen.eos_token_id
            ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
        except (OSError, ValueError):
            pass  # no generation_config.json
        return ids

    # -- requests ---------------------------------------------------------
    def prepare_request(self, prompt, params: SamplingParams | None, request_id: str | None = None) -> Sequence:
        """Validate and tokenize one request without adding it (so a batch can be checked first)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: give prompts as lists of token ids")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            token_ids = list(prompt)
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        max_len = self.config.scheduler.max_model_len
        # Its own budget (ValueError if bad). A full-KV request grows with its length, so even beside
        # compressed ones it must fit the cache alone (to be recomputed after a preemption).
        full_kv = request_max_blocks(self.config.compression, self.config.cache.block_size, params) is None
        # A compressed request whose prompt is compressed between its chunks needs no room for it whole.
        max_prompt = self.max_whole_prompt_tokens if full_kv else self.max_prompt_tokens
        if len(token_ids) > max_prompt:
            limit = (f"max_model_len={max_len} allows at most {max_len - 1} so that one token can be generated"
                     if max_prompt == max_len - 1 else
                     f"the KV cache holds prompts of at most {max_prompt} tokens (compressed prompts can be "
                     "longer with chunked prefill and prefill_compression 'long' or 'always')")
            raise ValueError(f"prompt has {len(token_ids)} tokens; {limit}")
        room = (min(max_len, self.scheduler.max_recompute_tokens) if full_kv else max_len) - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if request_id is None:
            request_id = str(next(self._request_counter))
        elif request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.logprobs is not None and not getattr(self.runner, "supports_logprobs", False):
            raise ValueError(f"logprobs={params.logprobs}: this engine's runner ({type(self.runner).__name__}) "
                             "does not compute log probabilities")
        if params.prompt_logprobs is not None and not getattr(self.runner, "supports_prompt_logprobs", False):
            raise ParameterError("prompt_logprobs", f"prompt_logprobs={params.prompt_logprobs}: this engine's "
                                 f"runner ({type(self.runner).__name__}) does not compute prompt log probabilities "
                                 "(tensor parallelism does not)")
        if params.thinking_token_budget is not None:
            self._configure_thinking(params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler().matcher(params.structured_outputs)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(request_id, text, token_ids, params, max_tokens, seed)
        seq.grammar = grammar
        return seq

    def _configure_thinking(self, params: SamplingParams) -> None:
        """Give the runner the tokenizer's <think> and </think> ids, or say why a budget cannot work."""
        budget = params.thinking_token_budget
        if not getattr(self.runner, "supports_thinking_budget", False):
            raise ParameterError("thinking_token_budget", f"thinking_token_budget={budget}: this engine's runner "
                                 f"({type(self.runner).__name__}) does not apply thinking budgets")
        thinking = self.runner.thinking
        if thinking.start_id is None:
            ids = [self._single_token(t) for t in ("<think>", "</think>")] if self.tokenizer is not None else []
            if len(ids) != 2 or None in ids:
                raise ParameterError("thinking_token_budget", f"thinking_token_budget={budget}: this model's "
                                     "tokenizer has no <think> and </think> tokens, so there is no thinking to limit")
            thinking.configure(*ids)

    def _single_token(self, text: str) -> int | None:
        """The id of ``text`` if the tokenizer holds it as one token, else None."""
        token_id = self.tokenizer.convert_tokens_to_ids(text)
        if token_id is None or token_id == self.tokenizer.unk_token_id or token_id >= self.vocab_size:
            return None
        return token_id

    def grammar_compiler(self):
        """The engine's ``zipage.structured.GrammarCompiler`` (built at first use; thread-safe, so
        a server may compile a request's grammar ahead, off the engine's thread)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from zipage.structured import grammar_compiler_for

                self._grammar_compiler = grammar_compiler_for(
                    type(self.runner).__name__, getattr(self.runner, "supports_structured_outputs", False),
                    self.tokenizer, self.vocab_size, self.eos_token_ids,
                    self.config.structured_outputs_disable_any_whitespace)
            return self._grammar_compiler

    def add_sequence(self, seq: Sequence, stream: bool = False) -> None:
        """Queue a prepared request. With ``stream``, ``step`` also returns its progress (see ``step``)."""
        self._requests[seq.request_id] = seq
        self._num_constrained += seq.grammar is not None
        params = seq.sampling_params
        if self.tokenizer is not None and (params.stop or stream):
            self._detokenizers[seq.request_id] = IncrementalDetokenizer(
                self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens)
        if stream:
            self._streamed[seq.request_id] = 0
        self.scheduler.add(seq)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    stream: bool = False) -> str:
        seq = self.prepare_request(prompt, params, request_id)
        self.add_sequence(seq, stream)
        return seq.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return None
        output = self._end(seq, "abort")
        self._forget_released()
        return output

    @property
    def failure(self) -> str | None:
        """Why this engine can run no more steps (its tensor-parallel group was shut down after a
        failure, ``runner/tensor_parallel.py``), or None while it can."""
        return getattr(self.runner, "failure", None)

    def close(self) -> None:
        """Stop the tensor-parallel follower processes, if any (the engine is unusable after)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def has_unfinished_requests(self) -> bool:
        # A step still in flight when none is unfinished holds only finished requests: its tokens
        # are dropped whenever it is collected.
        return self.scheduler.has_unfinished() or bool(self._outbox)

    # -- the loop ---------------------------------------------------------
    def step(self, async_callback: Callable[[], None] | None = None
             ) -> tuple[list[RequestOutput], StepStats | None]:
        """Run one step; return the outputs it completed and the numbers of the step it ran.

        The outputs are those of the requests that finished and, for requests added with
        ``stream=True``, of every request that gained a token: each such output holds only
        what is new since its previous one (``finished`` marks the last).

        With asynchronous scheduling (the default where the runner allows it) a step is
        scheduled and launched before the previous step's tokens are read, and returns that
        previous step's outputs; the step it launches stays in flight until the next call.
        The schedule needs only token counts, which the host knows. A request that a stop
        token or string ends is found one step late; the token sampled for it in the
        meantime is dropped. Steps return ``None`` numbers when they launched nothing and
        only collected the step in flight.

        ``async_callback``, if given, is called while the device runs the model (before the
        engine waits for tokens), so that host work such as handing outputs over overlaps with
        the device's; it is not called if the step runs no model.
        """
        start = time.perf_counter()
        self._waited_s = 0.0  # of this call, spent waiting for the device's tokens (not host work)
        self._poll_compressions(wait=False)
        if self._launched is not None and self._wait_for_launched:
            self._collect_launched()
        batch = self._schedule()
        self._forget_released()  # before the launch, whose prefill may need what they held
        if batch is None:
            return self._take_outputs(), None
        stats = StepStats(batch.is_prefill, len(batch.seqs), batch.num_tokens, len(batch.preempted),
                          num_compressed=len(batch.compressions), num_running=len(self.scheduler.running),
                          num_waiting=len(self.scheduler.waiting),
                          num_decodes=batch.num_decodes)
        scheduled = time.perf_counter()
        self._launch_compressions(batch)
        stats.compression_s = time.perf_counter() - scheduled
        host_s = scheduled - start - self._waited_s
        if batch.seqs:
            host_s += self._run(batch, stats, async_callback)
        elif self._launched is not None:
            # Only compressions this step: read the step in flight now, since a request this schedule
            # preempted may be readmitted (prefilled from all its tokens) by the next one.
            self._collect_launched()
        self._forget_released()
        stats.host_s = host_s + self.runner.last_prepare_s
        stats.waited_s, stats.start, stats.end = self._waited_s, start, time.perf_counter()
        self._record(stats)
        return self._take_outputs(), stats

    def _schedule(self) -> ScheduledBatch | None:
        """The next step's work, collecting what it waits for; None when nothing is left to run."""
        try:
            batch = self.scheduler.schedule()
            if batch is None and self._launched is not None:
                self._collect_launched()  # its requests may finish and free what the others wait for
                batch = self.scheduler.schedule()
            if batch is None and self.compressions is not None and self.compressions.busy:
                self._poll_compressions(wait=True)  # nothing else can run until the compaction is done
                batch = self.scheduler.schedule()
        except BaseException:
            self.block_manager.withdraw(self.block_manager.take_new_entries())
            raise
        if batch is None:
            if self.scheduler.has_unfinished():
                bm = self.block_manager
                raise RuntimeError(f"scheduler made no progress: {len(self.scheduler.running)} running, "
                                   f"{len(self.scheduler.waiting)} waiting, {bm.num_free_blocks}/{bm.num_blocks} "
                                   "blocks free")
            return None
        batch.cache_entries = self.block_manager.take_new_entries()
        return batch

    def _launch_compressions(self, batch: ScheduledBatch) -> None:
        """Run or start the step's compressions; if that fails, their requests end (and leave the batch)."""
        if not batch.compressions:
            return
        try:
            self.compressions.launch(self.runner)
        except Exception as error:  # noqa: BLE001 - contained to the requests compressed
            tasks = self.compressions.planned
            self.compressions.abandon(tasks)
            failed = {task.seq for task in tasks}
            batch.seqs = [seq for seq in batch.seqs if seq not in failed]  # synchronous: to decode after it
            self._fail(list(failed), [], error, "launching a compression")

    def _poll_compressions(self, wait: bool) -> None:
        """Finish the in-flight compression batch if it is done (or, with ``wait``, once it is)."""
        if self.compressions is None or not self.compressions.busy:
            return
        try:
            self.compressions.poll(self.runner, wait)
        except Exception as error:  # noqa: BLE001 - contained to the requests compressed
            tasks = self.compressions.in_flight
            self.compressions.abandon(tasks)
            self._fail([task.seq for task in tasks], [], error, "a compression")

    def _run_in_step(self, batch: ScheduledBatch, stats: StepStats, async_callback) -> float:
        """Run the step's forward and hand out its tokens; return host seconds spent handing them out."""
        try:
            token_ids = self.runner.execute(batch.seqs, batch.is_prefill, self.eos_token_ids,
                                            async_callback=async_callback)
        except Exception as error:  # noqa: BLE001 - contained to the step's requests
            self._fail(batch.seqs, batch.cache_entries, error, self._step_name(batch))
            return 0.0
        sampled = batch.sampled
        self._count_launched(batch, stats)
        finished_at = time.perf_counter()
        self._append_tokens(sampled, token_ids)
        return time.perf_counter() - finished_at

    def _run_ahead(self, batch: ScheduledBatch, stats: StepStats, async_callback) -> float:
        """Launch the step's forward, then hand out the tokens of the step before it (asynchronous
        scheduling); return host seconds spent handing them out.

        A request with a grammar needs its pending token accepted before its next bitmask: the
        step's forward is queued first, then the step before it is collected, then its sampler
        is queued (``zipage/structured.py``)."""
        previous = self._launched
        defer = (previous is not None and self._num_constrained > 0
                 and any(seq.grammar is not None and seq.num_pending for seq in batch.seqs))
        handed_out = 0.0
        try:
            if defer:
                handle = self.runner.launch(batch.seqs, batch.is_prefill, self.eos_token_ids,
                                            previous=previous.handle, defer_sampling=True)
                self._launched, collected, previous = None, previous, None
                handed_out = self._timed_collect(collected)  # its tokens: the grammars' next input
                self.runner.sample(handle)
            else:
                handle = self.runner.launch(batch.seqs, batch.is_prefill, self.eos_token_ids,
                                            previous=previous.handle if previous is not None else None)
        except Exception as error:  # noqa: BLE001 - contained to the step's requests
            self._fail(batch.seqs, batch.cache_entries, error, self._step_name(batch))
            if self._launched is not None:  # a request this schedule preempted may hold a token of it, and be
                self._collect_launched()  # readmitted (prefilled from all its tokens) by the next schedule
            return handed_out
        self._launched = InFlightStep(handle, batch.seqs, batch.cache_entries, batch.sampled)
        self._count_launched(batch, stats)
        if async_callback is not None:
            async_callback()
        if previous is None:
            return handed_out
        return self._timed_collect(previous, self._launched)

    def _timed_collect(self, launched: InFlightStep, next_step: InFlightStep | None = None) -> float:
        """``_collect``; return the host seconds it spent, the wait for the device left out."""
        finished_at, waited = time.perf_counter(), self._waited_s
        self._collect(launched, next_step)
        return time.perf_counter() - finished_at - (self._waited_s - waited)

    @staticmethod
    def _step_name(batch: ScheduledBatch) -> str:
        return "a prefill step" if batch.is_prefill else "a decode step"

    def _count_launched(self, batch: ScheduledBatch, stats: StepStats) -> None:
        """A launched step's requests hold one more (pending) token, whose KV the step caches.

        The next step waits for this one's tokens (``_wait_for_launched``) when a request
        reaches its length limit, so that its blocks are free for the next schedule as without
        asynchronous scheduling. (Penalties need no wait: the runner counts the sampled tokens
        on the device.)
        """
        wait = False
        for seq in batch.seqs:
            self.block_manager.cache_step(seq)
            if not seq.samples:
                continue  # an earlier chunk of its prompt
            seq.num_pending += 1
            wait = wait or seq.num_output_tokens >= seq.max_tokens
            if seq.chunk is not None:
                if seq.num_output_tokens == 1:
                    seq.metrics.num_cached_prompt_tokens = seq.num_prefix_hit_tokens
            else:
                seq.metrics.peak_blocks = max(seq.metrics.peak_blocks, len(seq.block_table))
        if not batch.is_prefill:
            stats.kv_tokens = sum(seq.kv_len for seq in batch.seqs)  # what the step's attention reads
        self._wait_for_launched = wait

    def _collect_launched(self) -> None:
        launched, self._launched = self._launched, None
        self._collect(launched)

    def _collect(self, launched: InFlightStep, next_step: InFlightStep | None = None) -> None:
        """Read a launched step's tokens (waiting for the device) and hand them to their requests.

        If that fails, its requests end (their KV is in doubt), and so do the requests of
        ``next_step`` (launched after it) whose prefill read blocks it was to write."""
        waiting = time.perf_counter()
        try:
            token_ids = self.runner.collect(launched.handle)
        except Exception as error:  # noqa: BLE001 - contained to the requests concerned
            seqs, entries = launched.seqs, launched.cache_entries
            if next_step is not None and entries:
                doubtful = {block for _, block in entries}
                readers = [seq for seq in next_step.seqs if doubtful.intersection(seq.block_table)]
                held = {block for seq in readers for block in seq.block_table}
                seqs = seqs + readers
                entries = entries + [entry for entry in next_step.cache_entries if entry[1] in held]
            self._fail(seqs, entries, error, "reading a step's tokens")
            return
        finally:
            self._waited_s += time.perf_counter() - waiting
        self._append_tokens(launched.sampled, token_ids)

    def _append_tokens(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """Give each request its sampled token (and its log probabilities, where asked: the
        runner's ``StepTokens.logprobs``); stop those that are done; queue the outputs."""
        now = time.perf_counter()
        bm = self.block_manager
        for row, (seq, token_id) in enumerate(zip(seqs, token_ids)):
            if seq.is_finished:
                continue  # stopped (or aborted) after this step was launched: the token is dropped
            seq.num_pending -= 1
            seq.token_ids.append(token_id)
            bm.register_computed(seq, len(seq.token_ids) - 1)  # the new token's KV is not computed yet
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            try:
                if seq.logprobs is not None:
                    seq.logprobs.append(self._with_text(token_ids.logprobs[row]))
                prompt_logprobs = getattr(token_ids, "prompt_logprobs", None)
                if prompt_logprobs is not None and prompt_logprobs[row] is not None:
                    seq.prompt_logprobs = [None] + [self._with_text(p) for p in prompt_logprobs[row]]
                if seq.grammar is not None:
                    seq.grammar.accept(token_id)
                reason = self._stop_reason(seq, token_id)
            except Exception as error:  # noqa: BLE001 - e.g. a tokenizer failing on this output
                self._fail([seq], [], error, "processing an output token")
                continue
            if reason is not None:
                self._queue_output(self._end(seq, *reason))
            elif seq.request_id in self._streamed:
                self._outbox.append(self._partial_output(seq))

    def _with_text(self, position: dict) -> dict:
        """A position's ``Logprob``s with each token decoded alone (``decoded_token``)."""
        if self.tokenizer is not None:
            for token_id, logprob in position.items():
                logprob.decoded_token = self._token_text(token_id)
        return position

    def _stop_reason(self, seq: Sequence, token_id: int):
        """``(finish_reason, stop_reason)`` if ``seq`` is done after ``token_id``, else None.

        Stop tokens are checked first: a token that stops the request is not detokenized
        (it is not part of the text)."""
        params = seq.sampling_params
        num_output = len(seq.token_ids) - seq.num_prompt_tokens  # up to token_id: later ones may be pending
        if num_output >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return "stop", token_id
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return "stop", None
        detok = self._detokenizers.get(seq.request_id)
        if detok is not None:
            stop = detok.update(token_id)
            if stop is not None:
                return "stop", stop
        if seq.grammar is not None and seq.grammar.is_terminated:
            return "stop", None  # the output is complete (only its end token is allowed, even with ignore_eos)
        if num_output >= seq.max_tokens:
            return "length", None
        return None

    # -- ending requests ----------------------------------------------------
    def _end(self, seq: Sequence, reason: str, stop_reason=None) -> RequestOutput | None:
        """Finish ``seq`` (releasing its blocks) and return its final output; None if waiting for
        its compaction ended it with an error instead (that output is already queued)."""
        compressions = self.compressions
        if compressions is not None and compressions.is_compressing(seq):
            if seq in {task.seq for task in compressions.in_flight}:
                self._poll_compressions(wait=True)  # its blocks are being compacted: let that finish
            else:  # planned, never launched (the step failed before): nothing reads its blocks
                compressions.abandon([task for task in compressions.planned if task.seq is seq])
        if seq.is_finished:  # a failed poll above ended it
            return None
        self.scheduler.finish(seq, reason, stop_reason)
        return self._output(seq)

    def _fail(self, seqs: list[Sequence], cache_entries: list, error: BaseException, what: str) -> None:
        """End ``seqs`` with an error after ``what`` raised ``error``; withdraw the prefix-cache
        entries whose KV the failed work was to compute."""
        self.block_manager.withdraw(cache_entries)
        failed = [seq for seq in dict.fromkeys(seqs) if not seq.is_finished]
        logger.error("%s failed; ending request(s) %s", what, ", ".join(s.request_id for s in failed),
                     exc_info=(type(error), error, error.__traceback__))
        message = f"{what} failed: {type(error).__name__}: {error}"
        for seq in failed:
            seq.error = message
            if not seq.is_finished:
                self._queue_output(self._end(seq, "error"))
        self.stats.num_failed_requests += len(failed)

    def _forget_released(self) -> None:
        """Tell the runner which requests it no longer runs (their per-request state may go)."""
        released = self.scheduler.take_released()
        if released:
            self.runner.forget(released)

    def _queue_output(self, output: RequestOutput | None) -> None:
        if output is not None:
            self._outbox.append(output)

    def _take_outputs(self) -> list[RequestOutput]:
        outputs, self._outbox = self._outbox, []
        return outputs

    def _record(self, step: StepStats) -> None:
        es, bm = self.stats, self.block_manager
        es.num_steps += 1
        es.num_compressions += step.num_compressed
        es.compression_s += step.compression_s
        es.host_s += step.host_s
        es.peak_running = max(es.peak_running, step.num_running)
        es.occupancy.append((time.perf_counter() - self._start_time, bm.num_blocks - bm.num_free_blocks,
                             step.num_running))
        if self.step_log is not None:
            self.step_log.append(step)

    # -- outputs ------------------------------------------------------------
    def _partial_output(self, seq: Sequence) -> RequestOutput:
        """What a streamed, unfinished request produced since its previous output."""
        sent = self._streamed[seq.request_id]
        detok = self._detokenizers.get(seq.request_id)
        # Hold back what a stop string completed by later tokens could still cut off.
        text = detok.take(hold_back=max(len(s) for s in detok.stop) - 1 if detok.stop else 0) if detok else ""
        token_ids = seq.token_ids[seq.num_prompt_tokens + sent:].tolist()
        prompt_ids = seq.token_ids[:seq.num_prompt_tokens].tolist() if sent == 0 else []
        self._streamed[seq.request_id] = sent + len(token_ids)
        logprobs = seq.logprobs[sent:sent + len(token_ids)] if seq.logprobs is not None else None
        return RequestOutput(seq.request_id, seq.prompt, prompt_ids,
                             [CompletionOutput(0, text, token_ids, logprobs=logprobs)],
                             finished=False, metrics=seq.metrics,
                             prompt_logprobs=seq.prompt_logprobs if sent == 0 else None)

    def _output(self, seq: Sequence) -> RequestOutput:
        """The final output of a finished request (for a streamed one: only its new part)."""
        detok = self._detokenizers.pop(seq.request_id, None)
        self._requests.pop(seq.request_id, None)
        self._num_constrained -= seq.grammar is not None
        sent = self._streamed.pop(seq.request_id, None)
        if detok is not None:
            if not isinstance(seq.stop_reason, str):  # not cut at a stop string: release the tail too
                detok.flush()
            text = detok.take() if sent is not None else detok.text
        elif self.tokenizer is not None:
            ids = seq.output_token_ids
            if seq.finish_reason == "stop":
                ids = ids[:-1]  # the token that stopped the request is not part of the text
            text = self.tokenizer.decode(ids, skip_special_tokens=seq.sampling_params.skip_special_tokens)
        else:
            text = ""
        output_ids = seq.token_ids[seq.num_prompt_tokens + (sent or 0):].tolist()
        prompt_ids = seq.token_ids[:seq.num_prompt_tokens].tolist() if not sent else []
        logprobs = seq.logprobs[sent or 0:] if seq.logprobs is not None else None
        completion = CompletionOutput(0, text, output_ids, seq.finish_reason, seq.stop_reason, logprobs)
        return RequestOutput(seq.request_id, seq.prompt, prompt_ids, [completion], finished=True,
                             metrics=seq.metrics, error=seq.error,
                             prompt_logprobs=seq.prompt_logprobs if not sent else None)
