"""Typed engine configuration, one small dataclass per concern.

``EngineConfig.from_kwargs`` accepts the flat, vLLM-style keyword arguments of
``LLM(...)`` and routes each to the dataclass that owns it. Every value is
checked when the dataclass is built; an error names the field and the range.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

import torch

DTYPES = {"auto": None, "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class CacheConfig:
    """Where KV lives: block size and how much memory the cache may take."""

    block_size: int = 256
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # explicit budget; the default on CPU is 1 GiB
    enable_prefix_caching: bool = True

    def __post_init__(self):
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
    max_num_batched_tokens: int | None = None  # default: max(8192, max_model_len)
    max_model_len: int | None = None  # default: the model's max_position_embeddings

    def __post_init__(self):
        _check(_is_int(self.max_num_seqs) and 1 <= self.max_num_seqs <= 65536,
               f"max_num_seqs must be an integer in [1, 65536], got {self.max_num_seqs!r}")
        _check(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 2),
               f"max_model_len must be an integer >= 2 or None, got {self.max_model_len!r}")
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
            self.max_num_batched_tokens = max(8192, self.max_model_len)
        # Without chunked prefill a whole prompt must fit in one step's token budget.
        _check(self.max_num_batched_tokens >= self.max_model_len,
               f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_model_len="
               f"{self.max_model_len} (a prompt is prefilled in one step)")


@dataclass
class EngineConfig:
    """Everything ``LLM(...)`` was asked for."""

    model: str
    device: str | None = None  # None: "cuda" if available, else "cpu"
    dtype: str = "auto"  # "auto": the checkpoint's dtype on GPU, float32 on CPU
    seed: int = 0
    enforce_eager: bool = False
    load_format: str = "auto"  # "auto": safetensors weights; "dummy": random weights (benchmarks)
    attention_backend: str = "auto"  # "auto", "torch" or "triton"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self):
        self.model = os.fspath(self.model)
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        _check(self.device.split(":")[0] in ("cuda", "cpu"),
               f"device must be 'cuda', 'cuda:N', 'cpu' or None, got {self.device!r}")
        _check(self.dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        _check(_is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        _check(self.load_format in ("auto", "dummy"),
               f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        _check(self.attention_backend in ("auto", "torch", "triton"),
               f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments; an unknown keyword is a ``ValueError``."""
        groups = {"cache": CacheConfig, "scheduler": SchedulerConfig}
        own = {f.name for f in fields(cls)} - set(groups)
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
