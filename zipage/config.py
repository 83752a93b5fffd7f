"""Typed engine configuration, one small dataclass per concern.

``EngineConfig.from_kwargs`` accepts the flat, vLLM-style keyword arguments of
``LLM(...)`` and routes each to the dataclass that owns it. Every value is
checked when the dataclass is built; an error names the field and the range.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace

import torch

DTYPES = {"auto": None, "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_cuda_device(device: str) -> None:
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but CUDA is not available here (torch {torch.__version__}, "
                         f"{'no CUDA build' if torch.version.cuda is None else 'no visible GPU'}); "
                         f"use device='cpu' or leave device unset")
    index = device.split(":", 1)[1] if ":" in device else "0"
    count = torch.cuda.device_count()
    _check(index.isdigit() and int(index) < count,
           f"device={device!r}: the GPU index must be an integer in [0, {count - 1}] ({count} visible)")


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS = (None, "fp8")
ALL_REDUCES = ("nccl", "one-shot")  # EngineConfig.all_reduce


@dataclass
class CacheConfig:
    """Where KV lives: block size and how much memory the cache may take."""

    block_size: int = 256
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # explicit budget; the default on CPU is 1 GiB
    enable_prefix_caching: bool = True
    # "auto": the model's dtype; "fp8" (= "fp8_e4m3"): keys and values stored as float8 e4m3 with
    # a float32 scale per token and KV head (docs/fp8.md), half the bytes of bf16 per kept token
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8_e4m3":
            self.kv_cache_dtype = "fp8"
        _check(_is_int(self.block_size) and 1 <= self.block_size <= 4096
               and self.block_size & (self.block_size - 1) == 0,
               f"block_size must be a power of two in [1, 4096], got {self.block_size!r}")
        _check(isinstance(self.gpu_memory_utilization, (int, float))
               and 0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _check(self.kv_cache_memory_bytes is None
               or (_is_int(self.kv_cache_memory_bytes) and self.kv_cache_memory_bytes > 0),
               f"kv_cache_memory_bytes must be a positive integer or None, got {self.kv_cache_memory_bytes!r}")


@dataclass
class SchedulerConfig:
    """What runs each step: batch limits and the context limit."""

    max_num_seqs: int = 256
    # Tokens one step computes. Default: 8192 with chunked prefill, else max(8192, max_model_len).
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # Schedule and launch each step before the previous one's tokens reach the host, so the
    # host's work hides under the device's (with tensor parallelism too).
    async_scheduling: bool = True
    # Prefill prompts in chunks of at most max_num_batched_tokens, in steps that also decode the
    # running requests (decodes first). Off: a prompt is prefilled whole, in a step of its own.
    enable_chunked_prefill: bool = True
    # What a prompt chunk costs of max_num_batched_tokens. A chunk of n tokens after p cached
    # ones runs the linear layers for n tokens and attention over about n * (p + n / 2) key
    # pairs, so it costs n * (1 + (p + n / 2) / span) tokens, where span is the keys whose
    # attention costs as many FLOPs as one token's linear layers: later chunks of a long prompt
    # get fewer tokens and a step's time stays bounded. None: the model's span (computed from
    # its config at load; 23,552 for Qwen3-8B). 0 (the default, as in vLLM): a chunk costs its
    # tokens. Off by default because on an H200 (docs/benchmarks.md, "Long prompts among
    # decoding streams") the smaller chunks did not lower the streams' p99 inter-token latency
    # (measured with steps that mix decodes with a chunk run eagerly, whose floor dominated)
    # and delayed the long prompts' first tokens.
    prefill_attention_span: int | None = 0

    def __post_init__(self):
        _check(isinstance(self.async_scheduling, bool),
               f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        _check(isinstance(self.enable_chunked_prefill, bool),
               f"enable_chunked_prefill must be True or False, got {self.enable_chunked_prefill!r}")
        _check(_is_int(self.max_num_seqs) and 1 <= self.max_num_seqs <= 65536,
               f"max_num_seqs must be an integer in [1, 65536], got {self.max_num_seqs!r}")
        _check(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 2),
               f"max_model_len must be an integer >= 2 or None, got {self.max_model_len!r}")
        _check(self.prefill_attention_span is None
               or (_is_int(self.prefill_attention_span) and self.prefill_attention_span >= 0),
               f"prefill_attention_span must be an integer >= 0 or None, got {self.prefill_attention_span!r}")
        _check(self.max_num_batched_tokens is None
               or (_is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1),
               f"max_num_batched_tokens must be a positive integer or None, got {self.max_num_batched_tokens!r}")

    def resolve(self, model_max_len: int) -> None:
        """Fill the defaults that depend on the model and check the combination."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        _check(self.max_model_len <= model_max_len,
               f"max_model_len={self.max_model_len} exceeds the model's limit of {model_max_len} tokens")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if self.enable_chunked_prefill else max(8192, self.max_model_len)
        # Without chunked prefill a whole prompt must fit in one step's token budget.
        _check(self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
               f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_model_len="
               f"{self.max_model_len} without chunked prefill (a prompt is prefilled in one step)")


