"""An engine in a process of its own, so that the API's work does not share its interpreter.

In one process the engine's thread and the event loop that parses requests and formats 128
streams' chunks share the GIL: each waits for the other, and a mixed step's launches take
longer than they do offline. ``EngineProcess`` builds the engine in a child process (the
``spawn`` start method, safe with CUDA) and steps it there with ``EngineLoop``; the API side
(``AsyncEngine``) exchanges the loop's messages with it through a pipe, read on a thread of
the server's process. vLLM's API server and engine core are split the same way.

The server's process keeps what the API needs without the engine: the tokenizer (loaded
again here), the engine's configuration, the longest prompt it takes, and a grammar compiler
for checking structured outputs before a request is sent.

If the engine process dies, every call in flight gets an error, ``/health`` answers 503,
and new calls are refused; the server does not restart it. If the server's process dies,
the engine process sees its pipe close and exits.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import pickle
import signal
import sys
import threading
import time
from typing import Callable

from zipage.server.engine_loop import STOPPED, EngineLoop

logger = logging.getLogger(__name__)


class EngineProcessError(RuntimeError):
    """The engine process could not be started, or stopped."""


# What the engine's build may raise that the server raises as it is (as building it here would).
_BUILD_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


def build_llm_engine(model: str, kwargs: dict):
    """The engine of ``LLM(model, **kwargs)`` (the default factory of an ``EngineProcess``)."""
    from zipage import LLM

    return LLM(model, **kwargs).engine


class EngineProcess:
    """``factory(*args)`` (a module-level function that builds an ``LLMEngine``) run in a child
    process, ready to serve once this returns; ``startup_timeout`` bounds the build (seconds).

    A ``ValueError`` or ``FileNotFoundError`` of the build (a bad option or path) is raised here
    as one; any other failure as ``EngineProcessError``, with its message. Hand it to
    ``create_app`` (or ``AsyncEngine``) in place of an engine; ``close`` stops it (the app does,
    when it stops).

    The child is spawned, so it imports the main script: a script that makes one guards its
    entry point with ``if __name__ == "__main__":``.
    """

    def __init__(self, factory: Callable = build_llm_engine, args: tuple = (), startup_timeout: float = 3600.0,
                 log_level: int | None = None):
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
        # Not a daemon: a tensor-parallel engine starts processes of its own.
        self.process = context.Process(target=_child_main, args=(child_conn, factory, args, level),
                                       name="zipage-engine", daemon=False)
        self.process.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._grammar_lock = threading.Lock()
        self._grammar_compiler = None
        self._reader: threading.Thread | None = None
        self.failure: str | None = None  # why the engine can run no more steps, as it last said
        self.exited = False  # the pipe closed: the process ended
        self._closed = False
        # Closed at the latest when this interpreter exits: multiprocessing would otherwise wait there
        # for a child that waits for its server (an app that never started, a script that forgot).
        atexit.register(self.close)
        try:
            info = self._await_ready(startup_timeout)
        except BaseException:
            self._kill()
            self._closed = self.exited = True
            self._conn.close()
            atexit.unregister(self.close)
            raise
        try:
            self.config = info["config"]
            self.max_prompt_tokens = info["max_prompt_tokens"]
            self.num_blocks = info["num_blocks"]
            self.vocab_size = info["vocab_size"]
            self.eos_token_ids = info["eos_token_ids"]
            self.supports_structured_outputs = info["supports_structured_outputs"]
            self.runner_name = info["runner"]
            from zipage.utils.loader import load_tokenizer

            self.tokenizer = load_tokenizer(self.config.model, self.config.trust_remote_code)
        except BaseException:
            self.close()
            raise

    def _await_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.5):
            if not self.process.is_alive():
                raise EngineProcessError(f"the engine process exited (exit code {self.process.exitcode}) "
                                         "before the engine was built; its log says why")
            if time.monotonic() > deadline:
                raise EngineProcessError(f"the engine process did not build the engine within {timeout:g} s")
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise EngineProcessError(f"the engine process exited (exit code {self.process.exitcode}) "
                                     "before the engine was built; its log says why") from None
        if message[0] == "error":
            _, kind, text = message
            raise _BUILD_ERRORS.get(kind, EngineProcessError)(text)
        return message[1]

    # -- what the API side asks of an engine ---------------------------------------
    def grammar_compiler(self):
        """A ``zipage.structured.GrammarCompiler`` like the engine's, to check a request's grammar
        here (the engine process compiles its own)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from zipage.structured import grammar_compiler_for

                self._grammar_compiler = grammar_compiler_for(
                    self.runner_name, self.supports_structured_outputs, self.tokenizer, self.vocab_size,
                    self.eos_token_ids, self.config.structured_outputs_disable_any_whitespace)
            return self._grammar_compiler

    @property
    def alive(self) -> bool:
        return not self.exited and self.process.is_alive()

    # -- the channel ------------------------------------------------------------------
    def start(self, on_message: Callable[[tuple], None], stream_interval: float,
              switch_interval: float | None) -> None:
        """Start the engine loop, with ``on_message`` called (on a reader thread) for each of its
        messages, then once with ``("exited", why)`` when the process has ended."""
        self.send(("start", stream_interval, switch_interval))
        self._reader = threading.Thread(target=self._read, args=(on_message,), name="zipage-engine-reader",
                                        daemon=True)
        self._reader.start()

    def send(self, command: tuple) -> None:
        """Send a command to the engine loop; ``EngineProcessError`` if the process has gone."""
        if self.exited:
            raise EngineProcessError(f"the engine process has exited: {self.failure or STOPPED}")
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)  # a bad command fails here, not in the pipe
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError) as error:
            raise EngineProcessError(f"the engine process has exited: {error}") from None

    def _read(self, on_message: Callable[[tuple], None]) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - a message that does not load (read whole): the next one
                logger.exception("a message of the engine process could not be read")
                continue
            if message[0] == "outputs":
                self.failure = message[2]["failure"]
            if message[0] == "stopped":
                self.failure = message[1]
                break
            on_message(message)
        self.process.join(10)
        code = self.process.exitcode
        if code not in (0, None):
            self.failure = f"the engine process exited (exit code {code})"
            logger.error("%s", self.failure)
        self.exited = True  # after the join: a caller seeing it finds the exit code
        on_message(("exited", self.failure))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine loop and wait for the process to end (killed after ``timeout`` s); again: nothing."""
        if self._closed:
            return
        self._closed = True
        if not self.exited:
            try:
                self.send(("stop",))
            except EngineProcessError:
                pass
        if self._reader is not None:
            self._reader.join(timeout)
        self.process.join(timeout if self._reader is None else 5)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %g s: killed", timeout)
            self._kill()
        self.exited = True
        self._conn.close()
        atexit.unregister(self.close)

    def _kill(self) -> None:
        self.process.kill()
        self.process.join(10)


# -- the child process ---------------------------------------------------------------------------
def _child_main(conn, factory: Callable, args: tuple, log_level: int) -> None:
    logging.basicConfig(level=log_level, format="%(levelname)s [engine] %(name)s: %(message)s")
    # Ctrl-C in a terminal reaches the whole process group: the server's process stops this one
    # (and its tensor-parallel followers, which inherit the ignoring) when it has shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = factory(*args)
    except BaseException as error:  # noqa: BLE001 - told to the server, which raises it
        kind = next((name for name, kind in _BUILD_ERRORS.items() if isinstance(error, kind)), type(error).__name__)
        if kind in _BUILD_ERRORS:  # a bad option or path: the server says which
            logger.error("the engine could not be built: %s", error)
        else:
            logger.exception("the engine could not be built")
        conn.send(("error", kind, str(error)))
        conn.close()
        return
    runner = engine.runner
    conn.send(("ready", {"config": engine.config, "max_prompt_tokens": engine.max_prompt_tokens,
                         "num_blocks": engine.block_manager.num_blocks, "vocab_size": engine.vocab_size,
                         "eos_token_ids": sorted(engine.eos_token_ids),
                         "supports_structured_outputs": bool(getattr(runner, "supports_structured_outputs", False)),
                         "runner": type(runner).__name__}))
    try:
        message = conn.recv()
    except (EOFError, OSError):
        message = ("stop",)
    why = None
    if message[0] == "start":
        why = _serve(conn, engine, *message[1:])
    engine.close()
    try:
        conn.send(("stopped", None if why == STOPPED else why))
    except (OSError, ValueError):
        pass
    conn.close()


def _serve(conn, engine, stream_interval: float, switch_interval: float | None) -> str:
    """Serve the server's commands until told to stop (or the pipe closes, or SIGTERM); why it stopped."""
    lock = threading.Lock()

    def emit(message: tuple) -> None:
        data = _pickled(message)
        try:
            with lock:
                conn.send_bytes(data)
        except (OSError, ValueError):  # the server's process has gone
            loop.stop()

    loop = EngineLoop(engine, emit, stream_interval)
    # What exists now (model, tokenizer) lives as long as the process: keep it out of the garbage
    # collector's full passes, which otherwise walk it again and again while serving (a pass over
    # an 8B model's process took a quarter of a second, a step's streams waiting).
    gc.collect()
    gc.freeze()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)

    def read() -> None:
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):
                break
            if command[0] == "stop":
                break
            if command[0] == "add":
                _compile_grammars(engine, command[2])
            if not loop.submit(command):
                break
        loop.stop()

    threading.Thread(target=read, name="zipage-engine-commands", daemon=True).start()
    # SIGTERM (an operator, a supervisor stopping the process group): the requests in flight get
    # an error, and the process ends cleanly.
    signal.signal(signal.SIGTERM, lambda *_: loop.stop("the engine process was stopped (SIGTERM)"))
    loop.run()
    gc.unfreeze()  # what was frozen may go again (and extension modules tear down cleanly)
    return loop.why_stopped


def _compile_grammars(engine, requests: list[tuple]) -> None:
    """Compile the requests' structured outputs into the engine's compiler cache here, on the
    command reader's thread, so that a large schema does not hold up the engine's steps (a bad
    one is left for ``prepare_request`` to refuse)."""
    for _, params, _ in requests:
        if params.structured_outputs is not None:
            try:
                engine.grammar_compiler().compile(params.structured_outputs)
            except ValueError:
                pass


def _pickled(message: tuple) -> bytes:
    """``message`` pickled. A reply is checked to unpickle too (an exception whose constructor
    takes other arguments than its ``args`` pickles, then fails to load): one that does not
    carries its result's or error's message instead, as a ``RuntimeError``."""
    if message[0] != "reply":
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
        return data
    except Exception as failure:  # noqa: BLE001
        logger.warning("a reply could not be sent whole (%s): its message goes instead", failure)
        kind, token, _, error = message
        error = RuntimeError(str(error) if error is not None else "the result could not be sent")
        return pickle.dumps((kind, token, None, error), protocol=pickle.HIGHEST_PROTOCOL)
