"""Thinking budgets: end a request's thinking after ``thinking_token_budget`` tokens.

A reasoning model writes its thinking between ``<think>`` and ``</think>``. A request
with ``SamplingParams.thinking_token_budget = N`` may write at most N tokens there: the
token that would be its (N+1)-th thinking token is replaced by ``</think>``, and
decoding goes on with the answer.

The count lives on the device, in a row per request: ``phase`` (0 before thinking, 1
thinking, 2 done) and ``count`` (thinking tokens so far). Right after sampling, the
budgeted rows are updated from their sampled tokens and the forced ``</think>``
replaces the sampled token where the budget is spent, all on the device. So a step
launched before the host has the previous step's tokens (asynchronous scheduling)
still forces at the right token, and the host does nothing per token.

A row is (re)built from the host's token ids at each prefill of its request, by
replaying the same rules over them (``replay``): a prompt that ends inside an open
``<think>`` (templates that open the thinking for the model) starts in phase 1; a
preempted request resumes where it was. Rows are reused in launch order on the device's
queue, as the penalty rows are (``penalties.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from zipage.engine.sequence import Sequence, SequenceStatus
from zipage.layers.sampler import SamplingTensors
from zipage.runner.inputs import _on_device

BEFORE, THINKING, DONE = 0, 1, 2


def replay(prompt_ids, output_ids, start_id: int, end_id: int, budget: int) -> tuple[int, int]:
    """``(phase, count)`` after ``output_ids``, following the rules the device applies."""
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    starts, ends = np.flatnonzero(prompt == start_id), np.flatnonzero(prompt == end_id)
    phase = THINKING if len(starts) and (not len(ends) or starts[-1] > ends[-1]) else BEFORE
    count = 0
    for token in output_ids:
        if phase == BEFORE and token == start_id:
            phase = THINKING
        elif phase == THINKING:
            if token == end_id:
                phase = DONE
            else:
                count += 1
    return phase, count


class ThinkingBudgets:
    """Per-request thinking-budget rows on the device, handed out at prefill, freed by ``release``."""

    def __init__(self, num_rows: int, device: torch.device):
        self.device = device
        self.state = torch.zeros(num_rows, 3, dtype=torch.int32, device=device)  # phase, count, budget
        self.rows: dict[Sequence, int] = {}
        self._free = list(range(num_rows))[::-1]
        self.start_id: int | None = None  # the tokenizer's <think> and </think> (``configure``)
        self.end_id: int | None = None

    def configure(self, start_id: int, end_id: int) -> None:
        self.start_id, self.end_id = start_id, end_id

    def admit(self, seqs: list[Sequence]) -> None:
        """At a prefill: give each budgeted request a row and rebuild it from its token ids."""
        budgeted = [s for s in seqs if s.sampling_params.thinking_token_budget is not None]
        if not budgeted:
            return
        if self.start_id is None:
            raise RuntimeError("thinking_token_budget needs the <think> and </think> token ids (configure)")
        values = []
        for seq in budgeted:
            assert seq.num_pending == 0, f"{seq}: a prefill needs every token on the host"
            if seq not in self.rows:
                if not self._free:
                    raise RuntimeError(f"{seq} needs a thinking-budget row but all {len(self.rows)} are held")
                self.rows[seq] = self._free.pop()
            budget = seq.sampling_params.thinking_token_budget
            phase, count = replay(seq.token_ids[:seq.num_prompt_tokens], seq.token_ids[seq.num_prompt_tokens:],
                                  self.start_id, self.end_id, budget)
            values.append([phase, count, budget])
        rows = _on_device([self.rows[s] for s in budgeted], torch.int64, self.device)
        self.state.index_copy_(0, rows, _on_device(values, torch.int32, self.device))

    def force(self, st: SamplingTensors, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` [batch] with ``</think>`` where a budgeted row's budget is spent; the rows'
        phase and count advanced by the final tokens (out of place for ``tokens``)."""
        if st.thinking_rows is None:
            return tokens
        index = st.thinking_index
        state = self.state[index]
        phase, count, budget = state.unbind(1)
        sampled = tokens[st.thinking_rows]
        forced = (phase == THINKING) & (count >= budget)
        end = torch.full_like(sampled, self.end_id)
        final = torch.where(forced, end, sampled)
        thinking = phase == THINKING
        next_phase = torch.where((phase == BEFORE) & (final == self.start_id), THINKING,
                                 torch.where(thinking & (final == self.end_id), DONE, phase))
        next_count = torch.where(thinking & (final != self.end_id), count + 1, count)
        self.state.index_copy_(0, index, torch.stack([next_phase, next_count, budget], dim=1).to(torch.int32))
        return tokens.index_put((st.thinking_rows,), final)

    def release(self, seqs: Iterable[Sequence]) -> None:
        """Free the rows of requests the engine no longer runs (see ``PenaltyState.release``)."""
        for seq in seqs:
            if seq.status is not SequenceStatus.RUNNING and seq in self.rows:
                self._free.append(self.rows.pop(seq))
