"""The engine behind the server: one background thread steps it; requests stream out.

``LLMEngine`` is not thread-safe, so only the engine thread touches it. The event
loop hands it work as commands (add these requests, abort those) that the thread
runs between steps, and the thread hands each step's outputs back to the loop,
where they land with the API call that asked for them (``Generation``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
import threading
import time
from typing import Callable

from zipage.engine.llm_engine import LLMEngine
from zipage.outputs import CompletionOutput, RequestOutput
from zipage.sampling_params import SamplingParams
from zipage.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class EngineOverloaded(Exception):
    """More requests wait than the queue allows."""


class EngineFailed(Exception):
    """The engine could not serve a call: it failed while stepping (the requests in flight were
    aborted), or it is shutting down. The message is safe to show a client: the cause goes to
    the log."""


class RequestFailed(EngineFailed):
    """One of a call's requests failed in the engine (a step that concerned it raised); the
    call's other requests are aborted, every other call carries on."""


class Generation:
    """The engine requests of one API call (prompts x choices) and their outputs, as they come.

    ``batches`` yields what arrived since the previous batch, one ``(choice index, RequestOutput)``
    per request with only its new text and tokens; iterating yields them one by one. A reader
    that falls behind the engine gets several steps merged into one output rather than a
    backlog, so a slow event loop formats and sends fewer, larger chunks.
    """

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.unfinished = set(request_ids)
        self.num_prompt_tokens: list[int] = []  # per request, set once they are added
        self.failed = False  # a request of it failed in the engine: the others were aborted
        self._ready: list = []  # outputs (or an error, last) delivered and not yet read
        self._wakeup: asyncio.Future | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hand over an output or an error (event loop)."""
        self._ready.append(item)
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def batches(self):
        while self.unfinished:
            while not self._ready:
                self._wakeup = asyncio.get_running_loop().create_future()
                await self._wakeup
            items, self._ready = self._ready, []
            grouped: dict[str, list[RequestOutput]] = {}
            error = None
            for item in items:
                if isinstance(item, BaseException):
                    error = item
                    break
                grouped.setdefault(item.request_id, []).append(item)
                if item.finished:
                    self.unfinished.discard(item.request_id)
            if grouped:
                yield [(self.index[rid], _merge(outputs)) for rid, outputs in grouped.items()]
            if error is not None:
                raise error

    async def __aiter__(self):
        async for batch in self.batches():
            for item in batch:
                yield item


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive streamed outputs of one request as one (joined once: linear in their size)."""
    if len(outputs) == 1:
        return outputs[0]
    first, last = outputs[0], outputs[-1]
    parts = [o.outputs[0] for o in outputs]
    completion = CompletionOutput(parts[-1].index, "".join(p.text for p in parts),
                                  [t for p in parts for t in p.token_ids], parts[-1].finish_reason,
                                  parts[-1].stop_reason,
                                  None if parts[0].logprobs is None else [lp for p in parts for lp in p.logprobs])
    return RequestOutput(last.request_id, last.prompt, first.prompt_token_ids or last.prompt_token_ids,
                         [completion], last.finished, last.metrics, last.error,
                         first.prompt_logprobs if first.prompt_logprobs is not None else last.prompt_logprobs)


def budget_label(engine: LLMEngine, seq) -> str:
    """A request's KV budget as a metrics label: "full" or its budget in tokens."""
    if seq.max_blocks is None:
        return "full"
    params, compression = seq.sampling_params, engine.config.compression
    return str(params.kv_budget_tokens or compression.kv_budget_tokens)


