"""Size and allocate the paged KV cache: keys and values, each [layers, blocks, block_size,
kv_heads, head_dim].

With ``kv_cache_dtype="fp8"`` the cache holds float8 e4m3 and a second tensor its float32
scales, one per token and KV head: [2, layers, blocks, block_size, kv_heads] (docs/fp8.md).
A float8 cache also stores each block's values token-major (see ``allocate_kv_cache``).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from zipage.kernels.common import FP8_DTYPE, is_fp8

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30


def kv_cache_dtype(cache_config, dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: the model's dtype, or float8 e4m3 with ``kv_cache_dtype="fp8"``."""
    return FP8_DTYPE if cache_config.kv_cache_dtype == "fp8" else dtype


def check_fp8_kv_support(device: torch.device) -> None:
    """Raise a ValueError where a float8 KV cache cannot run: a torch without float8 e4m3, or a
    GPU below compute capability 8.9 (the Triton kernels, which compression uses whatever the
    attention backend, convert float8 in hardware from Ada and Hopper on)."""
    if FP8_DTYPE is None:
        raise ValueError(f"kv_cache_dtype='fp8' needs a torch with float8_e4m3fn (this is {torch.__version__})")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise ValueError(f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or newer (Ada, Hopper, "
                             f"Blackwell); {name} has {major}.{minor}. Use kv_cache_dtype='auto' on this GPU.")


def bytes_per_block(spec, block_size: int, dtype: torch.dtype, with_scores: bool = False) -> int:
    """Keys and values of one block in every layer (plus its float32 history scores). A float8
    ``dtype`` also pays for the keys' and values' float32 scales (one per token and KV head)."""
    per_row = spec.head_dim * dtype.itemsize + (4 if dtype == FP8_DTYPE else 0)
    kv = 2 * spec.num_layers * block_size * spec.num_kv_heads * per_row
    return kv + (spec.num_layers * block_size * spec.num_kv_heads * 4 if with_scores else 0)


def gpu_kv_budget(device: torch.device, utilization: float) -> int:
    """Bytes left for KV once weights, the profiled activation peak and others' use are counted."""
    free, total = torch.cuda.mem_get_info(device)
    used_by_all = total - free
    peak_extra = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    return int(total * utilization - used_by_all - peak_extra)


def plan_cache(spec, cache_config, compression, dtype: torch.dtype, device: torch.device,
               max_num_seqs: int, max_table_blocks: int) -> tuple[int, int]:
    """(KV blocks, query slots) from an explicit budget, the GPU's free memory, or 1 GiB on CPU.

    With compression the budget also pays for the query cache and the history scores.
    The number of query slots M is what the budget affords at one slot plus N blocks
    per request, so M requests at full budget always fit; with hybrid scheduling the
    blocks beyond M * N also serve requests without a slot.
    """
    with_scores = compression is not None and compression.global_score_decay is not None
    per_block = bytes_per_block(spec, cache_config.block_size, kv_cache_dtype(cache_config, dtype), with_scores)
    if cache_config.kv_cache_memory_bytes is not None:
        budget = cache_config.kv_cache_memory_bytes
    elif device.type == "cuda":
        budget = gpu_kv_budget(device, cache_config.gpu_memory_utilization)
    else:
        budget = DEFAULT_CPU_KV_BYTES
    slots = 0
    if compression is not None:
        per_slot = spec.num_layers * compression.window * spec.num_heads * spec.head_dim * dtype.itemsize
        if compression.query_slots is not None:
            slots = compression.query_slots
        else:
            slots = budget // (compression.max_blocks_per_seq * per_block + per_slot)
        slots = min(slots, max_num_seqs)
        if slots < 1:
            raise ValueError(f"KV cache budget of {budget} bytes cannot hold one request at the compression "
                             f"budget ({compression.max_blocks_per_seq} blocks of {per_block} bytes and a query "
                             "slot); raise gpu_memory_utilization or kv_cache_memory_bytes")
        budget -= slots * per_slot
    blocks = budget // per_block
    if device.type == "cpu":  # no use in reserving more than every request at full length needs
        blocks = min(blocks, max_num_seqs * max_table_blocks)
    if blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes; "
                         "raise gpu_memory_utilization or kv_cache_memory_bytes, or lower block_size")
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB), %d query slots", blocks, cache_config.block_size,
                blocks * per_block / 2**30, slots)
    return int(blocks), int(slots)


