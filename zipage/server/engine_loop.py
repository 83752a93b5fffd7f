"""The engine side of the server: the loop that steps an ``LLMEngine`` between the API's commands.

``EngineLoop`` runs on a thread of the server's process, or as the main thread of an engine
process of its own (``engine_process.py``); either way only it touches the engine. It talks
to the API side (``AsyncEngine``) in messages, plain tuples that pickle:

- commands in: ``("add", token, [(prompt token ids, SamplingParams, request id), ...])``,
  ``("abort", None, [request ids])``, ``("call", token, fn, args, with_engine)``;
- messages out: ``("reply", token, result, error)`` for a command with a token,
  ``("outputs", rounds, load)`` with the steps' outputs, ``("failed", why)`` when the
  requests in flight were all aborted (a step failed, or the loop stopped).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

STOPPED = "the server is shutting down"


class EngineFailed(Exception):
    """The engine could not serve a call: it failed while stepping (the requests in flight were
    aborted), or it is shutting down. The message is safe to show a client: the cause goes to
    the log."""


def budget_label(engine, seq) -> str:
    """A request's KV budget as a metrics label: "full" or its budget in tokens."""
    if seq.max_blocks is None:
        return "full"
    params, compression = seq.sampling_params, engine.config.compression
    return str(params.kv_budget_tokens or compression.kv_budget_tokens)


