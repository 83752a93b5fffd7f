"""A GPU timeline from CUDA events: when each step's forward ran, when each compression ran.

Benchmarks switch it on (``ModelRunner.enable_trace``) to show whether compression
on its side stream overlaps decoding: the events mark the start and end of each
step's GPU work on the main stream and of each compression on its stream, and
``summary`` measures GPU idle time and how much compression time was hidden
under decode steps. Recording an event costs a few microseconds; the timestamps
are read once, at the end.
"""

from __future__ import annotations

import bisect

import torch


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The sorted, disjoint intervals covering ``intervals``."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


class _Cover:
    """A union of intervals that answers how much of an interval it covers in O(log n + k)
    (a run records tens of thousands of steps and thousands of compressions)."""

    def __init__(self, intervals: list[tuple[float, float]]):
        self.union = merge_intervals(intervals)
        self.ends = [b for _, b in self.union]

    def overlap(self, start: float, end: float) -> float:
        total, i = 0.0, bisect.bisect_right(self.ends, start)  # the first interval ending after start
        while i < len(self.union) and self.union[i][0] < end:
            a, b = self.union[i]
            total += min(end, b) - max(start, a)
            i += 1
        return total

    def length(self) -> float:
        return sum(b - a for a, b in self.union)


def timeline_summary(steps: list[tuple[float, float]], compressions: list[tuple[float, float]]) -> dict:
    """Idle and overlap figures (seconds) from step and compression intervals (seconds)."""
    if not steps:
        return {}
    step_cover, comp_cover, busy = _Cover(steps), _Cover(compressions), _Cover(steps + compressions)
    span = busy.ends[-1] - busy.union[0][0]
    compression_total = sum(b - a for a, b in compressions)
    hidden = sum(step_cover.overlap(a, b) for a, b in compressions)
    gaps = [steps[i + 1][0] - steps[i][1] - comp_cover.overlap(steps[i][1], steps[i + 1][0])
            for i in range(len(steps) - 1) if steps[i + 1][0] > steps[i][1]]
    overlapped = [b - a for a, b in steps if comp_cover.overlap(a, b) > 0]
    alone = [b - a for a, b in steps if comp_cover.overlap(a, b) == 0]
    return dict(
        gpu_span_s=span, gpu_busy_s=busy.length(), gpu_idle_s=span - busy.length(),
        idle_ms_per_step=1000 * sum(gaps) / len(steps),
        compression_gpu_s=compression_total, compression_hidden_s=hidden,
        compression_hidden_fraction=hidden / compression_total if compression_total else None,
        step_ms_alone=1000 * sum(alone) / len(alone) if alone else None,
        step_ms_under_compression=1000 * sum(overlapped) / len(overlapped) if overlapped else None,
        steps=len(steps), compressions=len(compressions))


class GpuTrace:
    def __init__(self, device: torch.device):
        self.device = device
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin.record()
        self.steps: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.compressions: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @staticmethod
    def mark() -> torch.cuda.Event:
        """An event recorded now on the current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, pairs) -> list[tuple[float, float]]:
        return [(self.origin.elapsed_time(a) / 1000, self.origin.elapsed_time(b) / 1000) for a, b in pairs]

    def summary(self) -> dict:
        torch.cuda.synchronize(self.device)
        return timeline_summary(self._seconds(self.steps), self._seconds(self.compressions))