REDUNDANCY_MODES = ("lightning", "raw", "off")
# Which tokens a compression keeps: "zipage" (attention, history and redundancy, the method) or a
# baseline scored in the same engine: "attention" (SnapKV-like: window attention with pooling at
# every compression, no history or redundancy), "recency" (StreamingLLM-like: the ``attention_sink``
# first tokens and the most recent ones) or "random" (uniform random eviction, fixed seed).
POLICIES = ("zipage", "attention", "recency", "random")
# When a prompt is compressed while it is prefilled in chunks (chunked prefill): "long" (only a
# prompt too long to be cached whole), "always" (every prompt that reaches N blocks: a request
# never holds more than N blocks plus one chunk) or "off" (prompts are cached whole, then compressed).
PREFILL_COMPRESSION = ("long", "always", "off")


@dataclass
class CompressionConfig:
    """Compressed PagedAttention: a fixed KV budget per request (published defaults).

    A decoding request holds at most ``max_blocks_per_seq`` (N) blocks: N-1 of kept
    tokens plus one working block. Give either N or ``kv_budget_tokens`` (k, a
    multiple of the block size; N = k / block_size + 1).
    """

    kv_budget_tokens: int | None = 2048  # k: tokens kept per layer and KV head
    max_blocks_per_seq: int | None = None  # N; overrides kv_budget_tokens when given
    window: int = 16  # w: observation window (queries of the last w tokens)
    attention_weight: float = 0.2  # lambda: weight of attention against redundancy
    redundancy: str = "lightning"  # "lightning" (within blocks), "raw" (all pairs) or "off"
    redundancy_temperature: float = 0.4  # tau
    similarity_threshold: float = 0.5  # theta: cosine above which keys count as copies
    global_score_decay: float | None = 0.8  # gamma; None turns the history score off
    pooling_width: int | None = 5  # p, odd; None turns pooling off
    pool_every_compression: bool = False  # published: pool only at a request's first compression
    attention_sink: int = 0  # leading tokens always kept
    keep_prompt: bool = False  # also keep each request's prompt, up to half the budget (see protected_tokens)
    layer_group: int = 8  # layers scored and compacted together
    max_blocks_per_compression: int = 600  # caps one compression batch (scratch memory)
    asynchronous: bool = True  # compress on a side CUDA stream while the others decode (see docs/compression.md)
    hybrid: bool = True  # query slots from memory; requests without one decode while far from compressing
    query_slots: int | None = None  # fixes M instead of deriving it from memory
    policy: str = "zipage"  # or a baseline: "attention", "recency", "random" (see POLICIES)
    prefill_compression: str = "long"  # see PREFILL_COMPRESSION

    def __post_init__(self):
        _check(self.kv_budget_tokens is not None or self.max_blocks_per_seq is not None,
               "give kv_budget_tokens or max_blocks_per_seq")
        _check(self.kv_budget_tokens is None or (_is_int(self.kv_budget_tokens) and self.kv_budget_tokens >= 1),
               f"kv_budget_tokens must be a positive integer, got {self.kv_budget_tokens!r}")
        _check(self.max_blocks_per_seq is None or (_is_int(self.max_blocks_per_seq) and self.max_blocks_per_seq >= 2),
               f"max_blocks_per_seq must be an integer >= 2 (one kept block and one working block), "
               f"got {self.max_blocks_per_seq!r}")
        _check(_is_int(self.window) and self.window >= 1, f"window must be an integer >= 1, got {self.window!r}")
        _check(isinstance(self.attention_weight, (int, float)) and 0.0 <= self.attention_weight <= 1.0,
               f"attention_weight must be in [0, 1], got {self.attention_weight!r}")
        _check(self.redundancy in REDUNDANCY_MODES,
               f"redundancy must be one of {REDUNDANCY_MODES}, got {self.redundancy!r}")
        _check(isinstance(self.redundancy_temperature, (int, float)) and self.redundancy_temperature > 0,
               f"redundancy_temperature must be > 0, got {self.redundancy_temperature!r}")
        _check(isinstance(self.similarity_threshold, (int, float)) and -1.0 <= self.similarity_threshold <= 1.0,
               f"similarity_threshold must be in [-1, 1], got {self.similarity_threshold!r}")
        _check(self.global_score_decay is None
               or (isinstance(self.global_score_decay, (int, float)) and 0.0 <= self.global_score_decay <= 1.0),
               f"global_score_decay must be in [0, 1] or None, got {self.global_score_decay!r}")
        _check(self.pooling_width is None
               or (_is_int(self.pooling_width) and self.pooling_width >= 1 and self.pooling_width % 2 == 1),
               f"pooling_width must be an odd integer >= 1 or None, got {self.pooling_width!r}")
        _check(_is_int(self.attention_sink) and self.attention_sink >= 0,
               f"attention_sink must be an integer >= 0, got {self.attention_sink!r}")
        _check(isinstance(self.keep_prompt, bool), f"keep_prompt must be a bool, got {self.keep_prompt!r}")
        _check(_is_int(self.layer_group) and self.layer_group >= 1,
               f"layer_group must be an integer >= 1, got {self.layer_group!r}")
        _check(_is_int(self.max_blocks_per_compression) and self.max_blocks_per_compression >= 1,
               f"max_blocks_per_compression must be a positive integer, got {self.max_blocks_per_compression!r}")
        _check(self.query_slots is None or (_is_int(self.query_slots) and self.query_slots >= 1),
               f"query_slots must be a positive integer or None, got {self.query_slots!r}")
        _check(self.policy in POLICIES, f"policy must be one of {POLICIES}, got {self.policy!r}")
        _check(self.prefill_compression in PREFILL_COMPRESSION,
               f"prefill_compression must be one of {PREFILL_COMPRESSION}, got {self.prefill_compression!r}")

    def resolve(self, block_size: int) -> None:
        """Fix N and k for the cache's block size and check what depends on it.

        A baseline policy switches off what it does not use, so the engine allocates and
        computes nothing for it: no redundancy or history for "attention" (which pools at
        every compression, as SnapKV does whenever it compresses); no attention, pooling,
        history or redundancy for "recency" and "random".
        """
        if self.policy == "attention":
            self.redundancy, self.global_score_decay, self.pool_every_compression = "off", None, True
        elif self.policy in ("recency", "random"):
            self.redundancy, self.global_score_decay, self.pooling_width = "off", None, None
        if self.max_blocks_per_seq is None:
            _check(self.kv_budget_tokens % block_size == 0,
                   f"kv_budget_tokens={self.kv_budget_tokens} must be a multiple of block_size={block_size}")
            self.max_blocks_per_seq = self.kv_budget_tokens // block_size + 1
        self.kv_budget_tokens = (self.max_blocks_per_seq - 1) * block_size
        _check(self.window <= block_size, f"window={self.window} must be <= block_size={block_size}")
        _check(self.window + self.attention_sink <= self.kv_budget_tokens,
               f"window + attention_sink = {self.window + self.attention_sink} must fit the budget of "
               f"{self.kv_budget_tokens} kept tokens")
        _check(self.max_blocks_per_compression >= self.max_blocks_per_seq,
               f"max_blocks_per_compression={self.max_blocks_per_compression} must hold one request's "
               f"{self.max_blocks_per_seq} blocks")

    def protected_tokens(self, num_prompt_tokens: int, kv_budget_tokens: int | None = None) -> int:
        """Leading tokens a compression of a request with this prompt always keeps.

        The attention sink; with ``keep_prompt``, at least the prompt (the question, which a
        reasoning trace may need again at any step), capped at half the budget (the request's
        own, if it asked for one) and below the window so that a long prompt is still
        compressed and decoding keeps room.
        """
        if not self.keep_prompt:
            return self.attention_sink
        budget = kv_budget_tokens if kv_budget_tokens is not None else self.kv_budget_tokens
        cap = min(budget // 2, budget - self.window)
        return max(self.attention_sink, min(num_prompt_tokens, cap))

    def slotless_limit(self, block_size: int, max_blocks: int | None = None) -> int:
        """A request without a query slot may cache tokens only below this index: the
        window of its next compression (the last ``window`` positions of a full budget,
        ``max_blocks`` blocks if the request has a budget of its own) must have its queries saved."""
        return (max_blocks or self.max_blocks_per_seq) * block_size - self.window


# The default piecewise_graph_tokens on one GPU: steps of up to 2,048 tokens (128 decodes beside a
# chunk of 1,920) are where an eager step's launch floor (about 48 ms for Qwen3-8B) is larger than
# its matrix products. Capturing the pieces up to 1,024 tokens added 7.5 s to a Qwen3-8B engine's
# start on an H200; up to 2,048 (20 buckets instead of 12) should add about 12 s.
PIECEWISE_GRAPH_TOKENS = 2048


@dataclass
class EngineConfig:
    """Everything ``LLM(...)`` was asked for."""

    model: str
    device: str | None = None  # None: "cuda" if available, else "cpu"
    dtype: str = "auto"  # "auto": the checkpoint's dtype on GPU, float32 on CPU
    seed: int = 0
    enforce_eager: bool = False
    # Steps with prompt tokens (prefill, or decodes beside prompt chunks) of at most this many
    # tokens replay their layers' non-attention parts as CUDA graphs, around an eager attention
    # (runner/piecewise_graph.py); larger ones run eagerly. 0: all of them run eagerly. None (the
    # default): PIECEWISE_GRAPH_TOKENS on one GPU, else 0 (on the CPU there are no graphs, the
    # pieces would run as functions to the same results; with tensor parallelism the pieces'
    # all-reduces have not yet run on GPUs).
    piecewise_graph_tokens: int | None = None
    load_format: str = "auto"  # "auto": safetensors weights; "dummy": random weights (benchmarks)
    attention_backend: str = "auto"  # "auto", "torch" or "triton"
    tensor_parallel_size: int = 1  # processes (GPUs) sharing the model's heads and weights
    # How tensor-parallel ranks sum their partial outputs: "nccl" (NCCL's all-reduce) or
    # "one-shot" (each rank reads its peers' rows from their memory over NVLink, in one kernel
    # with the residual add and RMSNorm that follow, kernels/one_shot.py; sums of more than
    # distributed.ONE_SHOT_BUFFER_BYTES still go to NCCL). CUDA only; no effect on one GPU.
    all_reduce: str = "nccl"
    trust_remote_code: bool = False  # run Python shipped in the model directory (its auto_map)
    # Log probabilities (SamplingParams.logprobs) of the model's logits ("raw", as vLLM's default
    # raw_logprobs) or of the distribution sampled from ("processed": after penalties, temperature,
    # top-k / top-p / min-p)
    logprobs_mode: str = "raw"
    # JSON grammars of structured output allow any whitespace between tokens (JSON's own rule);
    # True: none beyond a single space after separators, as vLLM's disable_any_whitespace (a
    # model that writes whitespace forever under a JSON grammar then cannot)
    structured_outputs_disable_any_whitespace: bool = False
    # None: the checkpoint's weights as they are (a published FP8 checkpoint is detected from
    # its quantization_config); "fp8": quantize a bf16/fp16 checkpoint's linear layers to float8
    # e4m3 at load, one scale per output channel (docs/fp8.md)
    quantization: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compression: CompressionConfig | None = None  # None: full KV

    def __post_init__(self):
        self.model = os.fspath(self.model)
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        _check(self.device.split(":")[0] in ("cuda", "cpu"),
               f"device must be 'cuda', 'cuda:N', 'cpu' or None, got {self.device!r}")
        if self.is_cuda:
            _check_cuda_device(self.device)
        _check(self.dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        _check(_is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        _check(self.piecewise_graph_tokens is None
               or (_is_int(self.piecewise_graph_tokens) and 0 <= self.piecewise_graph_tokens <= 65536),
               f"piecewise_graph_tokens must be an integer in [0, 65536] or None, got {self.piecewise_graph_tokens!r}")
        _check(isinstance(self.trust_remote_code, bool),
               f"trust_remote_code must be True or False, got {self.trust_remote_code!r}")
        _check(self.load_format in ("auto", "dummy"),
               f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        _check(self.logprobs_mode in ("raw", "processed"),
               f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        _check(isinstance(self.structured_outputs_disable_any_whitespace, bool),
               "structured_outputs_disable_any_whitespace must be True or False, got "
               f"{self.structured_outputs_disable_any_whitespace!r}")
        _check(self.quantization in QUANTIZATIONS,
               f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        _check(self.attention_backend in ("auto", "torch", "triton"),
               f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")
        tp = self.tensor_parallel_size
        _check(_is_int(tp) and tp >= 1, f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        _check(self.all_reduce in ALL_REDUCES, f"all_reduce must be one of {ALL_REDUCES}, got {self.all_reduce!r}")
        _check(self.all_reduce == "nccl" or self.is_cuda,
               f"all_reduce={self.all_reduce!r} needs CUDA GPUs, got device={self.device!r}; use 'nccl'")
        if self.piecewise_graph_tokens is None:
            self.piecewise_graph_tokens = PIECEWISE_GRAPH_TOKENS if self.is_cuda and tp == 1 else 0
        if tp > 1 and self.is_cuda:
            first = int(self.device.split(":")[1]) if ":" in self.device else 0
            _check(first + tp <= torch.cuda.device_count(),
                   f"tensor_parallel_size={tp} from {self.device} needs GPUs {first}..{first + tp - 1}, "
                   f"but {torch.cuda.device_count()} are visible")
        if isinstance(self.compression, dict):
            self.compression = CompressionConfig(**self.compression)
        _check(self.compression is None or isinstance(self.compression, CompressionConfig),
               f"compression must be a CompressionConfig, a dict of its fields or None, "
               f"got {type(self.compression).__name__}")
        if self.compression is not None:  # a copy: the caller's object may serve other engines
            self.compression = replace(self.compression)
            self.compression.resolve(self.cache.block_size)
            _check(self.compression.prefill_compression != "always" or self.scheduler.enable_chunked_prefill,
                   "prefill_compression='always' compresses prompts between their chunks: it needs "
                   "enable_chunked_prefill=True")
        if self.scheduler.max_model_len is not None:
            self._check_budget_fits()

    def resolve(self, model_max_len: int) -> None:
        """Fill the defaults that depend on the model (``SchedulerConfig.resolve``) and check
        what depends on them."""
        self.scheduler.resolve(model_max_len)
        self._check_budget_fits()

    def _check_budget_fits(self) -> None:
        # A request is compressed once its cache outgrows the budget and the working block (at
        # its first decode past them), so a context shorter than that would never be compressed.
        if self.compression is None:
            return
        budget, limit, block = self.compression.kv_budget_tokens, self.scheduler.max_model_len, self.cache.block_size
        _check(limit >= budget + block + 2,
               f"kv_budget_tokens={budget} with max_model_len={limit}: nothing would ever be compressed. A request "
               f"is compressed once it outgrows the budget and one working block of block_size={block} tokens, "
               f"so max_model_len must be >= {budget + block + 2} (or kv_budget_tokens <= {limit - block - 2})")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments; an unknown keyword is a ``ValueError``."""
        groups = {"cache": CacheConfig, "scheduler": SchedulerConfig}
        own = {f.name for f in fields(cls)} - set(groups)  # includes "compression", passed whole
        parts: dict[str, dict] = {name: {} for name in groups}
        top: dict = {}
        for key, value in kwargs.items():
            owner = next((g for g, c in groups.items() if key in {f.name for f in fields(c)}), None)
            if owner is not None:
                parts[owner][key] = value
            elif key in own and key != "model":
                top[key] = value
            else:
                allowed = sorted((own - {"model"}) | {f.name for c in groups.values() for f in fields(c)})
                raise ValueError(f"unknown engine argument {key!r}; allowed: {', '.join(allowed)}")
        return cls(model=model, **top, **{g: groups[g](**parts[g]) for g in groups})
