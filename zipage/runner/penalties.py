"""Presence, frequency and repetition penalties: token counts kept on the device.

A request with a penalty holds a row of two tables (``rows x vocab x 5`` bytes in all):
``counts``, how often each token occurs in its output so far (int32), and
``prompt_mask``, which tokens its prompt holds (bool). The row is (re)built from the
host's token ids at each prefill of the request (a preempted request is prefilled
again from all its tokens, all on the host then), and each step adds its sampled
tokens on the device right after sampling. So a step launched before the host has
the previous step's tokens still reads complete counts, and nothing on the host per
step grows with the output.

All of it runs on the device's current stream in launch order: a row that ``release``
frees while a step using it is in flight is rebuilt for its next request only after
that step's update, so reuse needs no wait. The engine tells the runner which
requests it no longer runs (``forget``) before it launches the next step.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from zipage.engine.sequence import Sequence, SequenceStatus
from zipage.layers.sampler import SamplingTensors
from zipage.runner.inputs import _on_device


class PenaltyState:
    """Per-request penalty rows on the device, handed out at prefill, freed by ``release``."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device):
        self.device = device
        self.counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        self.rows: dict[Sequence, int] = {}  # the row of each request holding one
        self._free = list(range(num_rows))[::-1]  # lowest row first
        self._one = torch.ones((), dtype=torch.int32, device=device)  # the increment, made once

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes + self.prompt_mask.nbytes

    def admit(self, seqs: list[Sequence]) -> None:
        """At a prefill: give each penalised request a row (if it holds none) and rebuild the row
        from its token ids, which are all on the host at a prefill."""
        penalised = [s for s in seqs if s.sampling_params.has_penalties]
        if not penalised:
            return
        for seq in penalised:
            assert seq.num_pending == 0, f"{seq}: a prefill needs every token on the host"
            if seq not in self.rows:
                self.rows[seq] = self._take(seq)
        rows = [self.rows[s] for s in penalised]
        rows_on_device = _on_device(rows, torch.int64, self.device)
        self.counts.index_fill_(0, rows_on_device, 0)
        self.prompt_mask.index_fill_(0, rows_on_device, False)
        prompt = _pairs(rows, [s.token_ids[:s.num_prompt_tokens] for s in penalised], self.device)
        self.prompt_mask.index_put_(prompt, torch.ones((), dtype=torch.bool, device=self.device))
        outputs = [s.token_ids[s.num_prompt_tokens:] for s in penalised]
        if any(outputs):  # a preempted request's output so far
            self._add(*_pairs(rows, outputs, self.device))

    def add_sampled(self, st: SamplingTensors, token_ids: torch.Tensor) -> None:
        """Count a step's sampled tokens (on the device) in the rows of its penalised requests."""
        if st.penalty_rows is None:
            return
        sampled = token_ids if st.penalty_index is None else token_ids[st.penalty_index]
        self._add(st.penalty_rows, sampled)

    def release(self, seqs: Iterable[Sequence]) -> None:
        """Free the rows of requests the engine no longer runs. A request running again (preempted,
        then readmitted before the engine said so) keeps the row its prefill rebuilt."""
        for seq in seqs:
            if seq.status is not SequenceStatus.RUNNING and seq in self.rows:
                self._free.append(self.rows.pop(seq))

    def _take(self, seq: Sequence) -> int:
        if not self._free:
            raise RuntimeError(f"{seq} needs a penalty row but all {len(self.rows)} are held by running "
                               "requests: more run than the max_num_seqs the rows were made for")
        return self._free.pop()

    def _add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add one to ``counts`` at each (row, token) pair (repeated pairs add up): an atomic
        index_add_ on the flat table, a few kernels where index_put_'s accumulate sorts first."""
        flat = rows * self.counts.shape[1] + tokens
        self.counts.view(-1).index_add_(0, flat, self._one.expand(flat.shape[0]))


def _pairs(rows: list[int], token_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(row, token) index pairs on the device: every token of ``token_lists[i]`` in row ``rows[i]``."""
    lengths = [len(t) for t in token_lists]
    pairs = np.empty((2, sum(lengths)), dtype=np.int64)
    pairs[0] = np.repeat(rows, lengths)
    pairs[1] = np.concatenate(token_lists)
    return tuple(_on_device(pairs, torch.int64, device).unbind(0))
