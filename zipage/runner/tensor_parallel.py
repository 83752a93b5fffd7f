"""Tensor parallelism for the engine: rank 0 decides, the other ranks follow.

The engine (scheduler, block manager, sampling) lives on rank 0 only. Each other
rank is a process with its own ``ModelRunner``: its share of the weights, a KV
cache of its own KV heads with the same blocks, and a query cache of its own
query heads. Every runner call rank 0 makes reaches the followers first, through
a pipe and in the same order, so all ranks run the same forwards (their
collectives meet) and the same compressions:

- a step sends the host arrays of the step's inputs (ids, positions, slots, block
  tables), built once on rank 0; followers run the forward and drop the logits;
- a compression sends its tasks (block lists and counts); each rank scores and
  compacts its own heads, no communication needed since scores are per KV head;
- when rank 0 collects an asynchronous compression, the followers' main streams
  wait for theirs, so no later step writes a block it still reads.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import socket
import time
import traceback
from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from zipage.config import EngineConfig
from zipage.distributed import destroy_tensor_parallel, init_tensor_parallel

logger = logging.getLogger(__name__)


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


def _follower_main(rank: int, config: EngineConfig, hf_config, port: int, conn) -> None:
    from zipage.runner.model_runner import ModelRunner

    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID` prints where this rank stands (a hang in a collective)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    conn.send(("started",))
    runner = None
    try:
        init_tensor_parallel(rank, config.tensor_parallel_size, _backend(config), f"tcp://127.0.0.1:{port}")
        runner = ModelRunner(config, hf_config, rank)
        in_flight = None  # this rank's event of the asynchronous compression in flight
        while True:
            try:
                command, *args = conn.recv()
            except EOFError:  # rank 0 is gone
                break
            if command == "step":
                runner.follow(*args)
            elif command == "compress":
                runner.compress(args[0])
            elif command == "start_compression":
                in_flight = runner.start_compression(args[0])
            elif command == "collect_compression":
                if in_flight is not None:
                    torch.cuda.current_stream(runner.device).wait_event(in_flight)
                    in_flight = None
            elif command == "close":
                break
    except Exception:
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        raise
    finally:
        try:
            if runner is not None:
                runner.release_graphs()
        finally:  # left even when the device failed
            destroy_tensor_parallel()
            conn.close()


class ParallelRunner:
    """Rank 0's runner: forwards each call to the follower ranks, then runs it itself.

    Everything else (cache sizes, the model, traces) is rank 0's ``ModelRunner``.
    """

    # The followers take each step's input tokens from the host: every step waits for its tokens.
    supports_async_scheduling = False
    # Rank 0 computes logits beyond the step's (the vocabulary gather is a collective): not here.
    supports_prompt_logprobs = False

    def __init__(self, config: EngineConfig, hf_config):
        from zipage.models.registry import spec_from_config
        from zipage.runner.model_runner import ModelRunner

        check_shardable(spec_from_config(hf_config), config)
        size, port = config.tensor_parallel_size, _free_port()
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_follower_main, args=(rank, config, hf_config, port, child), daemon=True,
                               name=f"zipage-tp{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            self._wait_started()
            init_tensor_parallel(0, size, _backend(config), f"tcp://127.0.0.1:{port}")
            self.local = ModelRunner(config, hf_config, 0)
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

    def _send(self, *message) -> None:
        for conn in self._conns:
            conn.send(message)

    def execute(self, seqs, is_prefill: bool, eos_token_ids: set[int], async_callback=None) -> list[int]:
        inputs = self.local.inputs
        shape = inputs.fill_prefill(seqs) if is_prefill else inputs.fill_decode(seqs)
        self._send("step", shape, inputs.export(shape))
        return self.local.execute(seqs, is_prefill, eos_token_ids, shape, async_callback)

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
        followers to exit, so a teardown that waits on the peers cannot deadlock with them."""
        for conn in self._conns:
            try:
                conn.send(("close",))
            except (BrokenPipeError, OSError):
                pass
        local = self.__dict__.get("local")
        try:
            if local is not None:
                local.release_graphs()
        finally:  # the group is left and the followers stopped even when the device failed
            destroy_tensor_parallel()
            for proc in self._procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
            for conn in self._conns:
                conn.close()
            self._conns, self._procs = [], []


def make_runner(config: EngineConfig, hf_config):
    """A ``ModelRunner`` in this process, or rank 0 of a tensor-parallel group."""
    from zipage.runner.model_runner import ModelRunner

    if config.tensor_parallel_size == 1:
        return ModelRunner(config, hf_config)
    return ParallelRunner(config, hf_config)
