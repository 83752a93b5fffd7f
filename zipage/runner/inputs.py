"""Turn a scheduled batch into the tensors of one forward: ids, positions, metadata.

Host work is numpy over preallocated (pinned on CUDA) buffers, one short loop
over the batch; block tables are copied row by row from each request's array.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from zipage.attention.metadata import AttentionMetadata
from zipage.engine.sequence import Sequence
from zipage.layers.sampler import SamplingTensors


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor | None  # prefill: the last token of each sequence that samples
    num_seqs: int


@dataclass(frozen=True)
class StepShape:
    """The sizes and flags of one step whose numbers sit in the host buffers."""

    is_prefill: bool
    num_seqs: int
    num_tokens: int
    width: int  # block-table columns in use
    max_seqlen_q: int
    max_seqlen_k: int
    has_cached_prefix: bool
    num_sampled: int = -1  # prefill: rows that sample (a prompt's earlier chunks do not); -1: all
    num_decodes: int = 0  # prefill: the leading rows that decode (one token each) beside the chunks
    chunk_keys: int = 0  # prefill: the keys the chunks attend to, summed over the chunks


class HostBuffer:
    """A reusable host array (pinned when the device is CUDA) and its device copy."""

    def __init__(self, shape, dtype, device: torch.device):
        self.device = device
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
        self.np = self.host.numpy()

    def to_device(self, *sizes) -> torch.Tensor:
        view = self.host[tuple(slice(0, s) for s in sizes)]
        if self.device.type == "cpu":
            return view.clone()
        return view.to(self.device, non_blocking=True)


class InputBuilder:
    def __init__(self, device: torch.device, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_table_blocks: int, window: int | None = None, num_query_slots: int = 0):
        self.device, self.block_size = device, block_size
        self.window = window  # compression: requests with a slot save the queries of their last `window` tokens
        self.no_query_row = num_query_slots * window if window else -1  # the query cache's spare row
        tokens = max(max_num_batched_tokens, max_num_seqs)
        self.query_slots = HostBuffer((tokens,), torch.int64, device)
        self.input_ids = HostBuffer((tokens,), torch.int64, device)
        self.positions = HostBuffer((tokens,), torch.int64, device)
        self.slot_mapping = HostBuffer((tokens,), torch.int64, device)
        self.context_lens = HostBuffer((max_num_seqs,), torch.int32, device)
        self.cu_seqlens = HostBuffer((max_num_seqs + 1,), torch.int32, device)
        self.block_tables = HostBuffer((max_num_seqs, max_table_blocks), torch.int32, device)
        self.logits_rows = HostBuffer((max_num_seqs,), torch.int64, device)  # prefill: tokens whose logits sample
        # Asynchronous scheduling: for each input token, its row among the previous step's
        # sampled tokens (still on the device), -1 where the host knows it.
        self.previous_rows = HostBuffer((tokens,), torch.int64, device)

    def _block_tables(self, seqs: list[Sequence]) -> tuple[np.ndarray, int]:
        width = max(len(s.block_table) for s in seqs)
        table = self.block_tables.np
        for i, seq in enumerate(seqs):
            table[i, :len(seq.block_table)] = seq.block_table.array()
        return table, width

    def prefill(self, seqs: list[Sequence]) -> ModelInputs:
        return self.to_device(self.fill_prefill(seqs))

    def decode(self, seqs: list[Sequence]) -> ModelInputs:
        return self.to_device(self.fill_decode(seqs))

    def fill_prefill(self, seqs: list[Sequence]) -> StepShape:
        """Write the numbers of a step with prompt chunks into the host buffers.

        Each request computes a run of its tokens: its chunk (``Sequence.chunk``), or, for a
        request that decodes in this step, its last token. The run's keys and values go to
        the cache indices from ``kv_len`` on (equal to the positions unless the request was
        compressed), and its queries attend to the cache up to them. The logits of each run's
        last token are kept for the requests that sample (``Sequence.samples``)."""
        bs = self.block_size
        table, width = self._block_tables(seqs)
        cu = self.cu_seqlens.np
        # The leading decoding rows, one token each, at once (their last token possibly still on
        # the device, patched there); then each prompt chunk.
        d = next((i for i, seq in enumerate(seqs) if seq.chunk is not None), len(seqs))
        kv_lens = self._decode_rows(seqs[:d], table)
        cu[:d + 1] = np.arange(d + 1)
        sampled = 0
        for i in range(d):
            if seqs[i].samples:
                self.logits_rows.np[sampled] = i
                sampled += 1
        n, max_q, max_k, cached, keys = d, 0, int(kv_lens.max()) + 1 if d else 0, False, 0
        for i in range(d, len(seqs)):
            seq = seqs[i]
            assert seq.chunk is not None, f"{seq}: decoding rows come before prompt chunks"
            assert seq.num_pending == 0, f"{seq}: a prefill needs every token on the host"
            start, q_len = seq.chunk
            self.input_ids.np[n:n + q_len] = seq.token_ids[start:start + q_len]
            end, kv_start = start + q_len, seq.kv_len
            pos = np.arange(start, end)
            index = np.arange(kv_start, kv_start + q_len)  # cache indices
            self.positions.np[n:n + q_len] = pos
            self.slot_mapping.np[n:n + q_len] = table[i, index // bs].astype(np.int64) * bs + index % bs
            self.context_lens.np[i] = kv_start + q_len
            if self.window:
                # The queries of the run's last `window` tokens: the observation window of a
                # compression after it (a later chunk's overwrite an earlier chunk's).
                rows = self.query_slots.np[n:n + q_len]
                rows[:] = self.no_query_row
                if seq.query_slot is not None:
                    tail = pos >= end - self.window
                    rows[tail] = seq.query_slot * self.window + pos[tail] % self.window
            n += q_len
            cu[i + 1] = n
            if seq.samples:
                self.logits_rows.np[sampled] = n - 1
                sampled += 1
            max_k = max(max_k, kv_start + q_len)
            max_q, cached = max(max_q, q_len), cached or kv_start > 0
            keys += kv_start + q_len
        return StepShape(True, len(seqs), n, width, max_q or 1, max_k, cached, sampled, d, keys)

    def _decode_rows(self, seqs: list[Sequence], table: np.ndarray) -> np.ndarray:
        """Write the numbers of ``seqs``, each decoding one token, into the buffers' first rows (one
        row per request); return their cached token counts."""
        bs, b = self.block_size, len(seqs)
        kv_lens = np.fromiter((s.kv_len for s in seqs), dtype=np.int64, count=b)
        self.input_ids.np[:b] = [s.token_ids[-1] for s in seqs]  # a pending token's is patched on the device
        self.positions.np[:b] = [s.num_tokens - 1 for s in seqs]
        self.slot_mapping.np[:b] = table[np.arange(b), kv_lens // bs].astype(np.int64) * bs + kv_lens % bs
        self.context_lens.np[:b] = kv_lens + 1
        if self.window:
            w = self.window
            self.query_slots.np[:b] = [self.no_query_row if s.query_slot is None
                                       else s.query_slot * w + (s.num_tokens - 1) % w for s in seqs]
        return kv_lens

    def fill_decode(self, seqs: list[Sequence]) -> StepShape:
        """Write a decode step's numbers into the host buffers."""
        table, width = self._block_tables(seqs)
        kv_lens = self._decode_rows(seqs, table)
        return StepShape(False, len(seqs), len(seqs), width, 1, int(kv_lens.max()) + 1, False)

    @staticmethod
    def pending_rows(seqs: list[Sequence], rows: dict[Sequence, int]) -> np.ndarray:
        """Per request of a step: the row of its input token among the previous step's sampled
        tokens (``rows``) if that token is still pending, else -1."""
        return np.fromiter((rows[s] if s.num_pending else -1 for s in seqs), dtype=np.int64, count=len(seqs))

    def previous_tokens(self, input_ids: torch.Tensor, pending_rows: np.ndarray, sampled: torch.Tensor,
                        shape: StepShape) -> torch.Tensor:
        """``input_ids`` (on the device) with each pending token taken from ``sampled``, the
        previous step's tokens on the device, at its request's row there (``pending_rows``)."""
        n, previous = shape.num_tokens, self.previous_rows.np
        if shape.is_prefill:  # a decoding request's token is the last of its one-token run
            previous[:n] = -1
            last = self.cu_seqlens.np[1:len(pending_rows) + 1] - 1
            pending = pending_rows >= 0
            previous[last[pending]] = pending_rows[pending]
        else:
            previous[:n] = pending_rows
        on_device = self.previous_rows.to_device(n)
        return torch.where(on_device >= 0, sampled[on_device.clamp(min=0)], input_ids)

    def _buffers(self, shape: StepShape) -> dict[str, tuple[HostBuffer, tuple[int, ...]]]:
        """The buffers a step uses and the leading sizes it fills."""
        b, n = shape.num_seqs, shape.num_tokens
        used = {"input_ids": (self.input_ids, (n,)), "positions": (self.positions, (n,)),
                "slot_mapping": (self.slot_mapping, (n,)), "context_lens": (self.context_lens, (b,)),
                "block_tables": (self.block_tables, (b, shape.width))}
        if shape.is_prefill:
            used["cu_seqlens"] = (self.cu_seqlens, (b + 1,))
            used["logits_rows"] = (self.logits_rows, (shape.num_sampled,))
        if self.window:
            used["query_slots"] = (self.query_slots, (n,))
        return used

    def export(self, shape: StepShape) -> dict[str, np.ndarray]:
        """The filled host arrays, for the other tensor-parallel ranks: views of the buffers, which
        the step ring (``step_channel.py``) copies before the next step refills them."""
        return {name: buf.np[tuple(slice(0, s) for s in sizes)] for name, (buf, sizes) in self._buffers(shape).items()}

    def load(self, shape: StepShape, arrays: dict[str, np.ndarray]) -> None:
        """Write arrays exported by another rank into this rank's host buffers."""
        for name, (buf, sizes) in self._buffers(shape).items():
            buf.np[tuple(slice(0, s) for s in sizes)] = arrays[name]

    def to_device(self, shape: StepShape) -> ModelInputs:
        b, n = shape.num_seqs, shape.num_tokens
        query_slots = self.query_slots.to_device(n) if self.window else None
        meta = AttentionMetadata(
            is_prefill=shape.is_prefill, slot_mapping=self.slot_mapping.to_device(n),
            context_lens=self.context_lens.to_device(b), block_tables=self.block_tables.to_device(b, shape.width),
            max_seqlen_q=shape.max_seqlen_q, max_seqlen_k=shape.max_seqlen_k,
            has_cached_prefix=shape.has_cached_prefix, query_slots=query_slots)
        logits_indices = None
        if shape.is_prefill:
            meta.cu_seqlens_q = self.cu_seqlens.to_device(b + 1)
            meta.total_seqlen_k = shape.chunk_keys
            logits_indices = self.logits_rows.to_device(shape.num_sampled)
            d = shape.num_decodes
            if d:  # decodes beside chunks: a decode step and a prefill step (views of the same tensors)
                meta.decode_part = AttentionMetadata(
                    is_prefill=False, slot_mapping=meta.slot_mapping[:d], context_lens=meta.context_lens[:d],
                    block_tables=meta.block_tables[:d], max_seqlen_k=shape.max_seqlen_k)
                meta.chunk_part = AttentionMetadata(
                    is_prefill=True, slot_mapping=meta.slot_mapping[d:], context_lens=meta.context_lens[d:],
                    block_tables=meta.block_tables[d:], cu_seqlens_q=meta.cu_seqlens_q[d:] - d,
                    max_seqlen_q=shape.max_seqlen_q, max_seqlen_k=shape.max_seqlen_k,
                    has_cached_prefix=shape.has_cached_prefix, total_seqlen_k=shape.chunk_keys)
        return ModelInputs(self.input_ids.to_device(n), self.positions.to_device(n), meta,
                           logits_indices=logits_indices, num_seqs=b)


