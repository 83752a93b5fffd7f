"""The model runner: builds the model and its KV cache, runs one step, samples.

It turns the scheduler's batch into tensors (``inputs.py``), runs decode steps through
CUDA graphs (``cuda_graph.py``) and steps with prompt tokens through graphs of the layers'
pieces around an eager attention (``piecewise_graph.py``) when it can, and returns one
sampled token per request, with its log probabilities where the request asked (computed
on the device, read back with the tokens). The sampler runs outside the CUDA graphs, on
the logits they return. Rank 0 also keeps the penalised requests' token counts on the
device (``penalties.py``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable

import torch

from zipage.attention.backend import select_backend
from zipage.attention.metadata import AttentionMetadata, attention_metadata
from zipage.config import DTYPES, EngineConfig
from zipage.distributed import all_reduce_min, enable_one_shot_all_reduce
from zipage.engine.sequence import Sequence
from zipage.layers.fusion import enable_fusion
from zipage.layers.sampler import SampledLogprobs, Sampler, compute_logprobs
from zipage.models.registry import build_model
from zipage.outputs import Logprob, PositionLogprobs
from zipage.runner.cuda_graph import DecodeGraphs
from zipage.runner.inputs import InputBuilder, ModelInputs, StepShape, _on_device, sampling_tensors
from zipage.runner.penalties import PenaltyState
from zipage.runner.piecewise_graph import PiecewiseGraphs
from zipage.runner.thinking import ThinkingBudgets
from zipage.compression.executor import Compressor, eager_widths
from zipage.compression.graphs import CompressionGraphs
from zipage.runner.trace import GpuTrace
from zipage.runner.kv_cache import (allocate_kv_cache, allocate_kv_scales, allocate_query_cache, allocate_score_cache,
                                    check_fp8_kv_support, kv_cache_dtype, plan_cache)
from zipage.utils.loader import init_dummy_weights, load_weights

logger = logging.getLogger(__name__)


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's dtype on GPU, float32 on the CPU (fast and exact there)."""
    if DTYPES[name] is not None:
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.bfloat16
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    return torch.bfloat16 if dtype == torch.float32 else dtype


class StepTokens(list):
    """A step's sampled token ids, one per request (a list, as every runner returns), and
    ``logprobs``: per request, its position's log probabilities if it asked, else None
    (``logprobs`` is None when none of the step's requests asked); ``prompt_logprobs``: per
    request, a prefill's prompt log probabilities (one per prompt token after the first) if
    it asked, else None (None when none asked)."""

    def __init__(self, token_ids: list[int], logprobs: list[PositionLogprobs | None] | None = None,
                 prompt_logprobs: list[list[PositionLogprobs] | None] | None = None):
        super().__init__(token_ids)
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs


PROMPT_LOGPROBS_CHUNK = 1024  # prompt positions whose [positions, vocab] logits exist at once


