"""Tensor parallelism for the engine: rank 0 decides, the other ranks follow.

The engine (scheduler, block manager, sampling) lives on rank 0 only. Each other
rank is a process with its own ``ModelRunner``: its share of the weights, a KV
cache of its own KV heads with the same blocks, and a query cache of its own
query heads. Every runner call rank 0 makes reaches the followers first, through
the step ring (shared memory, ``step_channel.py``) and in the same order, so all
ranks run the same forwards (their collectives meet) and the same compressions:

- a step posts the host arrays of the step's inputs (ids, positions, slots, block
  tables), built once on rank 0, copied into a ring slot (nothing pickled); followers
  run the forward and drop the logits;
- a compression posts its tasks (block lists and counts, pickled: they are rare); each
  rank scores and compacts its own heads, no communication needed since scores are per
  KV head;
- when rank 0 collects an asynchronous compression, the followers' main streams
  wait for theirs, so no later step writes a block it still reads.

Asynchronous (launch-ahead) scheduling: a decode request's input token may be the
previous step's sampled token, still on rank 0's device. After sampling each launched
step, rank 0 broadcasts its sampled tokens (padded to ``max_num_seqs``) to the group,
a collective queued on the device like the forward's, with no host wait; the step's
message tells the followers to receive it, and the next step's message carries each
request's row among those tokens, so followers patch their input ids as rank 0 does.

Followers never wait for their device per step: each one's work is ordered by its
stream (forwards, broadcasts, synchronous compressions), by the collectives that meet
rank 0's, and by an event guarding its host buffers (``ModelRunner.follow``).

Failures. Once a step is posted, the followers run its forward and wait in each of its
collectives (and in its broadcast) until rank 0 joins them. What fails on rank 0
before posting (building the inputs, a step too large for a slot) concerns no other
rank: the step raises and the engine carries on. Sampling fails after the forward, and
rank 0 still broadcasts (stale tokens, which no later step reads); a step launched
with deferred sampling that is never sampled has its broadcast sent before the next
message. But a failure between posting and the end of rank 0's forward leaves the
followers inside a collective that rank 0 cannot finish for them: which collectives are
left depends on where the forward stopped, and running them with made-up data would
leave each rank's KV cache its own. Collectives with a timeout would only turn the
hang into a late error on every rank. So rank 0 shuts the group down at once: it kills
the followers (a process waiting in a collective cannot be asked to stop; the group is
inconsistent, and there is nothing of theirs to save), leaves the group, and raises
``TensorParallelFailed`` naming the failure. Every later call that needs the other
ranks raises it too: the engine's steps fail with that error, in bounded time, instead
of hanging. A follower found dead before a message is posted shuts the group down the
same way.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import socket
import time
import traceback
from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zipage.config import EngineConfig
from zipage.distributed import destroy_tensor_parallel, init_tensor_parallel
from zipage.runner.step_channel import ChannelReader, Message, StepChannel, slot_bytes_for

logger = logging.getLogger(__name__)


class TensorParallelFailed(RuntimeError):
    """The tensor-parallel group was shut down: rank 0 failed in a step the other ranks were
    running, or a follower died. The engine that holds it runs no more steps."""


def check_shardable(spec, config: EngineConfig) -> None:
    """Raise ``ValueError`` naming what cannot be split over ``tensor_parallel_size`` ranks."""
    tp = config.tensor_parallel_size
    sizes = [("num_attention_heads", spec.num_heads), ("intermediate_size", spec.intermediate_size)]
    if spec.num_experts:  # each rank holds a slice of every expert
        sizes.append(("moe_intermediate_size", spec.moe_intermediate_size))
    for name, value in sizes:
        if value % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's {name}={value}")
    kv = spec.num_kv_heads
    if kv < tp and tp % kv:
        raise ValueError(f"tensor_parallel_size={tp} must be a multiple of num_key_value_heads={kv} "
                         "when it exceeds it (KV heads are then replicated)")
    if kv < tp and config.compression is not None:
        # A replicated KV head would be scored by each rank's own query heads and its copies
        # would evict different tokens; exact scoring needs the whole GQA group on one rank.
        raise ValueError(f"compression needs tensor_parallel_size={tp} <= num_key_value_heads={kv}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(config: EngineConfig) -> str:
    return "nccl" if config.is_cuda else "gloo"


def _portable(tasks):
    """Compression tasks without their ``Sequence`` (only its query slot is read)."""
    return [replace(t, seq=SimpleNamespace(query_slot=t.seq.query_slot), pending_release=[]) for t in tasks]


def _share_tokens(tokens: torch.Tensor) -> None:
    """Rank 0's ``tokens`` (a step's sampled token ids) into every rank's ``tokens``. On CUDA the
    broadcast is queued on the stream after the work before it (NCCL waits for it, the stream
    waits for NCCL): the host does not wait."""
    with torch.inference_mode():
        dist.broadcast(tokens, src=0)


def _follower_main(rank: int, config: EngineConfig, hf_config, port: int, conn, reader: ChannelReader) -> None:
    from zipage.runner.model_runner import ModelRunner

    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID` prints where this rank stands (a hang in a collective)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    conn.send(("started",))
    runner = None
    try:
        init_tensor_parallel(rank, config.tensor_parallel_size, _backend(config), f"tcp://127.0.0.1:{port}")
        runner = ModelRunner(config, hf_config, rank)
        try:
            reader.attach(conn)  # rank 0 sizes the ring from its input builder, built just now
        except EOFError:  # rank 0 is gone (it failed to start)
            return
        # The last launched step's sampled tokens, as rank 0 broadcast them (asynchronous scheduling)
        tokens = torch.zeros(config.scheduler.max_num_seqs, dtype=torch.int64, device=runner.device)
        in_flight = None  # this rank's event of the asynchronous compression in flight
        while True:
            message = reader.receive()
            if message is None:  # rank 0 is gone
                break
            command, shares = message.command, message.share_tokens
            try:
                if command == "step":
                    runner.follow(message.shape, message.arrays, tokens)
                elif command == "compress":
                    runner.compress(message.payload)
                elif command == "start_compression":
                    in_flight = runner.start_compression(message.payload)
                elif command == "collect_compression":
                    if in_flight is not None:
                        torch.cuda.current_stream(runner.device).wait_event(in_flight)
                        in_flight = None
                elif command == "close":
                    break
                else:
                    raise RuntimeError(f"unknown tensor-parallel command {command!r}")
            finally:
                reader.release()  # its arrays are in this rank's host buffers now
                message = None  # no view of the slot outlives it
            if shares:  # after its forward, as rank 0 after sampling
                _share_tokens(tokens)
    except Exception:
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        raise
    finally:
        try:
            if runner is not None:
                runner.release_graphs()
        finally:  # left even when the device failed
            destroy_tensor_parallel()
            reader.close()
            conn.close()


class ParallelRunner:
    """Rank 0's runner: forwards each call to the follower ranks, then runs it itself.

    Everything else (cache sizes, the model, traces) is rank 0's ``ModelRunner``.
    ``failure`` says why the group was shut down (see the module's "Failures"), None while
    it runs.
    """

    # ``launch`` / ``collect``: each launched step's sampled tokens are broadcast to the
    # followers, which take the pending input tokens from them as rank 0 does.
    supports_async_scheduling = True
    # Rank 0 computes logits beyond the step's (the vocabulary gather is a collective): not here.
    supports_prompt_logprobs = False

    def __init__(self, config: EngineConfig, hf_config):
        from zipage.models.registry import spec_from_config
        from zipage.runner.model_runner import ModelRunner

        check_shardable(spec_from_config(hf_config), config)
        size, port = config.tensor_parallel_size, _free_port()
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        self.failure: str | None = None
        # Semaphores cross processes only at spawn: the channel's are made now, its ring once
        # rank 0's input builder gives the slot size.
        self._channel = StepChannel(ctx, size - 1, alive=lambda index: self._procs[index].is_alive())
        self._shared = None  # the last step whose sampled tokens the followers hold
        self._owed = None  # the launched step whose broadcast the followers wait for
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_follower_main, args=(rank, config, hf_config, port, child,
                                                             self._channel.reader(rank - 1)),
                               daemon=True, name=f"zipage-tp{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            self._wait_started()
            init_tensor_parallel(0, size, _backend(config), f"tcp://127.0.0.1:{port}")
            self.local = ModelRunner(config, hf_config, 0)
            # a slot: the builder's buffers, and each request's row of its pending token
            pending_rows_bytes = 8 * config.scheduler.max_num_seqs
            self._channel.open(slot_bytes_for(self.local.inputs, pending_rows_bytes), self._conns)
            # A launched step's sampled tokens, padded to the most a step has, as broadcast
            self._tokens = torch.zeros(config.scheduler.max_num_seqs, dtype=torch.int64, device=self.local.device)
        except BaseException:
            self.close()
            raise

    def _wait_started(self, timeout_s: float = 300.0) -> None:
        """Fail at once, not at the group's timeout, when a follower dies while starting."""
        deadline = time.monotonic() + timeout_s
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            while True:
                try:
                    if conn.poll(0.1) and conn.recv() == ("started",):
                        break
                except EOFError:  # its end of the pipe closed: the process is gone
                    proc.join(timeout=5)
                if proc.exitcode is not None:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited with code {proc.exitcode} while starting; a script "
                        "that builds an engine with tensor_parallel_size > 1 must guard its entry point with "
                        "`if __name__ == '__main__':` (followers are spawned and import it)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start within {timeout_s:.0f} s")

    def __getattr__(self, name):
        return getattr(self.__dict__["local"], name)

    def _post(self, message: Message) -> None:
        """Post ``message`` to the followers, after the broadcast a step still owes them.

        Raises ``TensorParallelFailed`` once the group is shut down, and shuts it down when a
        follower has died: a message it would never read must not be posted."""
        if self.failure is None:
            dead = [(rank, proc.exitcode) for rank, proc in enumerate(self._procs, start=1) if not proc.is_alive()]
            if dead:
                self._shut_down("tensor-parallel rank {} exited with code {}".format(*dead[0]))
        if self.failure is not None:
            raise TensorParallelFailed(f"the tensor-parallel group was shut down after {self.failure}: this engine "
                                       "runs no more steps (build a new one)")
        if self._owed is not None:
            # A step launched with deferred sampling and never sampled (its requests failed): the
            # followers wait for its broadcast before they read this message. Its tokens are the
            # last ones shared, again; no later step reads them (``launch`` checks ``_shared``).
            self._owed = self._shared = None
            with self._in_step():
                _share_tokens(self._tokens)
        self._channel.send(message)

    def _send(self, command: str, payload=None) -> None:
        self._post(Message(command, payload=payload))

    @contextlib.contextmanager
    def _in_step(self):
        """Rank 0's part of a posted step, up to the last collective the followers wait in: a
        failure in it shuts the group down and raises ``TensorParallelFailed`` (or the
        interruption itself) instead of leaving them waiting."""
        try:
            yield
        except BaseException as error:
            cause = f"rank 0 failed in a step the other ranks were running ({type(error).__name__}: {error})"
            self._shut_down(cause)
            if not isinstance(error, Exception):  # KeyboardInterrupt and the like go on as they are
                raise
            raise TensorParallelFailed(f"tensor-parallel {cause}, so they could not finish it: the group was shut "
                                       "down and this engine runs no more steps") from error

    def _shut_down(self, cause: str) -> None:
        """Stop the group at once, its ranks out of step (see the module's "Failures"): kill the
        followers, each perhaps waiting in a collective that no rank will join, then leave it."""
        if self.failure is not None:
            return
        self.failure = cause
        self._owed = self._shared = None
        logger.error("shutting the tensor-parallel group down: %s", cause)
        for proc in self._procs:
            proc.kill()
        for rank, proc in enumerate(self._procs, start=1):
            proc.join(timeout=10)
            if proc.is_alive():  # e.g. stuck in its device's driver: the kill ends it when that returns
                logger.error("tensor-parallel rank %d (pid %s) has not exited after it was killed", rank, proc.pid)
        try:
            destroy_tensor_parallel()  # with NCCL an abort, which also ends rank 0's collectives still queued
        except Exception:  # noqa: BLE001 - the group is gone either way; the failure that ended it is raised
            logger.exception("leaving the tensor-parallel group failed")
        for conn in self._conns:
            conn.close()
        self._channel.close()
        self._conns, self._procs = [], []

    def _post_step(self, seqs, is_prefill: bool, shape=None, previous=None, share_tokens: bool = False):
        """Fill the step's inputs into rank 0's host buffers (unless ``shape`` says the caller did)
        and post them to the followers; return the step's shape. What fails here posted nothing."""
        local = self.local
        if shape is None:
            if local._inputs_read is not None:  # as in ModelRunner.launch: the last step's copies from
                local._inputs_read.synchronize()  # the host buffers must be done before they are refilled
            shape = local.inputs.fill_prefill(seqs) if is_prefill else local.inputs.fill_decode(seqs)
        arrays = local.inputs.export(shape)
        if previous is not None and any(s.num_pending for s in seqs):  # the test of ModelRunner.launch
            arrays["pending_rows"] = local.inputs.pending_rows(seqs, previous.rows)
        self._post(Message("step", shape, arrays, share_tokens=share_tokens))
        return shape

    def execute(self, seqs, is_prefill: bool, eos_token_ids: set[int], async_callback=None) -> list[int]:
        """A synchronous step (``ModelRunner.execute``): its tokens are read before the next one, so
        the followers need none, and only its forward is theirs."""
        if async_callback is not None and self.local.device.type == "cpu":
            async_callback()  # (where ModelRunner.execute runs it, but before posting: its failure
            async_callback = None  # then concerns no other rank)
        shape = self._post_step(seqs, is_prefill)
        return self.local.execute(seqs, is_prefill, eos_token_ids, shape, async_callback,
                                  forward_guard=self._in_step)

    def launch(self, seqs, is_prefill: bool, eos_token_ids: set[int], shape=None, previous=None,
               defer_sampling: bool = False):
        """``ModelRunner.launch`` on every rank; the step's sampled tokens are then broadcast
        (``sample``), as the next step's pending input tokens may be among them."""
        if previous is not None and previous is not self._shared:
            raise RuntimeError("with tensor parallelism a step's pending tokens must come from the step "
                               "launched just before it: the followers hold only that step's tokens")
        shape = self._post_step(seqs, is_prefill, shape, previous, share_tokens=True)
        # Sampled apart, so that the broadcast the followers wait for follows the forward even
        # when sampling fails.
        with self._in_step():
            step = self.local.launch(seqs, is_prefill, eos_token_ids, shape, previous, defer_sampling=True)
        self._owed = step
        if not defer_sampling:
            self.sample(step)
        return step

    def sample(self, step) -> None:
        """Queue a launched step's sampler, then broadcast its tokens to the followers."""
        self._shared = None
        try:
            self.local.sample(step)
        finally:  # the followers wait for the broadcast whatever happened (if sampling failed they get
            # the last tokens again: the step's requests fail, and no later step reads them)
            if self._owed is step:  # else already sent (stale: ``_post``), or the group was shut down
                self._owed = None
                tokens = step.tokens
                with torch.inference_mode():
                    if tokens is not None and tokens.numel():
                        self._tokens[:tokens.numel()].copy_(tokens)
                with self._in_step():
                    _share_tokens(self._tokens)
                if tokens is not None:
                    self._shared = step

    def forget(self, seqs) -> None:
        """Only rank 0 samples, so only it holds per-request state: the followers need nothing."""
        self.local.forget(seqs)

    def compress(self, tasks) -> None:
        self._send("compress", _portable(tasks))
        self.local.compress(tasks)

    def start_compression(self, tasks):
        self._send("start_compression", _portable(tasks))
        return self.local.start_compression(tasks)

    def compression_done(self, handle, wait: bool = False) -> bool:
        done = self.local.compression_done(handle, wait)
        if done:
            self._send("collect_compression")
        return done

    def close(self) -> None:
        """Stop the followers and leave the group (idempotent). Every rank drops its CUDA
        graphs and waits for its device first; rank 0 leaves before it waits for the
        followers to exit, so a teardown that waits on the peers cannot deadlock with them.
        A group already shut down (``failure``) has nothing left to stop."""
        channel = self.__dict__.get("_channel")
        if channel is not None and channel.is_open:
            try:  # after the steps already posted; a follower that is gone or stuck is killed below
                channel.send(Message("close"), timeout_s=5.0)
            except (RuntimeError, TimeoutError, OSError):
                pass
        local = self.__dict__.get("local")
        try:
            # After a shutdown rank 0's device may still hold work queued for the group: no wait for it.
            if local is not None and self.__dict__.get("failure") is None:
                local.release_graphs()
        finally:  # the group is left and the followers stopped even when the device failed
            destroy_tensor_parallel()
            for proc in self._procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
            for conn in self._conns:
                conn.close()
            if channel is not None:
                channel.close()
            self._conns, self._procs = [], []


def make_runner(config: EngineConfig, hf_config):
    """A ``ModelRunner`` in this process, or rank 0 of a tensor-parallel group."""
    from zipage.runner.model_runner import ModelRunner

    if config.tensor_parallel_size == 1:
        return ModelRunner(config, hf_config)
    return ParallelRunner(config, hf_config)
