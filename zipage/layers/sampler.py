"""Token sampling: penalties, temperature, top-k / top-p / min-p, seeded noise.

Sampling draws ``argmax(p / E)`` with ``E ~ Exp(1)`` (the exponential race, which
picks token i with probability p_i). ``E`` is a hash of (request seed, output
index, token id), so a request's samples depend only on its own seed and position:
reproducible whatever else shares the batch, and the same after preemption.

Penalties read per-request token counts kept on the device (``runner/penalties.py``);
structured output masks each constrained row with its grammar's token bitmask
(``zipage/structured.py``) after penalties and bans, before temperature and the draw.

Log probabilities are computed here too, on the device and for the rows that ask only:
``log_softmax`` of the model's logits (``logprobs_mode="raw"``) or of the logits the
sampler drew from (``"processed"``: after penalties, bans, temperature and the top-k /
top-p / min-p masks), then the sampled token's value and rank and the top ``k``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zipage.layers.fusion import fused
from zipage.structured import apply_token_bitmask

if TYPE_CHECKING:
    from zipage.runner.penalties import PenaltyState
    from zipage.runner.thinking import ThinkingBudgets

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit constant as the signed int64 torch stores."""
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX1, _MIX2 = _signed(0xFF51AFD7ED558CCD), _signed(0xC4CEB9FE1A85EC53)
_GOLDEN = _signed(0x9E3779B97F4A7C15)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit finaliser (murmur3's fmix64): every input bit affects every output bit."""
    x = x ^ _shift_right(x, 33)
    x = x * _MIX1
    x = x ^ _shift_right(x, 33)
    x = x * _MIX2
    return x ^ _shift_right(x, 33)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [batch, vocab], a pure function of (seed, step, token id)."""
    row = _mix64(seeds.long() * _GOLDEN + steps.long())
    x = _mix64(row[:, None] + torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)[None, :])
    # 23 bits, so that v + 0.5 is exact in float32 (with 24 bits the top value rounded to
    # 2**24, giving uniform == 1 and noise -0.0, and 0 / -0.0 = NaN won the argmax).
    uniform = (_shift_right(x, 41).float() + 0.5) * (1.0 / (1 << 23))  # in (0, 1)
    return -torch.log(uniform)


@fused
def exponential_race(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                     steps: torch.Tensor) -> torch.Tensor:
    """``argmax(softmax(logits / T) / E)``, taken in log space: softmax's normaliser is the
    same for a whole row, so the winner is ``argmax(logits / T - log E)`` (one pass when fused)."""
    noise = exponential_noise(seeds, steps, logits.shape[-1])
    return (logits / temperatures[:, None] - torch.log(noise)).argmax(dim=-1)


@dataclass
class SamplingTensors:
    """Per-row sampling settings of one step, on the logits' device."""

    temperatures: torch.Tensor  # [batch] float32; 0 = greedy
    top_k: torch.Tensor | None  # [batch] int64, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [batch] float32
    min_p: torch.Tensor | None  # [batch] float32
    seeds: torch.Tensor  # [batch] int64
    steps: torch.Tensor  # [batch] int64: index of the output token being sampled
    all_greedy: bool
    # Penalties of the P rows that use any: their values ([P] float32), their rows of the penalty
    # state ([P] int64) and their rows in the batch ([P] int64; None when every row has penalties).
    repetition_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    penalty_rows: torch.Tensor | None = None
    penalty_index: torch.Tensor | None = None
    # (row, token) pairs forbidden this step (end-of-sequence before min_tokens)
    banned_rows: torch.Tensor | None = None
    banned_tokens: torch.Tensor | None = None
    # Rows that want log probabilities ([L] int64, None if none) and the most alternatives
    # (top k) any of them wants.
    logprob_rows: torch.Tensor | None = None
    max_logprobs: int = 0
    # Structured output: the token bitmasks ([G, ceil(vocab / 32)] int32, a set bit allows its token)
    # of the G constrained rows ([G] int64); see zipage/structured.py.
    bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None
    constrained_rows: list[int] = field(default_factory=list)  # on the host: rows whose request has a grammar
    # Thinking budgets: the rows of requests with one ([T] int64) and their rows of the budget
    # state ([T] int64); see runner/thinking.py.
    thinking_rows: torch.Tensor | None = None
    thinking_index: torch.Tensor | None = None


@dataclass
class SampledLogprobs:
    """Log probabilities of the L rows that asked, on the device: column 0 is the sampled token,
    columns 1..k the k most likely tokens in order (k: the most any row asked for)."""

    token_ids: torch.Tensor  # [L, k + 1] int64
    logprobs: torch.Tensor  # [L, k + 1] float32
    ranks: torch.Tensor  # [L] int64: the sampled token's rank (1 = most likely)


LOGPROBS_MODES = ("raw", "processed")


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> SampledLogprobs:
    """``log_softmax`` of ``logits`` [L, vocab] in float32: the values and ranks of ``tokens`` [L]
    and the top ``k``. Only [L, k + 1] numbers leave this function, never a [L, vocab] row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    sampled = tokens[:, None]
    sampled_logprob = logprobs.gather(1, sampled)
    ranks = (logprobs > sampled_logprob).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return SampledLogprobs(torch.cat([sampled, top_ids], dim=1), torch.cat([sampled_logprob, top_logprobs], dim=1),
                           ranks)


@fused
def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, rows: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """``logits`` [P, vocab] penalised in float32 as in vLLM, in its order: repetition on every token
    of the prompt or output so far (``counts`` and ``prompt_mask`` at ``rows``), then frequency per
    occurrence in the output, then presence. Converting and gathering here lets one fused kernel do it."""
    logits = logits.float()
    counts = counts[rows]
    in_output = counts > 0
    penalty = repetition[:, None]
    repeated = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(prompt_mask[rows] | in_output, repeated, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * in_output


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """Mask to -inf every token outside top-k, then outside the top-p mass, then below min-p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= rank >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if top_p is not None or min_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        if top_p is not None:
            # Drop a token when the mass before it already reaches top_p (the first is always kept).
            # Rows with top_p = 1 keep everything: float32 rounding can bring the running sum
            # to 1.0 before the tail, which must not drop tokens of a disabled row.
            drop |= ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
        if min_p is not None:
            drop |= probs < min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    def __init__(self, penalties: PenaltyState | None = None, logprobs_mode: str = "raw",
                 thinking: ThinkingBudgets | None = None):
        """``penalties``: the runner's ``PenaltyState``, whose rows penalised requests read.
        ``logprobs_mode``: "raw" or "processed" (see the module's docstring). ``thinking``: the
        runner's ``ThinkingBudgets``, which replaces a sampled token by the end of thinking where a
        request's budget is spent (the log probabilities are then the forced token's)."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.penalties = penalties
        self.logprobs_mode = logprobs_mode
        self.thinking = thinking

    def __call__(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """Next token id of every row [batch] (int64)."""
        return self.sample(logits, st)[0]

    def sample(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """Next token id of every row [batch] (int64), and the log probabilities of the rows of
        ``st.logprob_rows`` (None if none asked)."""
        tokens, processed, scale = self._sample(logits, st)
        if st.thinking_rows is not None:
            tokens = self.thinking.force(st, tokens)
        if st.logprob_rows is None:
            return tokens, None
        rows = st.logprob_rows
        if self.logprobs_mode == "raw":
            source = logits[rows]
        else:  # the temperature the race divides by, applied to the rows asked only
            source = processed[rows] if scale is None else processed[rows] / scale[rows, None]
        return tokens, compute_logprobs(source, tokens[rows], st.max_logprobs)

    def _sample(self, logits: torch.Tensor, st: SamplingTensors
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The tokens, and the logits they were drawn from as ``processed / scale[:, None]`` (``scale``
        None: 1), so that the division is done only for rows that want processed logprobs."""
        if st.all_greedy and st.penalty_rows is None and st.banned_rows is None and st.bitmask is None:
            # Converting to float32 keeps the order (and the first of equal values wins either
            # way): skip the copy of the whole [batch, vocab] logits.
            return logits.argmax(dim=-1), logits, None
        if st.penalty_rows is not None:
            logits = self._penalise(logits, st)
        logits = logits.float()
        if st.banned_rows is not None:
            # torch.full, not torch.tensor: a host value copied to the device would wait for its queue
            logits = logits.index_put((st.banned_rows, st.banned_tokens),
                                      torch.full((), float("-inf"), device=logits.device))
        if st.bitmask is not None:
            logits = apply_token_bitmask(logits, st.bitmask, st.bitmask_rows)
        greedy = logits.argmax(dim=-1)
        if st.all_greedy:
            return greedy, logits, None
        temperatures = torch.where(st.temperatures > 0, st.temperatures, torch.ones_like(st.temperatures))
        if st.top_k is not None or st.top_p is not None or st.min_p is not None:
            logits = apply_top_k_top_p_min_p(logits / temperatures[:, None], st.top_k, st.top_p, st.min_p)
            temperatures = torch.ones_like(temperatures)
        sampled = exponential_race(logits, temperatures, st.seeds, st.steps)
        return torch.where(st.temperatures > 0, sampled, greedy), logits, temperatures

    def _penalise(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """``logits`` in float32 with the penalised rows' penalties applied (out of place: the
        caller's stay)."""
        index = st.penalty_index
        rows = logits if index is None else logits[index]
        rows = apply_penalties(rows, self.penalties.counts, self.penalties.prompt_mask, st.penalty_rows,
                               st.repetition_penalty, st.frequency_penalty, st.presence_penalty)
        return rows if index is None else logits.float().index_put((index,), rows)
