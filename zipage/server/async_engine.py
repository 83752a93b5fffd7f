"""The API side of the engine: calls' requests go in as commands, their outputs stream out.

``LLMEngine`` is not thread-safe, so only its ``EngineLoop`` touches it, on a thread of
this process or in an engine process of its own (``engine_process.py``). The event loop
hands it work as commands (add these requests, abort those) that it runs between steps,
and it hands each step's outputs back to the event loop, where they land with the API call
that asked for them (``Generation``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import sys
import threading
import time
from typing import Callable

from zipage.outputs import CompletionOutput, RequestOutput
from zipage.sampling_params import SamplingParams
from zipage.server.engine_loop import STOPPED, EngineFailed, EngineLoop
from zipage.server.engine_process import EngineProcess, EngineProcessError
from zipage.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class EngineOverloaded(Exception):
    """More requests wait than the queue allows."""


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


class AsyncEngine:
    """An engine stepped by an ``EngineLoop``, for many concurrent API calls: on a thread of this
    process (``engine`` an ``LLMEngine``), or in a process of its own (an ``EngineProcess``).

    The loop runs the calls' commands (add these requests, abort those) between steps and hands
    back each round's outputs, which land here, on the event loop, with the API call that asked
    for them (``Generation``); the metrics are updated here too, from the outputs and the load
    the loop sends with them.

    ``max_queued_requests`` bounds the requests waiting beyond the ``max_num_seqs`` the
    engine runs: a call is admitted (``admit``) only if every engine request it would add
    (prompts x choices) fits, else it is refused whole with ``EngineOverloaded``. Admitted
    calls count from admission, while their prompts are still being tokenized.

    Outputs are handed over at most every ``stream_interval`` seconds (a request's first token,
    its end, and the engine going idle at once), merged per request, during the engine's next
    step (see ``EngineLoop``). With the engine on a thread here, the loop and the engine thread
    share the GIL, and the loop spends about 30 us of it per chunk (asyncio, Starlette, h11, the
    socket): at 48 streams, a chunk per step slowed a CPU engine's steps by about a quarter;
    20 ms chunks cost a few per cent. An engine process has an interpreter of its own.

    ``switch_interval`` (seconds, None: leave it) is set as the interpreter's switch interval
    (``sys.setswitchinterval``) of the process the engine loop runs in while it runs (restored
    by ``stop`` when that is this one): a thread that wants the GIL back waits up to that long
    for the holder to let go.
    """

    def __init__(self, engine, metrics: ServerMetrics | None = None,
                 max_queued_requests: int = 1024, stream_interval: float = 0.0,
                 switch_interval: float | None = None):
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        if not stream_interval >= 0:
            raise ValueError(f"stream_interval must be >= 0, got {stream_interval}")
        if switch_interval is not None and not switch_interval > 0:
            raise ValueError(f"switch_interval must be > 0, got {switch_interval}")
        self.engine = engine
        self.process: EngineProcess | None = engine if isinstance(engine, EngineProcess) else None
        self.metrics = metrics or ServerMetrics()
        self.max_queued_requests = max_queued_requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_loop: EngineLoop | None = None  # on a thread of this process
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.stream_interval = stream_interval
        self.switch_interval = switch_interval
        self._saved_switch_interval: float | None = None
        self._tokens = itertools.count()
        self._pending: dict[int, tuple[asyncio.Future, Callable | None]] = {}  # command token -> its caller
        self._timing: dict[str, list] = {}  # request id -> [arrival, last token time, KV budget label]
        self._budget_labels: set[str] = set()  # of the running-requests gauge's last update
        self._generations: dict[str, Generation] = {}  # request id -> its API call
        self._admitted = 0  # engine requests of admitted calls not yet added
        # Every request the engine runs or queues, and those admitted: past this, calls are refused.
        self.capacity = engine.config.scheduler.max_num_seqs + max_queued_requests
        self.num_running = 0  # as the engine loop last said
        self._exited: str | None = None  # the engine process ended: why
        num_blocks = self.process.num_blocks if self.process is not None else engine.block_manager.num_blocks
        self.metrics.kv_blocks_total.set(num_blocks)
        self._num_blocks = num_blocks

    # -- life cycle ---------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop; call from the event loop that will await the results."""
        self._loop = asyncio.get_running_loop()
        # What exists now (model, tokenizer, app) lives as long as the server: keep it out of the
        # garbage collector's full passes, which otherwise walk it again and again while serving.
        gc.collect()
        gc.freeze()
        if self.process is not None:
            self.process.start(self._from_thread, self.stream_interval, self.switch_interval)
            return
        if self.switch_interval is not None:
            self._saved_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_interval)
        self._engine_loop = EngineLoop(self.engine, self._from_thread, self.stream_interval)
        self._thread = threading.Thread(target=self._engine_loop.run, name="zipage-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout: float = 30.0) -> None:
        self._stopped = True
        if self.process is not None:
            await asyncio.to_thread(self.process.close, timeout)
        elif self._engine_loop is not None:
            self._engine_loop.stop()
            await asyncio.to_thread(self._thread.join, timeout)
        await asyncio.sleep(0)  # the loop's last messages, handed over with call_soon_threadsafe
        self._fail_all(EngineFailed(STOPPED))
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None
        gc.unfreeze()  # what start froze may go again (and extension modules tear down cleanly)

    @property
    def alive(self) -> bool:
        """The engine loop runs and the engine can still run steps."""
        if self.failure is not None:
            return False
        if self.process is not None:
            return self._exited is None and self.process.alive
        return self._thread is not None and self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the engine can run no more steps (``LLMEngine.failure``, or its process ended), or None."""
        if self.process is not None:
            return self._exited or self.process.failure
        return getattr(self.engine, "failure", None)

    # -- called from the event loop -------------------------------------------
    async def call(self, fn: Callable, *args):
        """Run ``fn(*args)`` where the engine runs, between steps, and return its result (with an
        engine process, ``fn`` and ``args`` must pickle: a module-level function)."""
        return await self._command("call", fn, args, False)

    async def call_engine(self, fn: Callable, *args):
        """``fn(engine, *args)`` where the engine runs, between steps (see ``call``)."""
        return await self._command("call", fn, args, True)

    def call_threadsafe(self, fn: Callable, timeout: float = 30.0):
        """``call`` from a thread other than the event loop's (tests, tools): block for the result."""
        return asyncio.run_coroutine_threadsafe(self.call(fn), self._loop).result(timeout)

    def call_engine_threadsafe(self, fn: Callable, *args, timeout: float = 30.0):
        """``call_engine`` from a thread other than the event loop's: block for the result."""
        return asyncio.run_coroutine_threadsafe(self.call_engine(fn, *args), self._loop).result(timeout)

    async def _command(self, kind: str, *payload, on_result: Callable | None = None):
        token = next(self._tokens)
        future = self._loop.create_future()
        self._pending[token] = (future, on_result)
        try:
            self._send((kind, token, *payload))
        except BaseException:
            self._pending.pop(token, None)
            raise
        return await future

    def _send(self, command: tuple) -> None:
        if self._stopped:
            raise EngineFailed(STOPPED)
        if self.process is not None:
            try:
                self.process.send(command)
            except EngineProcessError as error:
                raise EngineFailed(str(error)) from None
        elif self._engine_loop is None or not self._engine_loop.submit(command):
            raise EngineFailed(STOPPED)

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
        arrival = time.perf_counter()
        for rid in request_ids:  # before they are added, so that no output is missed
            self._generations[rid] = generation
            self._timing[rid] = [arrival, None, None]

        def added(result) -> None:  # on the event loop, before any output of theirs
            for rid, (num_prompt_tokens, label) in zip(request_ids, result):
                timing = self._timing.get(rid)
                if timing is not None:
                    timing[2] = label
                self.metrics.prompt_tokens.inc(num_prompt_tokens)

        try:
            result = await self._command("add", list(zip(prompts, params, request_ids)), on_result=added)
        except BaseException as error:
            for rid in request_ids:
                self._generations.pop(rid, None)
                self._timing.pop(rid, None)
            if not isinstance(error, ValueError):  # cancelled: the requests may have been added
                self.abort(request_ids)
            raise
        generation.num_prompt_tokens = [n for n, _ in result]
        return generation

    def abort(self, request_ids) -> None:
        """Abort requests (finished or unknown ones are skipped); their blocks are freed before the
        next step. O(1) per request here and in the engine loop."""
        request_ids = list(request_ids)
        for rid in request_ids:
            self._generations.pop(rid, None)
        with contextlib.suppress(EngineFailed):  # shutting down: the engine loop frees everything
            self._send(("abort", None, request_ids))

    # -- messages from the engine loop ----------------------------------------------------
    def _from_thread(self, message: tuple) -> None:
        """A message of the engine loop, from its thread or the engine process's reader thread."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the event loop closed meanwhile
                loop.call_soon_threadsafe(self._on_message, message)

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            rounds, load = message[1], message[2]
            self._observe(rounds, load)
            for _, outputs in rounds:
                self._deliver(outputs)
        elif kind == "reply":
            _, token, result, error = message
            future, on_result = self._pending.pop(token, (None, None))
            if future is None or future.done():  # the caller went away
                return
            if error is not None:
                future.set_exception(error)
                return
            if on_result is not None:
                on_result(result)
            future.set_result(result)
        elif kind == "failed":
            self._fail_all(EngineFailed(message[1]))
        elif kind == "exited":
            self._exited = message[1] or STOPPED
            for future, _ in self._pending.values():
                if not future.done():
                    future.set_exception(EngineFailed(self._exited))
            self._pending.clear()
            self._fail_all(EngineFailed(f"the engine can run no more steps: {self._exited}"))

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
        self._timing.clear()

    def _observe(self, rounds: list[tuple[float, list[RequestOutput]]], load: dict) -> None:
        """Update the metrics with the rounds' outputs (each at the time its round ended) and the load."""
        m = self.metrics
        for now, outputs in rounds:
            for output in outputs:
                timing = self._timing.get(output.request_id)
                if timing is None:
                    continue
                new_tokens = len(output.outputs[0].token_ids)
                label = timing[2] or "full"
                if new_tokens:
                    m.generation_tokens.inc(new_tokens)
                    m.generation_tokens_by_budget.labels(label).inc(new_tokens)
                    if timing[1] is None:
                        m.ttft.observe(now - timing[0])
                    else:
                        m.itl.observe((now - timing[1]) / new_tokens)
                    timing[1] = now
                if output.finished:
                    del self._timing[output.request_id]
                    m.finished.labels(output.outputs[0].finish_reason).inc()
                    m.latency.observe(now - timing[0])
                    m.finished_by_budget.labels(label).inc()
                    if output.metrics is not None:
                        m.compressions_by_budget.labels(label).inc(output.metrics.num_compressions)
                        m.evicted_by_budget.labels(label).inc(output.metrics.evicted_tokens)
        m.compressions.inc(load["compressions"])
        m.preemptions.inc(load["preemptions"])
        self.num_running = load["running"]
        by_budget: dict[str, int] = dict.fromkeys(self._budget_labels, 0)
        by_budget.update(load["by_budget"])
        for label, count in by_budget.items():  # labels seen before and now gone read 0
            m.running_by_budget.labels(label).set(count)
        self._budget_labels = set(by_budget)
        m.set_load(self.num_running, load["waiting"], load["kv_blocks_used"] / self._num_blocks)
        m.kv_blocks_used.set(load["kv_blocks_used"])


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

