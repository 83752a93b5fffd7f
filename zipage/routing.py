"""Which replica serves a request: load balance with prefix affinity.

Used by the data-parallel server (``zipage serve --data-parallel-size N``) and by the
replica simulation of ``zipage bench replay``. Pure bookkeeping, no I/O.

A replica's **load** combines what the router knows at once (requests it sent and
has not seen finish) with what the replica last reported (running and waiting
requests, KV cache usage from 0 to 1)::

    load = max(in_flight, running + waiting) + waiting + kv_weight * kv_usage

Waiting requests count twice (they queue behind the running ones), and a full
cache counts as ``kv_weight`` more requests (it will preempt or queue the next).

**Prefix affinity** keeps requests that share a prompt prefix on one replica, so
its prefix cache serves them: a prompt is cut into chunks, each chunk keyed by a
hash of everything up to it, and an index maps keys to the replica that last got
them. The replica with the longest match wins unless its load exceeds the least
loaded one's by more than ``slack`` (absolute) and ``slack_ratio`` (relative);
then balance wins and the prefix moves.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

POLICIES = ("prefix", "load", "round_robin")


@dataclass
class ReplicaLoad:
    """What a replica last reported, plus the router's own count of requests in flight to it."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # blocks in use over blocks, 0..1
    in_flight: int = 0
    healthy: bool = True

    def score(self, kv_weight: float) -> float:
        return max(self.in_flight, self.running + self.waiting) + self.waiting + kv_weight * self.kv_usage


def chunk_keys(items, chunk: int) -> list[bytes]:
    """Chained keys of the whole ``chunk``-sized pieces of a sequence (text or token ids): key i
    names the first (i + 1) * chunk items, so equal keys mean equal prefixes."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    keys, previous = [], b""
    for start in range(0, len(items) - chunk + 1, chunk):
        piece = items[start:start + chunk]
        data = piece.encode("utf-8", "surrogatepass") if isinstance(piece, str) else repr(list(piece)).encode()
        previous = hashlib.blake2b(previous + data, digest_size=16).digest()
        keys.append(previous)
    return keys


class PrefixIndex:
    """Prefix chunk key -> the replica that last served it, least recently used dropped first."""

    def __init__(self, capacity: int = 1 << 16):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._owner: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def match(self, keys: list[bytes]) -> dict[int, int]:
        """Replica -> how many leading chunks of ``keys`` it holds (consecutive from the first)."""
        matched: dict[int, int] = {}
        for depth, key in enumerate(keys):
            owner = self._owner.get(key)
            if owner is None:
                break
            matched[owner] = depth + 1
        return matched

    def insert(self, keys: list[bytes], replica: int) -> None:
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica restarted with an empty cache: its prefixes are no longer worth following."""
        for key in [k for k, owner in self._owner.items() if owner == replica]:
            del self._owner[key]


class Router:
    """Chooses a replica for each request and tracks what is in flight."""

    def __init__(self, num_replicas: int, policy: str = "prefix", kv_weight: float = 8.0, slack: float = 4.0,
                 slack_ratio: float = 0.25, index_capacity: int = 1 << 16):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        self.policy, self.kv_weight, self.slack, self.slack_ratio = policy, kv_weight, slack, slack_ratio
        self.loads = [ReplicaLoad() for _ in range(num_replicas)]
        self.index = PrefixIndex(index_capacity)
        self._next = 0
        self.prefix_hits = 0  # requests sent where some replica held part of their prefix

    def healthy(self) -> list[int]:
        return [i for i, load in enumerate(self.loads) if load.healthy]

    def choose(self, keys: list[bytes] = ()) -> int:
        """The replica for a request whose prompt has these chunk keys; counts it in flight.
        Raises ``LookupError`` when no replica is healthy."""
        candidates = self.healthy()
        if not candidates:
            raise LookupError("no replica is available")
        turn = {i: (i - self._next) % len(self.loads) for i in candidates}  # ties go in turn
        if self.policy == "round_robin":
            choice = min(candidates, key=turn.__getitem__)
        else:
            scores = {i: self.loads[i].score(self.kv_weight) for i in candidates}
            choice = min(candidates, key=lambda i: (scores[i], turn[i]))
            if self.policy == "prefix" and keys:
                matched = {i: n for i, n in self.index.match(list(keys)).items() if i in scores}
                if matched:
                    self.prefix_hits += 1
                    best = max(matched, key=lambda i: (matched[i], -scores[i]))
                    least = scores[choice]
                    if scores[best] <= least + max(self.slack, self.slack_ratio * least):
                        choice = best
        if self.policy == "prefix" and keys:
            self.index.insert(list(keys), choice)
        self._next = choice + 1
        self.loads[choice].in_flight += 1
        return choice

    def finished(self, replica: int) -> None:
        self.loads[replica].in_flight = max(0, self.loads[replica].in_flight - 1)

    def report(self, replica: int, running: int, waiting: int, kv_usage: float) -> None:
        load = self.loads[replica]
        load.running, load.waiting, load.kv_usage = int(running), int(waiting), float(kv_usage)

    def mark_down(self, replica: int) -> None:
        """The replica stopped answering: route around it and forget its prefixes."""
        self.loads[replica] = ReplicaLoad(healthy=False)
        self.index.forget(replica)

    def mark_up(self, replica: int) -> None:
        self.loads[replica].healthy = True