class AsyncEngine:
    """An ``LLMEngine`` stepped on its own thread, for many concurrent API calls.

    ``max_queued_requests`` bounds the requests waiting beyond the ``max_num_seqs`` the
    engine runs: a call is admitted (``admit``) only if every engine request it would add
    (prompts x choices) fits, else it is refused whole with ``EngineOverloaded``. Admitted
    calls count from admission, while their prompts are still being tokenized.

    Outputs are handed to the event loop at most every ``stream_interval`` seconds (a
    request's first token, its end, and the engine going idle at once), merged per request.
    The loop and the engine thread share the GIL, and the loop spends about 30 us of it per
    chunk (asyncio, Starlette, h11, the socket): at 48 streams, a chunk per step slowed a
    CPU engine's steps by about a quarter; 20 ms chunks cost a few per cent.

    A step's outputs are handed over during the next step, once its model run is under way on
    the device (``LLMEngine.step``'s ``async_callback``), as vLLM's asynchronous output
    processing does: the loop then formats and sends them while the engine thread waits for
    the device with the GIL released, rather than while it schedules and launches the step,
    where each of its GIL releases let the loop in (on a CPU reproduction of a GPU step with 64
    streams, about 61 -> 76 steps/s, as fast as the engine streams offline; docs/benchmarks.md).
    When the engine goes idle, or a step runs no model, they are handed over at once.

    ``switch_interval`` (seconds, None: leave it) is set as the interpreter's switch interval
    (``sys.setswitchinterval``) while the engine thread runs, and restored by ``stop``: a
    thread that wants the GIL back waits up to that long for the holder to let go. On a
    CPU reproduction of a GPU step, 0.1 ms did not step the engine faster than Python's
    5 ms (docs/benchmarks.md); the option is there to check that on a GPU.
    """

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None,
                 max_queued_requests: int = 1024, stream_interval: float = 0.0,
                 switch_interval: float | None = None):
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        if not stream_interval >= 0:
            raise ValueError(f"stream_interval must be >= 0, got {stream_interval}")
        if switch_interval is not None and not switch_interval > 0:
            raise ValueError(f"switch_interval must be > 0, got {switch_interval}")
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.max_queued_requests = max_queued_requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Condition()
        self._commands: list[tuple[Callable, asyncio.Future | None]] = []
        self._stopping = False
        self._outputs: list[RequestOutput] = []  # engine thread: this round's outputs
        self._held: list[RequestOutput] = []  # engine thread: outputs not yet handed to the loop
        self._last_delivery = 0.0
        self._flush_due = False  # engine thread: hand the held outputs over at the next chance
        self.stream_interval = stream_interval
        self.switch_interval = switch_interval
        self._saved_switch_interval: float | None = None
        # engine thread: request id -> [arrival, last token time, KV budget label]
        self._timing: dict[str, list] = {}
        self._budget_labels: set[str] = set()  # of the running-requests gauge's last update
        self._generations: dict[str, Generation] = {}  # event loop: request id -> its API call
        self._admitted = 0  # event loop: engine requests of admitted calls not yet added
        # Every request the engine runs or queues, and those admitted: past this, calls are refused.
        self.capacity = engine.config.scheduler.max_num_seqs + max_queued_requests
        self.num_running = 0  # published by the engine thread after every step
        bm = engine.block_manager
        self.metrics.kv_blocks_total.set(bm.num_blocks)

    # -- life cycle ---------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will await the results."""
        self._loop = asyncio.get_running_loop()
        # What exists now (model, tokenizer, app) lives as long as the server: keep it out of the
        # garbage collector's full passes, which otherwise walk it again and again while serving.
        gc.collect()
        gc.freeze()
        if self.switch_interval is not None:
            self._saved_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_interval)
        self._thread = threading.Thread(target=self._run, name="zipage-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        self._fail_all(EngineFailed("the server is shutting down"))
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None
        gc.unfreeze()  # what start froze may go again (and extension modules tear down cleanly)

    @property
    def alive(self) -> bool:
        """The engine thread runs and the engine can still run steps."""
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    @property
    def failure(self) -> str | None:
        """Why the engine can run no more steps (``LLMEngine.failure``), or None."""
        return getattr(self.engine, "failure", None)

    # -- called from the event loop -------------------------------------------
    async def call(self, fn: Callable):
        """Run ``fn()`` on the engine thread between steps and return its result."""
        future = self._loop.create_future()
        self._submit(fn, future)
        return await future

    def call_threadsafe(self, fn: Callable, timeout: float = 30.0):
        """``call`` from a thread other than the event loop's (tests, tools): block for the result."""
        return asyncio.run_coroutine_threadsafe(self.call(fn), self._loop).result(timeout)

    def admit(self, num_requests: int) -> Admission:
        """Hold places for a call's ``num_requests`` engine requests until ``generate`` adds them
        (or the returned ``Admission`` is closed); ``EngineOverloaded`` if they do not all fit,
        ``EngineFailed`` if the engine can run no more steps (``failure``)."""
        if self.failure is not None:
            raise EngineFailed(f"the engine can run no more steps: {self.failure}")
        held = len(self._generations) + self._admitted
        if held + num_requests > self.capacity:
            self.metrics.rejected.inc()
            raise EngineOverloaded(
                f"the call adds {num_requests} request(s) to {held} running or queued; the server holds at most "
                f"{self.capacity} (max_num_seqs={self.engine.config.scheduler.max_num_seqs} + "
                f"max_queued_requests={self.max_queued_requests})")
        self._admitted += num_requests
        return Admission(self, num_requests)

    async def generate(self, prompts: list, params: list[SamplingParams], request_ids: list[str],
                       admission: Admission | None = None) -> Generation:
        """Add one request per prompt (token ids; all or none) and return their ``Generation``.

        The call must be admitted (``admit``, or ``admission`` None: admitted here). Raises
        ``ValueError`` for a bad prompt (nothing is added) and ``EngineOverloaded`` when the
        queue is full.
        """
        if admission is None:
            admission = self.admit(len(request_ids))
        admission.close()  # its places pass to the requests, counted below from now on
        generation = Generation(request_ids)
        for rid in request_ids:  # before they are added, so that no output is missed
            self._generations[rid] = generation
        arrival = time.perf_counter()

        def add():
            engine = self.engine
            seqs = [engine.prepare_request(prompt, sp, rid) for prompt, sp, rid in zip(prompts, params, request_ids)]
            for seq in seqs:
                engine.add_sequence(seq, stream=True)
                self._timing[seq.request_id] = [arrival, None, budget_label(engine, seq)]
                self.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
            return [seq.num_prompt_tokens for seq in seqs]

        try:
            generation.num_prompt_tokens = await self.call(add)
        except BaseException as error:
            for rid in request_ids:
                self._generations.pop(rid, None)
            if not isinstance(error, ValueError):  # cancelled: the requests may have been added
                self.abort(request_ids)
            raise
        return generation

    def abort(self, request_ids) -> None:
        """Abort requests (finished or unknown ones are skipped); their blocks are freed before the
        next step. O(1) per request here and on the engine thread."""
        request_ids = list(request_ids)
        for rid in request_ids:
            self._generations.pop(rid, None)

        def abort():
            for rid in request_ids:
                output = self.engine.abort_request(rid)
                if output is not None:
                    self._outputs.append(output)

        with contextlib.suppress(EngineFailed):  # shutting down: the engine thread frees everything
            self._submit(abort, None)

    def _submit(self, fn: Callable, future: asyncio.Future | None) -> None:
        with self._wake:
            if self._stopping:
                raise EngineFailed("the server is shutting down")
            self._commands.append((fn, future))
            self._wake.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            generation = self._generations.get(output.request_id)
            if generation is None:
                continue  # aborted: nobody listens
            if output.error is not None:
                self._fail_generation(generation, output.request_id)
                continue
            generation.put(output)
            if output.finished:
                del self._generations[output.request_id]

    def _fail_generation(self, generation: Generation, request_id: str) -> None:
        """End an API call whose request ``request_id`` failed in the engine; abort its others
        (once: a step that fails all of a call's requests costs O(1) per request)."""
        self._generations.pop(request_id, None)
        if generation.failed:
            return
        generation.failed = True
        self.abort([rid for rid in generation.request_ids if self._generations.get(rid) is generation])
        generation.put(RequestFailed(f"internal error (request {request_id})"))

    def _fail_all(self, error: Exception) -> None:
        for generation in set(self._generations.values()):
            generation.put(error)
        self._generations.clear()

    # -- the engine thread ----------------------------------------------------
    def _run(self) -> None:
        failure = EngineFailed("the server is shutting down")
        try:
            self._serve()
        except BaseException as error:  # a bug outside a step: stop, but answer everyone first
            logger.exception("the engine thread stopped")
            failure = EngineFailed("internal error: the engine stopped")
        with self._wake:
            self._stopping = True  # no more commands are taken
            commands, self._commands = self._commands, []
        for _, future in commands:
            if future is not None:
                self._loop.call_soon_threadsafe(_resolve, future, None, failure)
        self._loop.call_soon_threadsafe(self._fail_all, failure)
        for rid in list(self._timing):  # free everything
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                logger.exception("could not abort request %s", rid)
        self._timing.clear()

    def _serve(self) -> None:
        engine = self.engine
        busy = False
        while True:
            with self._wake:
                while not (self._commands or busy or self._stopping):
                    self._wake.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            for fn, future in commands:
                try:
                    result, error = fn(), None
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    result, error = None, e
                    if future is None:
                        logger.exception("engine command failed")
                if future is not None:
                    self._loop.call_soon_threadsafe(_resolve, future, result, error)
            if engine.has_unfinished_requests():
                try:
                    outputs, stats = engine.step(async_callback=self._flush_if_due)
                except Exception as error:  # noqa: BLE001 - keep serving the next requests
                    logger.exception("engine step failed; aborting the requests in flight")
                    self._flush()
                    self._recover(error)
                else:
                    self._outputs.extend(outputs)
                    if stats is not None:
                        self.metrics.compressions.inc(stats.num_compressed)
                        self.metrics.preemptions.inc(stats.num_preempted)
            busy = engine.has_unfinished_requests()
            outputs, self._outputs = self._outputs, []
            urgent = self._observe(outputs)
            self._held.extend(outputs)
            if not busy or self._flush_due:  # idle, or the step ran no model to hand them over in
                self._flush()
            elif urgent or time.perf_counter() - self._last_delivery >= self.stream_interval:
                self._flush_due = True  # handed over in the next step, while the device runs it

    def _flush_if_due(self) -> None:
        """The engine step's callback once its model run is under way on the device."""
        if self._flush_due:
            self._flush()

    def _flush(self) -> None:
        """Hand the held outputs to the event loop, in one callback."""
        self._flush_due = False
        if self._held:
            held, self._held = self._held, []
            self._last_delivery = time.perf_counter()
            self._loop.call_soon_threadsafe(self._deliver, held)

    def _recover(self, error: Exception) -> None:
        for rid in list(self._timing):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                logger.exception("could not abort request %s", rid)
        self._timing.clear()
        failure = EngineFailed("internal error: the engine failed a step; the requests in flight were aborted")
        self._loop.call_soon_threadsafe(self._fail_all, failure)

    def _observe(self, outputs: list[RequestOutput]) -> bool:
        """Update the metrics after a round (engine thread); True if a request got its first token or ended."""
        m, now = self.metrics, time.perf_counter()
        urgent = False
        for output in outputs:
            timing = self._timing.get(output.request_id)
            if timing is None:
                continue
            new_tokens = len(output.outputs[0].token_ids)
            if new_tokens:
                m.generation_tokens.inc(new_tokens)
                m.generation_tokens_by_budget.labels(timing[2]).inc(new_tokens)
                if timing[1] is None:
                    m.ttft.observe(now - timing[0])
                    urgent = True
                else:
                    m.itl.observe((now - timing[1]) / new_tokens)
                timing[1] = now
            if output.finished:
                urgent = True
                del self._timing[output.request_id]
                m.finished.labels(output.outputs[0].finish_reason).inc()
                m.latency.observe(now - timing[0])
                m.finished_by_budget.labels(timing[2]).inc()
                if output.metrics is not None:
                    m.compressions_by_budget.labels(timing[2]).inc(output.metrics.num_compressions)
                    m.evicted_by_budget.labels(timing[2]).inc(output.metrics.evicted_tokens)
        scheduler, bm = self.engine.scheduler, self.engine.block_manager
        self.num_running = len(scheduler.running)
        by_budget: dict[str, int] = dict.fromkeys(self._budget_labels, 0)
        for seq in scheduler.running:
            label = budget_label(self.engine, seq)
            by_budget[label] = by_budget.get(label, 0) + 1
        for label, count in by_budget.items():  # labels seen before and now gone read 0
            m.running_by_budget.labels(label).set(count)
        self._budget_labels = set(by_budget)
        used = bm.num_blocks - bm.num_free_blocks
        m.set_load(self.num_running, len(scheduler.waiting), used / bm.num_blocks)
        m.kv_blocks_used.set(used)
        return urgent


class Admission:
    """Places held in an ``AsyncEngine``'s queue for a call's requests until ``generate`` adds
    them; closing it (or leaving its ``with`` block) gives back what was not used."""

    def __init__(self, engine: AsyncEngine, num_requests: int):
        self.engine, self.num_requests = engine, num_requests

    def close(self) -> None:
        self.engine._admitted -= self.num_requests
        self.num_requests = 0

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _resolve(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.done():  # the caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
