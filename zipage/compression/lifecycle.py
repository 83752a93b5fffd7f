"""The life of every compression, kept in one place: planned, launched, done, or abandoned.

The scheduler plans compressions through ``Compressions``; the engine launches, polls
and, when something fails, abandons them through it. No other object keeps a flag
of its own about a request's compression, so a failure at any point leaves nothing
half-done behind:

- planned: ``plan`` took the request's target blocks (``BlockManager.compact``) and
  its cache is now counted as compacted (``kv_len`` = kept tokens). A planned
  synchronous compression that preemption drops is forgotten (``drop``): the
  preemption frees the request's blocks, and no counter was touched yet.
- launched: synchronous compressions run before the step's forward and are done when
  ``launch`` returns; an asynchronous batch stays in flight until ``poll`` finds it
  done. Its requests skip decode steps meanwhile, and its source blocks stay
  referenced (``task.pending_release``) because the compaction still reads them.
- done: the sources are released and the request's counters (history length,
  compressions, evicted tokens) change only now.
- abandoned: a launch or a poll raised. The tasks' blocks still held for the
  compaction are released and the tasks forgotten; the engine ends their requests
  with an error (their caches are in an unknown state).
"""

from __future__ import annotations

from zipage.compression.planner import CompressionTask, plan_compression
from zipage.config import CompressionConfig
from zipage.engine.block_manager import BlockManager
from zipage.engine.sequence import Sequence


class Compressions:
    def __init__(self, block_manager: BlockManager, config: CompressionConfig, asynchronous: bool):
        self.block_manager = block_manager
        self.config = config
        self.asynchronous = asynchronous
        self._planned: dict[Sequence, CompressionTask] = {}  # this step's plan, not launched yet
        self._in_flight: dict[Sequence, CompressionTask] = {}  # the asynchronous batch running
        self._handle = None  # the runner's handle of that batch

    # -- questions ----------------------------------------------------------
    def is_compressing(self, seq: Sequence) -> bool:
        """Whether an asynchronous compaction of ``seq`` is planned or running: it may neither
        decode nor be preempted until the compaction is done."""
        return seq in self._in_flight or (self.asynchronous and seq in self._planned)

    @property
    def busy(self) -> bool:
        """An asynchronous batch is in flight (at most one is)."""
        return bool(self._in_flight)

    @property
    def planned(self) -> list[CompressionTask]:
        return list(self._planned.values())

    @property
    def in_flight(self) -> list[CompressionTask]:
        return list(self._in_flight.values())

    # -- the scheduler --------------------------------------------------------
    def plan(self, seq: Sequence) -> CompressionTask:
        """Take target blocks for ``seq``; its compaction runs when the step is launched."""
        assert seq not in self._planned and seq not in self._in_flight, f"{seq} is already being compressed"
        task = plan_compression(seq, self.block_manager, self.config, asynchronous=self.asynchronous)
        self._planned[seq] = task
        return task

    def drop(self, seq: Sequence) -> None:
        """Forget ``seq``'s planned synchronous compression (it is being preempted)."""
        assert not self.asynchronous, "a planned asynchronous compaction is never preempted"
        self._planned.pop(seq, None)

    # -- the engine -----------------------------------------------------------
    def launch(self, runner) -> list[CompressionTask]:
        """Run (synchronous) or start (asynchronous) this step's planned compressions.

        If the runner raises, the tasks stay planned: the caller abandons them."""
        tasks = self.planned
        if not tasks:
            return tasks
        if self.asynchronous:
            self._handle = runner.start_compression(tasks)
            self._in_flight, self._planned = self._planned, {}
        else:
            runner.compress(tasks)
            self._planned = {}
            for task in tasks:
                self._done(task)
        return tasks

    def poll(self, runner, wait: bool) -> list[CompressionTask]:
        """Finish the batch in flight if it is done (with ``wait``, once it is); the tasks finished.

        If the runner raises, the batch stays in flight: the caller abandons it."""
        if not self._in_flight or not runner.compression_done(self._handle, wait):
            return []
        tasks = self.in_flight
        self._in_flight, self._handle = {}, None
        for task in tasks:
            self.block_manager.finish_compaction(task.seq, task.pending_release)
            self._done(task)
        return tasks

    def abandon(self, tasks: list[CompressionTask]) -> None:
        """Give up ``tasks`` after a failed launch or poll: release the sources they still hold.
        Their requests keep their (target) block tables; the engine ends them."""
        for task in tasks:
            if self._planned.pop(task.seq, None) is None and self._in_flight.pop(task.seq, None) is None:
                continue
            self.block_manager.release(task.pending_release)
            task.pending_release = []
        if not self._in_flight:
            self._handle = None

    @staticmethod
    def _done(task: CompressionTask) -> None:
        seq = task.seq
        seq.num_scored_tokens = task.keep
        seq.metrics.num_compressions += 1
        seq.metrics.evicted_tokens += task.num_tokens - task.keep