def _on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied from pinned memory: a copy from pageable
    memory would first wait for all the work queued on the device (the step in flight)."""
    host = torch.tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


def sampling_tensors(seqs: list[Sequence], vocab_size: int, eos_token_ids: set[int], device: torch.device,
                     penalty_rows: Mapping[Sequence, int] | None = None,
                     thinking_rows: Mapping[Sequence, int] | None = None) -> SamplingTensors:
    """Per-row sampling settings for ``seqs``; optional parts only when some row uses them.
    ``penalty_rows``: the penalty-state row of each request with penalties (``runner/penalties.py``);
    ``thinking_rows``: the budget-state row of each request with a thinking budget (``runner/thinking.py``)."""
    params = [s.sampling_params for s in seqs]
    all_greedy = all(p.temperature == 0.0 for p in params)

    def floats(values):
        return _on_device(values, torch.float32, device)

    top_k = top_p = min_p = None
    if not all_greedy:
        if any(p.top_k > 0 for p in params):
            top_k = _on_device([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64, device)
        if any(p.top_p < 1.0 for p in params):
            top_p = floats([p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):
            min_p = floats([p.min_p for p in params])
    st = SamplingTensors(
        temperatures=floats([p.temperature for p in params]), top_k=top_k, top_p=top_p, min_p=min_p,
        seeds=_on_device([s.seed for s in seqs], torch.int64, device),
        steps=_on_device([s.num_output_tokens for s in seqs], torch.int64, device),
        all_greedy=all_greedy)
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if penalised:
        _add_penalties(st, [seqs[i] for i in penalised], penalised, len(seqs), penalty_rows or {}, device)
    rows, tokens, wanted, budgeted = [], [], [], []
    for i, seq in enumerate(seqs):  # one pass for the per-row options
        p = params[i]
        if seq.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
            banned = [t for t in banned if t < vocab_size]
            rows += [i] * len(banned)
            tokens += banned
        if p.logprobs is not None:
            wanted.append(i)
        if p.thinking_token_budget is not None:
            budgeted.append(i)
        if seq.grammar is not None:
            st.constrained_rows.append(i)
    if rows:
        st.banned_rows = _on_device(rows, torch.int64, device)
        st.banned_tokens = _on_device(tokens, torch.int64, device)
    if wanted:
        st.logprob_rows = _on_device(wanted, torch.int64, device)
        st.max_logprobs = max(params[i].logprobs for i in wanted)
    if budgeted:
        index = [(thinking_rows or {}).get(seqs[i], -1) for i in budgeted]
        if -1 in index:
            raise RuntimeError(f"{seqs[budgeted[index.index(-1)]]} has a thinking budget but no budget row")
        st.thinking_rows, st.thinking_index = _on_device([budgeted, index], torch.int64, device).unbind(0)
    return st


def _add_penalties(st: SamplingTensors, seqs: list[Sequence], index: list[int], batch: int,
                   penalty_rows: Mapping[Sequence, int], device: torch.device) -> None:
    """Set ``st``'s penalty fields for ``seqs``, the rows ``index`` of a batch of ``batch``:
    two copies (values, rows) whatever their number."""
    rows = [penalty_rows.get(seq, -1) for seq in seqs]
    if -1 in rows:
        seq = seqs[rows.index(-1)]
        raise RuntimeError(f"{seq} has penalties but no penalty row: its prefill gives it one, and the "
                           "runner must not forget it while it runs")
    params = [seq.sampling_params for seq in seqs]
    values = _on_device([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                         [p.presence_penalty for p in params]], torch.float32, device)
    st.repetition_penalty, st.frequency_penalty, st.presence_penalty = values.unbind(0)
    st.penalty_rows, penalty_index = _on_device([rows, index], torch.int64, device).unbind(0)
    st.penalty_index = None if len(index) == batch else penalty_index
