"""The engine loop: add requests, step (schedule -> run -> process outputs), abort.

``LLM`` (offline) and the server both drive this class.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from zipage.config import EngineConfig
from zipage.engine.block_manager import BlockManager
from zipage.engine.detokenizer import IncrementalDetokenizer
from zipage.engine.scheduler import Scheduler
from zipage.engine.sequence import Sequence
from zipage.outputs import CompletionOutput, RequestOutput
from zipage.sampling_params import SamplingParams
from zipage.utils.loader import load_config, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    is_prefill: bool
    num_seqs: int
    num_tokens: int  # tokens computed this step
    num_preempted: int
    num_compressed: int = 0
    num_running: int = 0  # running requests once the step was scheduled
    num_waiting: int = 0  # requests waiting (new or preempted) once the step was scheduled
    kv_tokens: int = 0  # decode: cached tokens the step's attention read (the sum of context lengths)
    compression_s: float = 0.0  # wall time of this step's (synchronous) compression
    host_s: float = 0.0  # CPU time of the step outside the model and sampler (scheduling, inputs, outputs)


@dataclass
class EngineStats:
    """Engine-wide numbers since the engine started."""

    num_steps: int = 0
    peak_running: int = 0
    num_compressions: int = 0
    compression_s: float = 0.0
    # one entry per step: (seconds since start, blocks in use, running requests)
    occupancy: list = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig, runner=None):
        """``runner``: the model runner to drive (default: built from ``config``); ``bench replay``
        passes one that only keeps time."""
        from zipage.runner.tensor_parallel import make_runner

        self.config = config
        self.hf_config = load_config(config.model)
        model_max_len = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        config.scheduler.resolve(model_max_len)
        self.tokenizer = load_tokenizer(config.model)
        self.runner = runner if runner is not None else make_runner(config, self.hf_config)
        self.vocab_size = self.runner.vocab_size
        capacity = self.runner.num_blocks * config.cache.block_size
        # Without compression a request must fit the cache at full length; with it, only its
        # prompt must (prefilled whole, compressed at its first decode step).
        self.max_prompt_tokens = config.scheduler.max_model_len - 1
        if config.compression is not None:
            self.max_prompt_tokens = min(self.max_prompt_tokens, capacity - config.cache.block_size)
        elif config.scheduler.max_model_len > capacity:
            raise ValueError(f"max_model_len={config.scheduler.max_model_len} does not fit the KV cache "
                             f"({capacity} tokens); lower max_model_len or give the cache more memory")
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            min_recomputed_tokens=config.compression.window if config.compression else 1)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, config.compression,
                                   self.runner.num_query_slots)
        self._in_flight = None  # (runner handle, tasks) of the asynchronous compression batch
        self.async_scheduling = (config.scheduler.async_scheduling
                                 and getattr(self.runner, "supports_async_scheduling", False))
        self._launched = None  # the step in flight whose tokens are not read yet (asynchronous scheduling)
        self._wait_for_launched = False  # the next schedule needs its tokens (see _count_launched)
        self._waited_s = 0.0
        self.stats = EngineStats()
        self._start_time = time.perf_counter()
        self.eos_token_ids = self._eos_token_ids()
        self._seed_rng = random.Random(config.seed)
        self._request_counter = itertools.count()
        self._requests: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._streamed: dict[str, list[int]] = {}  # streamed request id -> [text chars, token ids] returned

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        for source in (self.hf_config, getattr(self.tokenizer, "generation_config", None)):
            value = getattr(source, "eos_token_id", None)
            ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        try:
            from transformers import GenerationConfig
            gen = GenerationConfig.from_pretrained(self.config.model)
            value = gen.eos_token_id
            ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
        except (OSError, ValueError):
            pass  # no generation_config.json
        return ids

    # -- requests ---------------------------------------------------------
    def prepare_request(self, prompt, params: SamplingParams | None, request_id: str | None = None) -> Sequence:
        """Validate and tokenize one request without adding it (so a batch can be checked first)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: give prompts as lists of token ids")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            token_ids = list(prompt)
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        max_len = self.config.scheduler.max_model_len
        if len(token_ids) > self.max_prompt_tokens:
            limit = (f"max_model_len={max_len} allows at most {max_len - 1} so that one token can be generated"
                     if self.max_prompt_tokens == max_len - 1 else
                     f"the KV cache holds prompts of at most {self.max_prompt_tokens} tokens")
            raise ValueError(f"prompt has {len(token_ids)} tokens; {limit}")
        room = max_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if request_id is None:
            request_id = str(next(self._request_counter))
        elif request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        return Sequence(request_id, text, token_ids, params, max_tokens, seed)

    def add_sequence(self, seq: Sequence, stream: bool = False) -> None:
        """Queue a prepared request. With ``stream``, ``step`` also returns its progress (see ``step``)."""
        self._requests[seq.request_id] = seq
        params = seq.sampling_params
        if self.tokenizer is not None and (params.stop or stream):
            self._detokenizers[seq.request_id] = IncrementalDetokenizer(
                self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens)
        if stream:
            self._streamed[seq.request_id] = [0, 0]
        self.scheduler.add(seq)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    stream: bool = False) -> str:
        seq = self.prepare_request(prompt, params, request_id)
        self.add_sequence(seq, stream)
        return seq.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return None
        if seq.compressing:  # its blocks are being compacted: let that finish first
            self._collect_compression(wait=True)
        self.scheduler.finish(seq, "abort")
        return self._output(seq)

    def close(self) -> None:
        """Stop the tensor-parallel follower processes, if any (the engine is unusable after)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def has_unfinished_requests(self) -> bool:
        # A step still in flight when none is unfinished holds only finished requests: its tokens
        # are dropped whenever it is collected.
        return self.scheduler.has_unfinished()

    # -- the loop ---------------------------------------------------------
    def step(self, async_callback: Callable[[], None] | None = None
             ) -> tuple[list[RequestOutput], StepStats | None]:
        """Run one step; return the outputs it completed and the numbers of the step it ran.

        The outputs are those of the requests that finished and, for requests added with
        ``stream=True``, of every request that gained a token: each such output holds only
        what is new since its previous one (``finished`` marks the last).

        With asynchronous scheduling (the default where the runner allows it) a step is
        scheduled and launched before the previous step's tokens are read, and returns that
        previous step's outputs; the step it launches stays in flight until the next call.
        The schedule needs only token counts, which the host knows. A request that a stop
        token or string ends is found one step late; the token sampled for it in the
        meantime is dropped. Steps return ``None`` numbers when they launched nothing and
        only collected the step in flight.

        ``async_callback``, if given, is called while the device runs the model (before the
        engine waits for tokens), so that host work such as handing outputs over overlaps with
        the device's; it is not called if the step runs no model.
        """
        start = time.perf_counter()
        self._waited_s = 0.0  # of this call, spent waiting for the device's tokens (not host work)
        outputs: list[RequestOutput] = []
        self._collect_compression(wait=False)
        if self._launched is not None and self._wait_for_launched:
            outputs += self._finish_launched()
        batch = self.scheduler.schedule()
        if batch is None and self._launched is not None:
            outputs += self._finish_launched()  # its requests may finish and free what the others wait for
            batch = self.scheduler.schedule()
        if batch is None and self._in_flight is not None:
            self._collect_compression(wait=True)  # nothing else can run until the compaction is done
            batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.has_unfinished():
                bm = self.block_manager
                raise RuntimeError(f"scheduler made no progress: {len(self.scheduler.running)} running, "
                                   f"{len(self.scheduler.waiting)} waiting, {bm.num_free_blocks}/{bm.num_blocks} "
                                   "blocks free")
            return outputs, None
        stats = StepStats(batch.is_prefill, len(batch.seqs), batch.num_tokens, len(batch.preempted),
                          num_compressed=len(batch.compressions), num_running=len(self.scheduler.running),
                          num_waiting=len(self.scheduler.waiting))
        scheduled = time.perf_counter()
        if batch.compressions:
            if self.scheduler.asynchronous:
                self._in_flight = (self.runner.start_compression(batch.compressions), batch.compressions)
                self.scheduler.compression_in_flight = True
            else:
                self.runner.compress(batch.compressions)
            stats.compression_s = time.perf_counter() - scheduled
        host_s = scheduled - start - self._waited_s
        if batch.seqs:
            if self.async_scheduling:
                previous = self._launched
                self._launched = self.runner.launch(batch.seqs, batch.is_prefill, self.eos_token_ids,
                                                    previous=previous)
                self._count_launched(batch, stats)
                if async_callback is not None:
                    async_callback()
                if previous is not None:
                    finished_at, waited = time.perf_counter(), self._waited_s
                    outputs += self._finish(previous)
                    host_s += time.perf_counter() - finished_at - (self._waited_s - waited)
            else:
                token_ids = self.runner.execute(batch.seqs, batch.is_prefill, self.eos_token_ids,
                                                async_callback=async_callback)
                self._count_launched(batch, stats)
                finished_at = time.perf_counter()
                outputs += self._append_tokens(batch.seqs, token_ids)
                host_s += time.perf_counter() - finished_at
        elif self._launched is not None:
            # Only compressions this step: read the step in flight now, since a request this schedule
            # preempted may be readmitted (prefilled from all its tokens) by the next one.
            outputs += self._finish_launched()
        stats.host_s = host_s + self.runner.last_prepare_s
        self._record(stats)
        return outputs, stats

    def _count_launched(self, batch, stats: StepStats) -> None:
        """A launched step's requests hold one more (pending) token, whose KV the step caches.

        The next step waits for this one's tokens (``_wait_for_launched``) when a request
        reaches its length limit, so that its blocks are free for the next schedule as without
        asynchronous scheduling, or uses a repetition penalty, which needs every earlier token.
        """
        wait = False
        for seq in batch.seqs:
            seq.num_pending += 1
            wait = (wait or seq.num_output_tokens >= seq.max_tokens
                    or seq.sampling_params.repetition_penalty != 1.0)
            if batch.is_prefill:
                seq.kv_len = seq.num_tokens - 1
                if seq.num_output_tokens == 1:
                    seq.metrics.num_cached_prompt_tokens = seq.num_prefix_hit_tokens
            else:
                seq.kv_len += 1
                seq.metrics.peak_blocks = max(seq.metrics.peak_blocks, len(seq.block_table))
        if not batch.is_prefill:
            stats.kv_tokens = sum(seq.kv_len for seq in batch.seqs)  # what the step's attention reads
        self._wait_for_launched = wait

    def _finish_launched(self) -> list[RequestOutput]:
        launched, self._launched = self._launched, None
        return self._finish(launched)

    def _finish(self, launched) -> list[RequestOutput]:
        """Read a launched step's tokens (waiting for the device) and hand them to their requests."""
        waiting = time.perf_counter()
        token_ids = self.runner.collect(launched)
        self._waited_s += time.perf_counter() - waiting
        return self._append_tokens(launched.seqs, token_ids)

    def _append_tokens(self, seqs: list[Sequence], token_ids: list[int]) -> list[RequestOutput]:
        """Give each request its sampled token; stop those that are done; return the outputs."""
        outputs = []
        now = time.perf_counter()
        for seq, token_id in zip(seqs, token_ids):
            if seq.is_finished:
                continue  # stopped (or aborted) after this step was launched: the token is dropped
            seq.num_pending -= 1
            seq.token_ids.append(token_id)
            self.block_manager.register_full_blocks(seq)
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                if seq.compressing:  # planned for compression before its stop was seen: let that finish
                    self._collect_compression(wait=True)
                self.scheduler.finish(seq, *reason)
                outputs.append(self._output(seq))
            elif seq.request_id in self._streamed:
                outputs.append(self._partial_output(seq))
        return outputs

    def _collect_compression(self, wait: bool) -> None:
        """Finish the in-flight compression batch if it is done (or, with ``wait``, once it is)."""
        if self._in_flight is None:
            return
        handle, tasks = self._in_flight
        if not self.runner.compression_done(handle, wait):
            return
        self.scheduler.finish_compressions(tasks)
        self._in_flight = None

    def _record(self, step: StepStats) -> None:
        es, bm = self.stats, self.block_manager
        es.num_steps += 1
        es.num_compressions += step.num_compressed
        es.compression_s += step.compression_s
        es.peak_running = max(es.peak_running, step.num_running)
        es.occupancy.append((time.perf_counter() - self._start_time, bm.num_blocks - bm.num_free_blocks,
                             step.num_running))

    def _stop_reason(self, seq: Sequence, token_id: int):
        """``(finish_reason, stop_reason)`` if ``seq`` is done after ``token_id``, else None."""
        params = seq.sampling_params
        detok = self._detokenizers.get(seq.request_id)
        if detok is not None:
            stop = detok.update(seq.output_token_ids)
            if stop is not None:
                return "stop", stop
        num_output = len(seq.token_ids) - seq.num_prompt_tokens  # up to token_id: later ones may be pending
        if num_output >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return "stop", token_id
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return "stop", None
        if num_output >= seq.max_tokens:
            return "length", None
        return None

    def _partial_output(self, seq: Sequence) -> RequestOutput:
        """What a streamed, unfinished request produced since its previous output."""
        sent = self._streamed[seq.request_id]
        text = ""
        detok = self._detokenizers.get(seq.request_id)
        if detok is not None:
            # Hold back what a stop string completed by later tokens could still cut off.
            end = len(detok.text) - (max((len(s) for s in detok.stop), default=1) - 1)
            if end > sent[0]:
                text, sent[0] = detok.text[sent[0]:end], end
        token_ids = seq.token_ids[seq.num_prompt_tokens + sent[1]:]
        prompt_ids = seq.token_ids[:seq.num_prompt_tokens] if sent[1] == 0 else []
        sent[1] += len(token_ids)
        return RequestOutput(seq.request_id, seq.prompt, prompt_ids, [CompletionOutput(0, text, token_ids)],
                             finished=False, metrics=seq.metrics)

    def _output(self, seq: Sequence) -> RequestOutput:
        """The final output of a finished request (for a streamed one: only its new part)."""
        detok = self._detokenizers.pop(seq.request_id, None)
        self._requests.pop(seq.request_id, None)
        output_ids = seq.output_token_ids
        prompt_ids = seq.token_ids[:seq.num_prompt_tokens]
        if detok is not None and detok.stop:
            text = detok.text
        elif self.tokenizer is not None:
            ids = output_ids
            if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str):
                ids = ids[:-1]  # the token that stopped the request is not part of the text
            text = self.tokenizer.decode(ids, skip_special_tokens=seq.sampling_params.skip_special_tokens)
        else:
            text = ""
        sent = self._streamed.pop(seq.request_id, None)
        if sent is not None:
            text, output_ids = text[sent[0]:], output_ids[sent[1]:]
            prompt_ids = prompt_ids if sent[1] == 0 else []
        completion = CompletionOutput(0, text, output_ids, seq.finish_reason, seq.stop_reason)
        return RequestOutput(seq.request_id, seq.prompt, prompt_ids, [completion], finished=True,
                             metrics=seq.metrics)