class LaunchedStep:
    """A step queued on the device: its requests and its sampled tokens (and log probabilities,
    where asked), which are copied to the host as soon as the device has them.

    A step whose sampling waits for the host (``ModelRunner.launch(defer_sampling=True)``) holds
    its logits and sampling settings until ``ModelRunner.sample`` queues the sampler."""

    def __init__(self, device: torch.device, seqs: list[Sequence]):
        self.device = device
        self.seqs = seqs
        self.tokens: torch.Tensor | None = None  # on the device: the next step's inputs
        self.unsampled: tuple | None = None  # (logits, SamplingTensors, trace mark) until sampled
        self.prompt: list[tuple[int, SampledLogprobs]] = []  # (row, its prompt's log probabilities)
        self._host, self._ready = None, None
        self._has_logprobs = False

    def sampled(self, tokens: torch.Tensor, logprobs: SampledLogprobs | None) -> None:
        """The sampler is queued: start copying its results to the host."""
        self.tokens, self.unsampled = tokens, None
        self._has_logprobs = logprobs is not None
        results = [tokens]
        for part in ([logprobs] if logprobs is not None else []) + [lp for _, lp in self.prompt]:
            results += [part.token_ids, part.logprobs, part.ranks]
        self._host = results
        if self.device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in results]
            for host, result in zip(self._host, results):
                host.copy_(result, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    @functools.cached_property
    def rows(self) -> dict[Sequence, int]:
        """Each request's row among the tokens (built only when a next step needs it)."""
        return {seq: i for i, seq in enumerate(self.seqs)}

    def token_ids(self) -> StepTokens:
        assert self.unsampled is None and self._host is not None, "a deferred step must be sampled first"
        if self._ready is not None:
            self._ready.synchronize()
        tokens = StepTokens(self._host[0].tolist())
        parts = [[t.tolist() for t in self._host[i:i + 3]] for i in range(1, len(self._host), 3)]
        if self._has_logprobs:
            tokens.logprobs = self._logprobs(*parts.pop(0))
        if self.prompt:
            tokens.prompt_logprobs = [None] * len(self.seqs)
            for (row, _), part in zip(self.prompt, parts):
                k = self.seqs[row].sampling_params.prompt_logprobs
                tokens.prompt_logprobs[row] = [_position(ids, values, rank, k) for ids, values, rank in zip(*part)]
        return tokens

    def _logprobs(self, token_ids, logprobs, ranks) -> list[PositionLogprobs | None]:
        """Per request: {token id: Logprob} of the sampled token and its top k (the rows asked, in
        order, are those of ``sampling_tensors``)."""
        out: list[PositionLogprobs | None] = [None] * len(self.seqs)
        wanted = [(i, seq.sampling_params.logprobs) for i, seq in enumerate(self.seqs)
                  if seq.sampling_params.logprobs is not None]
        for (i, k), ids, values, rank in zip(wanted, token_ids, logprobs, ranks):
            out[i] = _position(ids, values, rank, k)
        return out


def _position(ids: list[int], values: list[float], rank: int, k: int) -> PositionLogprobs:
    """{token id: Logprob} of a position's chosen token (column 0) and its top ``k``."""
    position = {ids[0]: Logprob(values[0], rank)}
    for column in range(1, k + 1):
        position.setdefault(ids[column], Logprob(values[column], column))
    return position


class ModelRunner:
    """One rank's model, caches and step. With tensor parallelism every rank has one
    (``tensor_parallel.py`` drives them); rank ``r`` runs on GPU ``base + r``."""

    supports_async_scheduling = True  # ``launch`` / ``collect``: a step may start before the last one's tokens are read
    supports_logprobs = True  # ``StepTokens.logprobs`` for requests with ``SamplingParams.logprobs``
    supports_structured_outputs = True  # token bitmasks of requests with a grammar (``launch``, ``sample``)
    supports_thinking_budget = True  # ``SamplingParams.thinking_token_budget`` (``thinking.py``)
    supports_prompt_logprobs = True  # ``StepTokens.prompt_logprobs`` for requests with ``prompt_logprobs``

    def __init__(self, config: EngineConfig, hf_config, rank: int = 0):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            if config.tensor_parallel_size > 1:
                self.device = torch.device("cuda", (self.device.index or 0) + rank)
            elif self.device.index is None:  # memory queries need an explicit index
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            if config.tensor_parallel_size > 1 and config.all_reduce == "one-shot":  # every rank, before any forward
                enable_one_shot_all_reduce(self.device)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        if config.cache.kv_cache_dtype == "fp8":  # before loading weights: a GPU that cannot is refused at once
            check_fp8_kv_support(self.device)
        self.kv_dtype = kv_cache_dtype(config.cache, self.dtype)  # float8 e4m3 with kv_cache_dtype="fp8"
        sched, cache = config.scheduler, config.cache
        self.block_size = cache.block_size
        # Block-table columns: what a request at max_model_len would hold (with compression a
        # decoding request holds far fewer, CompressionConfig.max_blocks_per_seq).
        self.max_table_blocks = -(-sched.max_model_len // self.block_size)

        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = build_model(hf_config, sched.max_model_len, config.quantization)
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.eval()
        if self.model.quantization == "fp8":
            from zipage.layers.quant import log_fp8_paths
            log_fp8_paths(self.device, self.dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, config.model)
        self.spec = self.model.spec
        self.vocab_size = self.spec.vocab_size

        # Compiled elementwise kernels on CUDA (process-wide switch; see layers/fusion.py).
        enable_fusion(self.device.type == "cuda" and not config.enforce_eager)
        self.backend = select_backend(config.attention_backend, self.device)
        for layer in self.model.attention_layers():
            layer.backend = self.backend
        self.backend.warm_up(self.spec.head_dim, self.dtype, self.device)
        # Only rank 0 samples. Its penalty rows exist before the cache is sized (below): the
        # profile and the free memory both count them, so the KV cache gets what they leave.
        self.penalties = PenaltyState(sched.max_num_seqs, self.vocab_size, self.device) if rank == 0 else None
        if self.penalties is not None:
            logger.info("penalty state: %d rows of %d tokens (%.0f MiB)", sched.max_num_seqs, self.vocab_size,
                        self.penalties.nbytes / 2**20)
        self.thinking = ThinkingBudgets(sched.max_num_seqs, self.device) if rank == 0 else None
        self.sampler = Sampler(self.penalties, config.logprobs_mode, self.thinking)
        compression = config.compression
        window = compression.window if compression else None
        if self.device.type == "cuda":
            self._profile_peak_activation()
        # Steps with prompt tokens: graphs of the layers' pieces between attentions (on the CPU, the
        # same pieces as functions). They touch no cache, so they are captured now and the cache is
        # sized with their memory counted.
        self.piecewise = None
        graph_tokens = min(config.piecewise_graph_tokens, sched.max_num_batched_tokens)
        if graph_tokens > 0 and not config.enforce_eager:
            self.piecewise = PiecewiseGraphs(self.model, graph_tokens, self.device)
            self.piecewise.capture()
        self.num_blocks, self.num_query_slots = plan_cache(
            self.model.local_spec, cache, compression, self.dtype, self.device, sched.max_num_seqs, self.max_table_blocks)
        # Every rank must hold the same blocks and slots: the scheduler's plan names them.
        self.num_blocks, self.num_query_slots = all_reduce_min([self.num_blocks, self.num_query_slots], self.device)
        self.inputs = InputBuilder(self.device, self.block_size, sched.max_num_seqs, sched.max_num_batched_tokens,
                                   self.max_table_blocks, window, self.num_query_slots)
        if compression is not None:
            self.query_cache = allocate_query_cache(self.model, self.num_query_slots, window, self.dtype,
                                                    self.device)
        self.kv_cache = allocate_kv_cache(self.model, self.num_blocks, self.block_size, self.kv_dtype, self.device)
        # float8 cache: its scales [2, layers, blocks, block_size, kv_heads] float32 (each rank its heads')
        self.kv_scales = None
        if config.cache.kv_cache_dtype == "fp8":
            self.kv_scales = allocate_kv_scales(self.model, self.num_blocks, self.block_size, self.device)
        self.compressor = None
        if compression is not None:
            score_cache = None
            if compression.global_score_decay is not None:
                score_cache = allocate_score_cache(self.model.local_spec, self.num_blocks, self.block_size, self.device)
            self.compressor = Compressor(compression, self.kv_cache, score_cache, self.query_cache,
                                         self.spec.head_dim ** -0.5, self.block_size, kv_scales=self.kv_scales)
            if self.device.type == "cuda" and not config.enforce_eager and compression.policy == "zipage":
                per_batch = compression.max_blocks_per_compression // compression.max_blocks_per_seq
                self.compressor.graphs = CompressionGraphs(self.compressor, min(self.num_query_slots, per_batch))
                self.compressor.graphs.capture()
            if self.device.type == "cuda" and not config.enforce_eager:
                self.compressor.warm_up(eager_widths(compression, self.block_size, sched.max_num_batched_tokens,
                                                     self.max_table_blocks, self.compressor.graphs is not None))
        self.last_prepare_s = 0.0  # host time of the last step's input preparation
        self._prompt_parts: dict[Sequence, list[SampledLogprobs]] = {}  # prompt logprobs of earlier chunks
        self._bitmask: torch.Tensor | None = None  # host rows of the constrained requests' token bitmasks
        self._bitmask_read: torch.cuda.Event | None = None  # their last copy to the device is done
        self._bitmask_filler = None
        self._inputs_read: torch.cuda.Event | None = None  # the last step's host-to-device copies are done
        self.compression_stream = None
        self.trace: GpuTrace | None = None
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = DecodeGraphs(self.model, sched.max_num_seqs, self.max_table_blocks, self.device,
                                       self.inputs.no_query_row if compression else None)
            self.graphs.capture()

    def _prompt_logprobs(self, hidden: torch.Tensor, row: int, seq: Sequence) -> SampledLogprobs | None:
        """Raw log probabilities of ``seq``'s prompt tokens after the first, from the hidden states of
        its chunk (its whole prompt comes in chunks from the first token: no prefix-cache hit), a
        run of positions at a time. The chunks' parts are kept until the last chunk, which returns
        them all; an earlier chunk returns None."""
        start = int(self.inputs.cu_seqlens.np[row])  # the host copy of this step's offsets
        first_pos, q_len = seq.chunk
        # Position p predicts token p + 1: this chunk's positions up to the prompt's second last.
        end_pos = min(first_pos + q_len, seq.num_prompt_tokens - 1)
        k = seq.sampling_params.prompt_logprobs
        parts = self._prompt_parts.setdefault(seq, [])
        if end_pos > first_pos:
            targets = torch.as_tensor(seq.token_ids[first_pos + 1:end_pos + 1], dtype=torch.int64)
            if self.device.type != "cpu":
                targets = targets.pin_memory().to(self.device, non_blocking=True)
            for first in range(first_pos, end_pos, PROMPT_LOGPROBS_CHUNK):
                last = min(end_pos, first + PROMPT_LOGPROBS_CHUNK)
                logits = self.model.compute_logits(hidden[start + first - first_pos:start + last - first_pos])
                parts.append(compute_logprobs(logits, targets[first - first_pos:last - first_pos], k))
        if seq.prefilling:
            return None  # more chunks to come
        del self._prompt_parts[seq]
        if not parts:  # a one-token prompt
            empty = torch.empty(0, k + 1, device=self.device)
            return SampledLogprobs(empty.long(), empty, torch.empty(0, dtype=torch.int64, device=self.device))
        return SampledLogprobs(*(torch.cat(column) for column in zip(*(
            (p.token_ids, p.logprobs, p.ranks) for p in parts))))

    def release_graphs(self) -> None:
        """Drop the CUDA graphs and wait for the device (before a tensor-parallel group is left).

        A captured decode graph holds the group's collectives; an NCCL communicator torn
        down while such graphs are alive, or with work in flight, never finished tearing
        down on an H200 pair. Decoding after this runs eagerly."""
        if self.device.type != "cuda":
            return
        self.graphs = self.piecewise = None
        if self.compressor is not None:
            self.compressor.graphs = None
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _profile_peak_activation(self) -> None:
        """One prefill of the largest step, before the cache exists, to measure its memory peak."""
        sched = self.config.scheduler
        num_tokens = sched.max_num_batched_tokens
        num_seqs = min(sched.max_num_seqs, -(-num_tokens // sched.max_model_len))
        lens = [min(sched.max_model_len, num_tokens // num_seqs)] * num_seqs  # positions stay in range
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.empty(0, device=self.device),
                                 context_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
                                 block_tables=torch.empty(0, device=self.device), cu_seqlens_q=cu,
                                 max_seqlen_q=lens[0], max_seqlen_k=lens[0])
        total = sum(lens)
        ids = torch.zeros(total, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        with attention_metadata(meta):
            hidden = self.model(ids, positions)
        self.model.compute_logits(hidden[cu[1:].long() - 1])
        torch.cuda.synchronize(self.device)
        del hidden

    def enable_trace(self) -> GpuTrace | None:
        """Record CUDA events around every step and compression from now on (CUDA only)."""
        if self.device.type == "cuda":
            self.trace = GpuTrace(self.device)
        return self.trace

    def compress(self, tasks) -> None:
        """Compact the planned requests' caches (before this step's forward writes anything)."""
        start = self.trace.mark() if self.trace else None
        self.compressor.run(tasks)
        if self.trace:
            self.trace.compressions.append((start, self.trace.mark()))

    def start_compression(self, tasks):
        """Launch a compaction that overlaps the following decode steps.

        On CUDA it runs on its own stream after the work already queued; the returned
        event tells when it is done. On the CPU it runs inline (returns ``None``).
        """
        if self.device.type != "cuda":
            self.compressor.run(tasks)
            return None
        if self.compression_stream is None:
            self.compression_stream = torch.cuda.Stream(self.device)
        self.compression_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.compression_stream):
            start = self.trace.mark() if self.trace else None
            try:
                self.compressor.run(tasks)
            except BaseException:
                # The kernels already queued still read the sources and write the targets: let them
                # finish before the engine, abandoning the batch, hands those blocks out again.
                self.compression_stream.synchronize()
                raise
            done = torch.cuda.Event(enable_timing=self.trace is not None)
            done.record()
        if self.trace:
            self.trace.compressions.append((start, done))
        return done

    @staticmethod
    def compression_done(handle, wait: bool = False) -> bool:
        if handle is None:
            return True
        if wait:
            handle.synchronize()
            return True
        return handle.query()

    def execute(self, seqs: list[Sequence], is_prefill: bool, eos_token_ids: set[int],
                shape: StepShape | None = None, async_callback: Callable[[], None] | None = None,
                forward_guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                ) -> StepTokens:
        """Run one step for ``seqs`` and return one sampled token id per sequence (``StepTokens``).

        ``shape``: the step's numbers are already in the host buffers (filled by the caller).
        ``async_callback``: host work to overlap with the step, called once the step is queued on
        the device and before waiting for its tokens (on the CPU, before the forward).
        ``forward_guard``: a context around the forward alone, sampling excluded (tensor
        parallelism's: a failure in it concerns the other ranks).
        """
        on_cpu = self.device.type == "cpu"
        if async_callback is not None and on_cpu:
            async_callback()  # no device to wait for: let it run alongside the forward's GIL-free ops
        with forward_guard():
            step = self.launch(seqs, is_prefill, eos_token_ids, shape, defer_sampling=True)
        with torch.inference_mode():  # as launch would have sampled it
            self._sample(step)
        if async_callback is not None and not on_cpu:
            async_callback()  # the device runs the step meanwhile
        return self.collect(step)

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], is_prefill: bool, eos_token_ids: set[int],
               shape: StepShape | None = None, previous: "LaunchedStep | None" = None,
               defer_sampling: bool = False) -> "LaunchedStep":
        """Queue one step for ``seqs`` on the device without waiting for it; ``collect`` gives
        its tokens. ``previous``: the step still in flight, whose sampled tokens are the inputs
        of the requests that have a pending token.

        ``defer_sampling``: queue the forward only; the caller gives the constrained requests'
        matchers their pending tokens, then calls ``sample`` (``zipage/structured.py``)."""
        start = time.perf_counter()
        if self._inputs_read is not None:  # the host buffers are refilled below: their last copies must be done
            self._inputs_read.synchronize()
        if shape is None:
            shape = self.inputs.fill_prefill(seqs) if is_prefill else self.inputs.fill_decode(seqs)
        inputs = self.inputs.to_device(shape)
        if previous is not None and any(s.num_pending for s in seqs):  # a prompt chunk's tokens are on the host
            rows = self.inputs.pending_rows(seqs, previous.rows)
            inputs.input_ids = self.inputs.previous_tokens(inputs.input_ids, rows, previous.tokens, shape)
        sampled = [s for s in seqs if s.samples] if shape.is_prefill else seqs
        if shape.is_prefill:  # per-request sampling state is built when a prompt's last chunk runs
            finished_prompts = [s for s in sampled if s.chunk is not None]
            self.penalties.admit(finished_prompts)
            self.thinking.admit(finished_prompts)
        st = sampling_tensors(sampled, self.vocab_size, eos_token_ids, self.device, self.penalties.rows,
                              self.thinking.rows)
        if self.device.type == "cuda":
            self._inputs_read = torch.cuda.Event()
            self._inputs_read.record()
        self.last_prepare_s = time.perf_counter() - start
        step = LaunchedStep(self.device, sampled)
        wanted = []  # (row in the step, row among the sampled, request) of the chunks wanting prompt logprobs
        if shape.is_prefill and any(s.needs_prompt_logprobs for s in seqs):
            sampled_rows = itertools.accumulate((s.samples for s in seqs), initial=0)
            wanted = [(row, out_row, seq) for row, (seq, out_row) in enumerate(zip(seqs, sampled_rows))
                      if seq.chunk is not None and seq.needs_prompt_logprobs]
        begin = self.trace.mark() if self.trace else None  # the step's GPU work starts with its forward
        logits = self.logits(inputs, wanted, step.prompt)
        step.unsampled = (logits, st, begin)
        if not defer_sampling:
            self._sample(step)
        return step

    @torch.inference_mode()
    def sample(self, step: "LaunchedStep") -> None:
        """Queue the sampler of a step launched with ``defer_sampling``."""
        start = time.perf_counter()
        self._sample(step)
        self.last_prepare_s += time.perf_counter() - start

    def _sample(self, step: "LaunchedStep") -> None:
        logits, st, begin = step.unsampled
        seqs = step.seqs
        if not seqs:  # only earlier chunks of prompts: nothing to sample
            step.sampled(torch.empty(0, dtype=torch.int64, device=self.device), None)
            return
        constrained = [(row, seqs[row].grammar) for row in st.constrained_rows
                       if not seqs[row].is_finished and not seqs[row].grammar.is_terminated]
        if constrained:
            self._add_bitmask(st, constrained)
        token_ids, logprobs = self.sampler.sample(logits, st)
        self.penalties.add_sampled(st, token_ids)  # queued before any later step reads the counts
        if self.trace:
            self.trace.steps.append((begin, self.trace.mark()))
        step.sampled(token_ids, logprobs)

    def _add_bitmask(self, st, constrained: list) -> None:
        """Fill the constrained rows' bitmasks on the host and queue their copy to the device."""
        if self._bitmask is None:
            from zipage.structured import BitmaskFiller

            width = -(-self.vocab_size // 32)
            max_rows = self.config.scheduler.max_num_seqs
            self._bitmask = torch.zeros(max_rows, width, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._bitmask_filler = BitmaskFiller()
        if self._bitmask_read is not None:  # the rows are refilled: their last copy must be done
            self._bitmask_read.synchronize()
        rows, grammars = zip(*constrained)
        self._bitmask_filler.fill(list(grammars), self._bitmask)
        host = self._bitmask[:len(rows)]
        st.bitmask = host.clone() if self.device.type == "cpu" else host.to(self.device, non_blocking=True)
        st.bitmask_rows = _on_device(list(rows), torch.int64, self.device)
        if self.device.type == "cuda":
            self._bitmask_read = torch.cuda.Event()
            self._bitmask_read.record()

    def forget(self, seqs: list[Sequence]) -> None:
        """The engine no longer runs these requests (finished, aborted or preempted): drop their
        per-request state. Safe while a step that holds them is in flight (see ``penalties.py``)."""
        if self.penalties is not None:
            self.penalties.release(seqs)
            self.thinking.release(seqs)
        for seq in seqs:
            self._prompt_parts.pop(seq, None)

    @staticmethod
    def collect(step: "LaunchedStep") -> StepTokens:
        """The token ids (and log probabilities) of a launched step (waits for the device)."""
        return step.token_ids()

    @torch.inference_mode()
    def follow(self, shape: StepShape, arrays: dict, shared_tokens: torch.Tensor | None = None) -> None:
        """A follower rank's step: the forward of rank 0's inputs (the collectives need every
        rank), without sampling. ``arrays``: the step's host arrays, from the step ring
        (``step_channel.py``), read before it returns. With ``pending_rows`` among them
        (asynchronous scheduling: each request's row among the previous step's sampled tokens,
        -1 where its input token is on the host), the pending input tokens are taken from
        ``shared_tokens``, the previous step's tokens that rank 0 broadcast, by the same
        ``previous_tokens`` as on rank 0.

        No wait for the device: this rank's work is ordered by its one stream and by the
        collectives that meet rank 0's; the host buffers are refilled only once the last step's
        copies from them are done (the event, as in ``launch``)."""
        if self._inputs_read is not None:
            self._inputs_read.synchronize()
        self.inputs.load(shape, arrays)
        inputs = self.inputs.to_device(shape)
        pending = arrays.get("pending_rows")
        if pending is not None:
            inputs.input_ids = self.inputs.previous_tokens(inputs.input_ids, pending, shared_tokens, shape)
        if self.device.type == "cuda":
            self._inputs_read = torch.cuda.Event()
            self._inputs_read.record()
        self.logits(inputs)

    def logits(self, inputs: ModelInputs, prompt_rows: list[tuple[int, int, Sequence]] = (),
               prompt_out: list | None = None) -> torch.Tensor:
        """The logits of each sampling sequence's last token. ``prompt_rows``: (row in the step, row
        among the sampling sequences, request) of the prompt chunks whose log probabilities are
        wanted; a prompt's are complete at its last chunk and go to ``prompt_out`` as (row among
        the sampling sequences, values)."""
        if not inputs.metadata.is_prefill and self.graphs is not None and self.graphs.can_run(inputs.num_seqs):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.metadata)
        with attention_metadata(inputs.metadata):
            if self.piecewise is not None and self.piecewise.can_run(inputs.input_ids.shape[0]):
                hidden = self.piecewise.run(inputs.input_ids, inputs.positions)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions)
        for row, out_row, seq in prompt_rows:
            values = self._prompt_logprobs(hidden, row, seq)
            if values is not None:
                prompt_out.append((out_row, values))
        if inputs.logits_indices is not None:
            hidden = hidden[inputs.logits_indices]
        return self.model.compute_logits(hidden)

