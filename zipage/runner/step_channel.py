"""The step ring: how rank 0's runner calls reach the tensor-parallel followers.

Rank 0 builds each step's inputs on its host (``InputBuilder``); every follower needs
the same numbers in its own host buffers before it can queue the same forward. The
ranks are processes of one host (``tensor_parallel.py`` spawns them), so the numbers
go through shared memory: a ring of ``num_slots`` fixed-size slots that rank 0 creates
and each follower maps. A slot holds

- a header of int64 words: the message's sequence number, its kind and command, the
  ``StepShape`` fields, whether rank 0 shares the step's sampled tokens after it, and a
  descriptor (name, dtype, shape, offset) for each array (names and dtypes as ASCII
  packed into words, their encodings cached: a step writes and reads the header with
  one numpy call each);
- the step's host arrays (ids, positions, slots, context lengths, cu_seqlens, the block
  table rows and columns in use, query slots, pending rows), each copied in with one
  numpy assignment and read back in place by the follower, which copies it into its
  own (pinned) host buffers.

Nothing is pickled for a step. Two semaphores per follower order the slots: ``filled``
counts the messages it has not read yet (its wake-up), ``free`` the slots it has given
back (rank 0's back-pressure when a follower lags by ``num_slots`` messages). A
semaphore post is also the memory barrier that makes the slot's bytes visible.

Why not a device broadcast of the inputs (``torch.distributed.broadcast`` from rank 0)?
A follower needs the step's sizes on its host before it can queue anything (which
buffers, which decode graph, the attention's maximum lengths), so a broadcast would
still need a host channel for the header, or a device-to-host read on the follower
every step (the per-step wait this removes). It would also add a host-to-device copy
and a collective per step on rank 0's stream, behind the forward. Shared memory costs
a few memcpys on the hosts and keeps the devices out of it; the ranks share a host.

Ordering: every command goes through the ring, in one sequence (the header's sequence
number is checked by the reader). Commands other than steps (compression tasks, close)
are rare; their arguments are pickled into the slot, or, when they do not fit it, sent
through the follower's pipe while the slot says "read the pipe", so a command is never
reordered against the steps around it.

Slots are sized from the builder's buffers (``slot_bytes_for``): a step exports slices
of them, so any step fits. A step that still does not fit (a slot made smaller, a
builder grown after) raises ``ValueError`` before anything is written.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from multiprocessing import shared_memory

import numpy as np

from zipage.runner.inputs import HostBuffer, StepShape

NUM_SLOTS = 4  # messages rank 0 may post before the slowest follower has read the first
MAX_ARRAYS = 16
MAX_DIMS = 2
ALIGN = 64  # each array starts on a cache line

STEP, OBJECT, OBJECT_IN_PIPE = 1, 2, 3  # the slot holds: a step's arrays, a pickled object, nothing (see the pipe)

_SHAPE_FIELDS = fields(StepShape)
# StepShape travels as integers: a field of another type needs its own encoding here.
for _f in _SHAPE_FIELDS:
    if _f.type not in ("int", "bool", int, bool):
        raise TypeError(f"StepShape.{_f.name} has type {_f.type}: the step ring carries int and bool fields only")
_SHAPE_BOOL = [f.type in ("bool", bool) for f in _SHAPE_FIELDS]

# The header's int64 words: the message's, then the shape's, then 8 per array.
SEQ, KIND, SHARE, PAYLOAD, NUM_ARRAYS = range(5)
COMMAND = slice(5, 9)  # its name, up to 32 ASCII bytes
SHAPE = slice(9, 9 + len(_SHAPE_FIELDS))
ARRAYS = SHAPE.stop
NAME_WORDS = 3  # an array's name, up to 24 bytes; then its dtype (8 bytes), ndim, MAX_DIMS sizes, offset
ARRAY_WORDS = NAME_WORDS + 3 + MAX_DIMS


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


HEADER_BYTES = _aligned(8 * (ARRAYS + MAX_ARRAYS * ARRAY_WORDS))


@functools.lru_cache(maxsize=None)
def _words(text: str, count: int) -> tuple[int, ...]:
    """``text`` as ``count`` int64 words (ASCII, zero-padded)."""
    raw = text.encode()
    if len(raw) > 8 * count or not text.isascii():
        raise ValueError(f"{text!r} does not fit the step ring's header ({8 * count} ASCII bytes)")
    return tuple(np.frombuffer(raw.ljust(8 * count, b"\0"), dtype="<i8").tolist())


@functools.lru_cache(maxsize=None)
def _text(words: tuple[int, ...]) -> str:
    return np.array(words, dtype="<i8").tobytes().rstrip(b"\0").decode()


@functools.lru_cache(maxsize=None)
def _dtype(word: int) -> np.dtype:
    return np.dtype(_text((word,)))


@dataclass
class Message:
    """One command for the followers. A step: ``shape``, its host ``arrays`` (on the reading
    side, views into the slot until ``ChannelReader.release``) and ``share_tokens`` (rank 0
    broadcasts the step's sampled tokens after it); any other command: ``payload``."""

    command: str
    shape: StepShape | None = None
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    share_tokens: bool = False
    payload: object = None
    seq: int = -1  # set by the ring


def slot_bytes_for(builder, extra_bytes: int = 0) -> int:
    """A slot that holds the largest step of ``builder``: each of its host buffers whole
    (a step exports slices of them), aligned, after the header, and an array of up to
    ``extra_bytes`` besides (not in the builder)."""
    buffers = [b for b in vars(builder).values() if isinstance(b, HostBuffer)]
    if len(buffers) + (extra_bytes > 0) > MAX_ARRAYS:
        raise ValueError(f"the input builder has {len(buffers)} host buffers; the step ring carries {MAX_ARRAYS}")
    return HEADER_BYTES + sum(_aligned(b.np.nbytes) for b in buffers) + _aligned(extra_bytes)


def _parent_alive() -> bool:
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


class _Ring:
    """The shared memory of ``num_slots`` slots of ``slot_bytes``, and numpy views of it."""

    def __init__(self, name: str | None, num_slots: int, slot_bytes: int):
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        if name is None:
            self.shm = shared_memory.SharedMemory(create=True, size=num_slots * slot_bytes)
        else:
            self.shm = shared_memory.SharedMemory(name=name)
        self.bytes = np.ndarray((num_slots, slot_bytes), dtype=np.uint8, buffer=self.shm.buf)
        self.headers = [self.bytes[i, :HEADER_BYTES].view("<i8") for i in range(num_slots)]

    def array(self, slot: int, offset: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
        """A view of the slot's bytes from ``offset`` as an array."""
        flat = np.frombuffer(self.shm.buf, dtype, math.prod(shape), slot * self.slot_bytes + offset)
        return flat if len(shape) == 1 else flat.reshape(shape)

    def close(self, unlink: bool = False) -> None:
        self.bytes = self.headers = None
        try:
            self.shm.close()
        except BufferError:  # a view of it is still alive somewhere: the mapping goes with the process
            pass
        if unlink:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


class ChannelReader:
    """A follower's end of the ring. Made by ``StepChannel.reader`` and handed to the follower
    when it is spawned (semaphores cross processes only then); ``attach`` maps the ring once
    rank 0 has sized it."""

    def __init__(self, filled, free, num_slots: int):
        self._filled, self._free, self.num_slots = filled, free, num_slots
        self._ring: _Ring | None = None
        self._conn = None
        self._seq = 0  # the number of the next message
        self._held = False  # a message was received and its slot not yet released

    def attach(self, conn) -> None:
        """Map the ring named by rank 0's ``StepChannel.open`` (waits for it on ``conn``, the
        follower's pipe, which also carries the payloads too large for a slot)."""
        name, slot_bytes = conn.recv()
        self._ring, self._conn = _Ring(name, self.num_slots, slot_bytes), conn

    def receive(self, alive: Callable[[], bool] = _parent_alive, poll_s: float = 1.0) -> Message | None:
        """The next message, or None once ``alive()`` says rank 0 is gone. A step's arrays are
        views into the slot: copy them out before ``release``."""
        assert not self._held, "release the last message first"
        while not self._filled.acquire(timeout=poll_s):
            if not alive():
                return None
        ring, slot = self._ring, self._seq % self.num_slots
        header = ring.headers[slot]
        words = header[:ARRAYS].tolist()
        if words[SEQ] != self._seq:
            raise RuntimeError(f"step ring out of order: expected message {self._seq}, slot {slot} holds "
                               f"{words[SEQ]}")
        self._seq += 1
        self._held = True
        command = _text(tuple(words[COMMAND]))
        if words[KIND] == STEP:
            shape = StepShape(*(bool(v) if is_bool else v for is_bool, v in zip(_SHAPE_BOOL, words[SHAPE])))
            arrays = {}
            described = header[ARRAYS:ARRAYS + words[NUM_ARRAYS] * ARRAY_WORDS].tolist()
            for i in range(0, len(described), ARRAY_WORDS):
                name = _text(tuple(described[i:i + NAME_WORDS]))
                dtype, ndim, *sizes, offset = described[i + NAME_WORDS:i + ARRAY_WORDS]
                arrays[name] = ring.array(slot, offset, tuple(sizes[:ndim]), _dtype(dtype))
            return Message(command, shape, arrays, bool(words[SHARE]), seq=words[SEQ])
        if words[KIND] == OBJECT:
            payload = pickle.loads(ring.bytes[slot, HEADER_BYTES:HEADER_BYTES + words[PAYLOAD]])
        else:  # too large for a slot: it follows on the pipe
            payload = pickle.loads(self._conn.recv_bytes())
        return Message(command, payload=payload, seq=words[SEQ])

    def release(self) -> None:
        """Give the last message's slot back to rank 0 (its array views must no longer be read)."""
        if self._held:
            self._held = False
            self._free.release()

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None


class StepChannel:
    """Rank 0's end of the ring, to ``num_readers`` followers (reader ``i`` is rank ``i + 1``).

    ``alive(i)`` tells whether reader ``i`` still runs: a send that waits for a slot fails
    when it does not, instead of waiting forever."""

    def __init__(self, ctx, num_readers: int, num_slots: int = NUM_SLOTS,
                 alive: Callable[[int], bool] = lambda i: True):
        self.num_slots = num_slots
        self._filled = [ctx.Semaphore(0) for _ in range(num_readers)]
        self._free = [ctx.Semaphore(num_slots) for _ in range(num_readers)]
        self._alive = alive
        self._ring: _Ring | None = None
        self._conns: list = []
        self._seq = 0

    @property
    def is_open(self) -> bool:
        return self._ring is not None

    @property
    def slot_bytes(self) -> int:
        return self._ring.slot_bytes if self._ring is not None else 0

    def reader(self, index: int) -> ChannelReader:
        return ChannelReader(self._filled[index], self._free[index], self.num_slots)

    def open(self, slot_bytes: int, conns: list) -> None:
        """Create the ring and tell each reader its name through its pipe (``conns[i]``, which
        then carries the payloads too large for a slot)."""
        if slot_bytes < HEADER_BYTES:
            raise ValueError(f"a ring slot needs at least {HEADER_BYTES} bytes for its header, got {slot_bytes}")
        self._ring = _Ring(None, self.num_slots, slot_bytes)
        self._conns = list(conns)
        for conn in self._conns:
            conn.send((self._ring.shm.name, slot_bytes))

    def send(self, message: Message, timeout_s: float | None = None) -> None:
        """Post ``message`` to every reader, in order after the last one. Waits while the slowest
        reader has ``num_slots`` messages unread (up to ``timeout_s``, then ``TimeoutError``)."""
        ring = self._ring
        words = [self._seq, 0, int(message.share_tokens), 0, 0, *_words(message.command, COMMAND.stop - COMMAND.start)]
        assert len(words) == SHAPE.start
        blob, layout = None, []
        if message.shape is not None:  # a step: lay its arrays out (checked before anything is written)
            words[KIND] = STEP
            words += [int(getattr(message.shape, f.name)) for f in _SHAPE_FIELDS]
            layout = self._layout(message, words)
        else:
            blob = pickle.dumps(message.payload, protocol=pickle.HIGHEST_PROTOCOL)
            words[KIND] = OBJECT if HEADER_BYTES + len(blob) <= ring.slot_bytes else OBJECT_IN_PIPE
            words[PAYLOAD] = len(blob)
        slot = self._seq % self.num_slots
        self._wait_free(timeout_s)
        # Every reader has released this slot (they read the messages in order): write it.
        ring.headers[slot][:len(words)] = words
        for offset, array in layout:
            ring.array(slot, offset, array.shape, array.dtype)[...] = array
        if words[KIND] == OBJECT:
            ring.bytes[slot, HEADER_BYTES:HEADER_BYTES + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        self._seq += 1
        for filled in self._filled:  # wake the readers (and publish the slot's bytes)
            filled.release()
        if words[KIND] == OBJECT_IN_PIPE:
            # After the wake-up: a reader takes it off the pipe when it reaches this message, and
            # a large payload would fill the pipe before then.
            for conn in self._conns:
                conn.send_bytes(blob)

    def _layout(self, message: Message, words: list[int]) -> list[tuple[int, np.ndarray]]:
        """Each array's offset in the slot, its descriptor appended to ``words`` (the header);
        ``ValueError`` if they do not fit."""
        arrays = message.arrays
        if len(arrays) > MAX_ARRAYS:
            raise ValueError(f"a step carries {len(arrays)} arrays; the step ring holds {MAX_ARRAYS}")
        layout, offset = [], HEADER_BYTES
        for name, array in arrays.items():
            array = np.asarray(array)
            if array.ndim > MAX_DIMS or array.dtype.hasobject:
                raise ValueError(f"step array {name!r} ({array.dtype}, {array.ndim} dimensions) cannot travel in "
                                 f"the step ring: at most {MAX_DIMS} dimensions of numbers")
            sizes = list(array.shape) + [0] * (MAX_DIMS - array.ndim)
            words += [*_words(name, NAME_WORDS), *_words(array.dtype.str, 1), array.ndim, *sizes, offset]
            layout.append((offset, array))
            offset += _aligned(array.nbytes)
        words[NUM_ARRAYS] = len(arrays)
        if offset > self._ring.slot_bytes:
            sizes = ", ".join(f"{name} {tuple(np.shape(a))}" for name, a in arrays.items())
            raise ValueError(f"a step of {message.shape.num_seqs} requests and {message.shape.num_tokens} tokens "
                             f"needs {offset} bytes, more than a step-ring slot holds ({self._ring.slot_bytes}); "
                             f"its arrays: {sizes}. The slots are sized from the input builder's buffers "
                             "(slot_bytes_for): this step holds more than they do")
        return layout

    def _wait_free(self, timeout_s: float | None) -> None:
        """Take a free slot from every reader (all or none)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        taken = []
        try:
            for index, free in enumerate(self._free):
                while True:
                    poll = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
                    if free.acquire(timeout=poll):
                        break
                    if not self._alive(index):
                        raise RuntimeError(f"tensor-parallel rank {index + 1} is gone: it no longer reads the "
                                           "step ring")
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError(f"tensor-parallel rank {index + 1} left {self.num_slots} messages "
                                           f"unread for {timeout_s:.0f} s")
                taken.append(free)
        except BaseException:
            for free in taken:  # the slot stays theirs: no message was posted
                free.release()
            raise

    def close(self) -> None:
        """Unmap and remove the ring (after the readers have stopped)."""
        if self._ring is not None:
            self._ring.close(unlink=True)
            self._ring = None
