"""The offline entry point, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from zipage.config import CompressionConfig, EngineConfig
from zipage.engine.llm_engine import LLMEngine
from zipage.outputs import RequestOutput, RequestsFailed
from zipage.sampling_params import SamplingParams


class LLM:
    """Load a local HuggingFace checkpoint and generate from it.

    >>> llm = LLM("path/to/Qwen3-8B")
    >>> out = llm.generate(["1 + 1 ="], SamplingParams(temperature=0, max_tokens=8))
    >>> print(out[0].outputs[0].text)

    Nothing in the checkpoint directory runs as code: a model whose config or tokenizer
    needs the directory's own Python (``auto_map``) is refused with ``ValueError`` unless
    ``trust_remote_code=True``.
    """

    def __init__(self, model: str, *, device: str | None = None, dtype: str = "auto",
                 block_size: int = 256, gpu_memory_utilization: float = 0.9,
                 kv_cache_memory_bytes: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False, seed: int = 0,
                 compression: CompressionConfig | dict | None = None, trust_remote_code: bool = False,
                 **kwargs):
        self.config = EngineConfig.from_kwargs(
            model, device=device, dtype=dtype, block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager, seed=seed, compression=compression,
            trust_remote_code=trust_remote_code, **kwargs)
        self.engine = LLMEngine(self.config)

    def close(self) -> None:
        """Release the engine's worker processes (tensor parallelism); nothing else needs it."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def stats(self):
        """Engine-wide numbers: steps, peak running requests, compressions, block occupancy."""
        return self.engine.stats

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or many; outputs come back in input order.

        A prompt is a string or a list of token ids. Every request is checked before
        any is scheduled, so a bad one raises ``ValueError`` and nothing is queued. If the
        engine fails a step, the requests it concerned fail and the others complete; then
        ``RequestsFailed`` is raised, holding every output.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = sampling_params
        else:
            params = [sampling_params] * len(prompts)
        seqs = [self.engine.prepare_request(p, sp) for p, sp in zip(prompts, params)]
        for seq in seqs:
            self.engine.add_sequence(seq)
        return self._run(seqs, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of them."""
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                      **(chat_template_kwargs or {}))
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for out in outputs:
            out.prompt = self.tokenizer.decode(out.prompt_token_ids)
        return outputs

    def _run(self, seqs, use_tqdm: bool) -> list[RequestOutput]:
        pending = {s.request_id for s in seqs}
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        try:
            while pending:
                start = time.perf_counter()
                finished, stats = self.engine.step()
                elapsed = time.perf_counter() - start
                for out in finished:
                    if out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        bar.update(1)
                if stats is None:  # nothing launched: the step only collected the last one's tokens
                    if pending and not finished:
                        raise RuntimeError("the engine has unfinished requests but scheduled nothing")
                    continue
                if stats.is_prefill:  # prompt chunks (beside decodes, with chunked prefill)
                    prefill_rate = (stats.num_tokens - stats.num_decodes) / elapsed
                if stats.num_decodes:
                    decode_rate = stats.num_decodes / elapsed
                bar.set_postfix(prefill=f"{prefill_rate:.0f} tok/s", decode=f"{decode_rate:.0f} tok/s",
                                refresh=False)
        except BaseException:
            for request_id in pending:  # leave no request or block behind
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        outputs = [results[s.request_id] for s in seqs]
        if any(o.error is not None for o in outputs):
            raise RequestsFailed(outputs)
        return outputs