def allocate_query_cache(model, num_slots: int, window: int, dtype, device) -> torch.Tensor:
    """Window queries for compression: [layers, slots * window + 1, heads, head_dim].

    Slot s keeps the queries of its request's last ``window`` tokens, the token at
    position p in row s * window + p % window; the last row absorbs the writes of
    tokens that save no query (so the write needs no branch and suits CUDA graphs).
    """
    spec = model.local_spec
    queries = torch.zeros(spec.num_layers, num_slots * window + 1, spec.num_heads, spec.head_dim,
                          dtype=dtype, device=device)
    for i, layer in enumerate(model.attention_layers()):
        layer.query_cache = queries[i]
    return queries


def allocate_score_cache(spec, num_blocks: int, block_size: int, device) -> torch.Tensor:
    """History scores of cached tokens: [layers, blocks, block_size, kv_heads] float32."""
    return torch.zeros(spec.num_layers, num_blocks, block_size, spec.num_kv_heads,
                       dtype=torch.float32, device=device)


class KVCache(NamedTuple):
    """The paged cache of every layer: ``keys`` and ``values``, each indexed [layer, block, slot,
    kv_head, dim]; ``cache[0]`` / ``cache[1]`` are the keys / values as well."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def is_cuda(self) -> bool:
        return self.keys.is_cuda

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    def layers(self, which) -> "KVCache":
        """The keys and values of the layers ``which`` (an index or a slice: views)."""
        return KVCache(self.keys[which], self.values[which])

    def block_bytes(self) -> int:
        """Bytes of one block's keys and values in every layer (without a float8 cache's scales)."""
        return 2 * self.keys[:, 0].numel() * self.keys.element_size()


def values_token_major(dtype: torch.dtype) -> bool:
    """Whether the cache stores each block's values token-major: [block, kv_head, dim, slot] in
    memory, so that the tokens of one value dimension are contiguous. A float8 cache does: the decode
    attention's P @ V product sums over tokens, and its fp16/bf16 matrix units take each thread's
    operand as consecutive elements of the summed axis, which a token-major block hands over in
    whole words (a row-major one byte by byte: 1.3x slower attention on an H200, docs/fp8.md)."""
    return is_fp8(dtype)


def allocate_kv_cache(model, num_blocks: int, block_size: int, dtype, device) -> KVCache:
    """Keys and values of all layers; each attention layer gets views of its own. Both are indexed
    [layer, block, slot, kv_head, dim]; with a float8 ``dtype`` the values are stored token-major
    (``values_token_major``: strides (blocks * B, B, 1, head_dim * block_size, block_size) with
    B the elements of a block). Zeroed, so that slots never written hold finite values (kernels
    read past contexts, masked or multiplied by zero)."""
    spec = model.local_spec
    shape = (spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    keys = torch.zeros(shape, dtype=dtype, device=device)
    if values_token_major(dtype):
        values = torch.zeros(spec.num_layers, num_blocks, spec.num_kv_heads, spec.head_dim, block_size,
                             dtype=dtype, device=device).permute(0, 1, 4, 2, 3)
    else:
        values = torch.zeros(shape, dtype=dtype, device=device)
    for i, layer in enumerate(model.attention_layers()):
        layer.k_cache, layer.v_cache = keys[i], values[i]
    return KVCache(keys, values)


def allocate_kv_scales(model, num_blocks: int, block_size: int, device) -> torch.Tensor:
    """Scales of a float8 cache: [2, layers, blocks, block_size, kv_heads] float32; each attention
    layer gets views of its key and value scales (zeroed: unwritten slots dequantize to 0)."""
    spec = model.local_spec
    scales = torch.zeros(2, spec.num_layers, num_blocks, block_size, spec.num_kv_heads, dtype=torch.float32,
                         device=device)
    for i, layer in enumerate(model.attention_layers()):
        layer.k_scale, layer.v_scale = scales[0, i], scales[1, i]
    return scales