class EngineLoop:
    """Steps ``engine`` while it has requests, runs commands between steps, and ``emit``s outputs.

    Outputs are emitted at most every ``stream_interval`` seconds (a request's first token, its
    end, and the engine going idle at once), each round's with the time it ended. A step's
    outputs are emitted during the next step, once its model run is under way on the device
    (``LLMEngine.step``'s ``async_callback``), as vLLM's asynchronous output processing does:
    the API side then formats and sends them while the engine waits for the device. When the
    engine goes idle, or a step runs no model, they are emitted at once.

    With every emission goes the engine's load (``load``): running and waiting requests, KV
    blocks in use, running requests by KV budget, and the compressions and preemptions since
    the last one.
    """

    def __init__(self, engine, emit: Callable[[tuple], None], stream_interval: float = 0.0):
        self.engine = engine
        self.emit = emit
        self.stream_interval = stream_interval
        self._wake = threading.Condition()
        self._commands: list[tuple] = []
        self._stopping = False
        self.why_stopped = STOPPED  # what the requests in flight are told when the loop stops
        self._outputs: list = []  # this round's outputs (a step's, and those of aborts)
        self._held: list[tuple[float, list]] = []  # rounds not yet emitted: (end time, outputs)
        self._counts = [0, 0]  # compressions, preemptions since the last emission
        self._last_emission = 0.0
        self._emit_due = False  # emit the held rounds at the next chance
        self._waiting_first: set[str] = set()  # requests in the engine with no token yet
        self._requests: set[str] = set()  # every request added and not yet finished

    # -- any thread -----------------------------------------------------------
    def submit(self, command: tuple) -> bool:
        """Queue a command for the next pause between steps; False once the loop is stopping."""
        with self._wake:
            if self._stopping:
                return False
            self._commands.append(command)
            self._wake.notify()
            return True

    def stop(self, why: str = STOPPED) -> None:
        """Stop after the step under way; ``why`` is what the requests in flight are told."""
        with self._wake:
            if not self._stopping:
                self.why_stopped = why
            self._stopping = True
            self._wake.notify()

    # -- the engine's thread ----------------------------------------------------
    def run(self) -> None:
        """Serve until ``stop``; then answer the commands left and free every request."""
        try:
            self._serve()
            failure = self.why_stopped
        except BaseException:  # a bug outside a step: stop, but answer everyone first
            logger.exception("the engine loop stopped")
            failure = self.why_stopped = "internal error: the engine stopped"
        with self._wake:
            self._stopping = True  # no more commands are taken
            commands, self._commands = self._commands, []
        for command in commands:
            if command[1] is not None:
                self._reply(command[1], None, EngineFailed(failure))
        self._abort_all()
        self.emit(("failed", failure))

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
            for command in commands:
                self._execute(command)
            if engine.has_unfinished_requests():
                try:
                    outputs, stats = engine.step(async_callback=self._emit_if_due)
                except Exception:  # noqa: BLE001 - keep serving the next requests
                    logger.exception("engine step failed; aborting the requests in flight")
                    self._emit_held()
                    self._abort_all()
                    self.emit(("failed", "internal error: the engine failed a step; the requests in flight "
                                         "were aborted"))
                else:
                    self._outputs.extend(outputs)
                    if stats is not None:
                        self._counts[0] += stats.num_compressed
                        self._counts[1] += stats.num_preempted
            busy = engine.has_unfinished_requests()
            outputs, self._outputs = self._outputs, []
            urgent = self._track(outputs)
            if outputs:
                self._held.append((time.perf_counter(), outputs))
            if not busy or self._emit_due:  # idle, or the step ran no model to emit them in
                self._emit_held(always=not busy)
            elif urgent or time.perf_counter() - self._last_emission >= self.stream_interval:
                self._emit_due = True  # emitted in the next step, while the device runs it

    def _execute(self, command: tuple) -> None:
        kind, token = command[0], command[1]
        try:
            if kind == "add":
                result = self._add(command[2])
            elif kind == "abort":
                result = self._abort(command[2])
            elif kind == "call":
                fn, args, with_engine = command[2:]
                result = fn(self.engine, *args) if with_engine else fn(*args)
            else:
                raise ValueError(f"unknown engine command {kind!r}")
        except Exception as error:  # noqa: BLE001 - handed to the caller
            if token is None:
                logger.exception("engine command %s failed", kind)
            else:
                self._reply(token, None, error)
        else:
            if token is not None:
                self._reply(token, result, None)

    def _reply(self, token: int, result, error) -> None:
        self.emit(("reply", token, result, error))

    def _add(self, requests: list[tuple]) -> list[tuple[int, str]]:
        """Add requests (all or none: each is checked first); their prompt lengths and budget labels."""
        engine = self.engine
        seqs = [engine.prepare_request(prompt, params, rid) for prompt, params, rid in requests]
        for seq in seqs:
            engine.add_sequence(seq, stream=True)
            self._requests.add(seq.request_id)
            self._waiting_first.add(seq.request_id)
        return [(seq.num_prompt_tokens, budget_label(engine, seq)) for seq in seqs]

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            output = self.engine.abort_request(rid)
            if output is not None:
                self._outputs.append(output)

    def _abort_all(self) -> None:
        """Free every request in the engine (after a failed step, or when the loop stops)."""
        for rid in list(self._requests):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                logger.exception("could not abort request %s", rid)
        self._requests.clear()
        self._waiting_first.clear()
        self._outputs.clear()

    def _track(self, outputs: list) -> bool:
        """Note the round's first tokens and ends; True if there was one (emitted at once)."""
        urgent = False
        for output in outputs:
            rid = output.request_id
            if rid in self._waiting_first and output.outputs[0].token_ids:
                self._waiting_first.discard(rid)
                urgent = True
            if output.finished:
                urgent = True
                self._requests.discard(rid)
                self._waiting_first.discard(rid)
        return urgent

    def _emit_if_due(self) -> None:
        """The engine step's callback once its model run is under way on the device."""
        if self._emit_due:
            self._emit_held()

    def _emit_held(self, always: bool = False) -> None:
        """Emit the held rounds with the engine's load, in one message (if any, or ``always``)."""
        self._emit_due = False
        if not (self._held or always):
            return
        held, self._held = self._held, []
        self._last_emission = time.perf_counter()
        self.emit(("outputs", held, self._load()))

    def _load(self) -> dict:
        engine = self.engine
        scheduler, manager = engine.scheduler, engine.block_manager
        by_budget: dict[str, int] = {}
        for seq in scheduler.running:
            label = budget_label(engine, seq)
            by_budget[label] = by_budget.get(label, 0) + 1
        compressions, preemptions = self._counts
        self._counts = [0, 0]
        return {"running": len(scheduler.running), "waiting": len(scheduler.waiting),
                "kv_blocks_used": manager.num_blocks - manager.num_free_blocks, "by_budget": by_budget,
                "compressions": compressions, "preemptions": preemptions, "failure": engine.failure}
