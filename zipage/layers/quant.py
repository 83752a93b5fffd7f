"""FP8 weights: float8 e4m3 linear layers with one float32 scale per output channel.

A row ``w`` of a weight is stored as ``q = round_e4m3(w / s)`` with ``s = amax(|w|) / 448``
(448 is e4m3's largest value), so ``w ~= q * s``. ``Linear`` and its tensor-parallel
subclasses (``linear.py``) hold ``weight`` (float8) and ``weight_scale`` ([out], float32)
when built inside ``fp8_linears()``; their loaders quantize each checkpoint tensor as it
arrives, so no full-precision copy of the model exists at any time (a block-wise FP8
checkpoint tensor is dequantized to float32 first, one tensor at a time:
``dequantize_blocks``). Embeddings, norms and the LM head keep the model's dtype.

The matmul (``fp8_linear``) picks its path by device, shape and dtype, all known when a
step is traced, so CUDA graphs capture it (no host syncs):

- CUDA, compute capability >= 8.9, at most ``W8A16_MAX_TOKENS`` rows: the Triton W8A16
  kernel (``zipage/kernels/fp8_linear.py``): fp8 weights converted in registers, the
  activations as they are. Decode is bound by reading the weights: half the bytes of bf16.
- the same GPUs, more rows: the Triton W8A8 kernel, the activations quantized per token
  (dynamic scale amax / 448) by a Triton kernel, or already by the norm or SwiGLU that made them
  (``QuantizedRows``), the product on the FP8 matrix units with
  both scales on the float32 accumulator. Measured on an H200 (docs/fp8.md), W8A16 stops
  paying past 16 rows (its bf16 matmul and conversion no longer hide under the loads), and
  W8A8 beats both bf16 and ``torch._scaled_mm`` from 64 rows on; its error against bf16 is
  2.7% (W8A16's 0.25%). ``torch._scaled_mm`` stays as a forced path (``path="scaled_mm"``).
- anywhere else (the CPU, older GPUs): ``x @ (q * s)^T``, the weight dequantized (in
  float32, then rounded once to the activations' dtype) for each matmul: saves memory,
  not time.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0
# Rows (tokens) up to which the W8A16 kernel runs; above, the W8A8 kernel (H200 sweep:
# scripts/fp8_gemm_sweep.py, docs/fp8.md).
W8A16_MAX_TOKENS = 16
_ROWS_PER_CHUNK = 4096  # rows quantized at once (bounds the float32 temporaries)
FORCE_PATH: str | None = None  # tests: run every fp8 matmul through this path ("dequant": exact float32)
# The norms and the SwiGLU before W8A8 projections quantize their outputs in their own kernels
# (False: the projections quantize them, one kernel more each; tests and benchmarks).
FUSE_QUANTIZERS = True

_enabled = False


@contextlib.contextmanager
def fp8_linears(enabled: bool = True):
    """Linear layers built inside hold float8 weights and per-channel scales."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


def fp8_enabled() -> bool:
    return _enabled


def is_fp8(tensor: torch.Tensor) -> bool:
    return FP8 is not None and tensor.dtype == FP8


def row_scales(w: torch.Tensor) -> torch.Tensor:
    """float32 ``amax(|row|) / 448`` of every row of ``w``; 1 for an all-zero row."""
    amax = w.abs().amax(dim=1).float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_rows(w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 ``w / scale``, float32 scale) per row of a 2-D ``w``; ``scale``: given (a
    row-parallel shard uses the scales of its whole rows), else ``row_scales(w)``."""
    scale = row_scales(w) if scale is None else scale.float().to(w.device)
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    for first in range(0, w.shape[0], _ROWS_PER_CHUNK):
        rows = slice(first, first + _ROWS_PER_CHUNK)
        q[rows] = (w[rows].float() / scale[rows, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def store_rows(target: torch.Tensor, target_scales: torch.Tensor, loaded: torch.Tensor,
               scale: torch.Tensor | None = None) -> None:
    """Quantize ``loaded`` (2-D) per row into the float8 ``target`` of its shape, its scales into
    ``target_scales``; ``scale`` as for ``quantize_rows``."""
    q, s = quantize_rows(loaded.to(target.device), scale)
    target.copy_(q)
    target_scales.copy_(s)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale.float()[:, None]).to(dtype)


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 weight of a block-wise FP8 checkpoint tensor: ``q`` ([out, in], float8) times
    ``scale_inv`` ([ceil(out / block[0]), ceil(in / block[1])]) broadcast over each block."""
    rows, cols = q.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit a weight of shape "
                         f"{tuple(q.shape)} in blocks of {list(block)} (expected {expected})")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return q.to(torch.float32) * scale


# -- checkpoints -----------------------------------------------------------------------
def checkpoint_fp8(hf_config) -> tuple[tuple[int, int] | None, list[str]]:
    """(weight block size, modules_to_not_convert) of a block-wise FP8 checkpoint (the format
    of Qwen's and DeepSeek's FP8 releases), or (None, []) for an unquantized one; any other
    ``quantization_config`` is refused."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None, []
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    block = qc.get("weight_block_size")
    if method != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"checkpoint quantization {method!r} (fmt {qc.get('fmt')!r}) is not supported; "
                         "supported: unquantized checkpoints, and block-wise fp8 e4m3 (quant_method 'fp8' "
                         "with weight_block_size)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"fp8 checkpoint with activation_scheme={qc.get('activation_scheme')!r}: only "
                         "'dynamic' (no activation scales in the checkpoint) is supported")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"fp8 checkpoint without a valid weight_block_size (got {block!r}): only block-wise "
                         "scales (weight_scale_inv per block) are supported")
    return (block[0], block[1]), list(qc.get("modules_to_not_convert") or [])


def matches_module(name: str, entries: list[str]) -> bool:
    """Whether an entry of ``modules_to_not_convert`` names ``name`` or a module around it
    (whole dotted components: 'lm_head', 'layers.0.mlp', 'q_proj')."""
    return any(f".{entry}." in f".{name}." for entry in entries)


# -- which matmul runs where ---------------------------------------------------------
def check_fp8_device(device: torch.device) -> None:
    """Raise where fp8 weights cannot run at all."""
    device = torch.device(device)
    if FP8 is None:
        raise ValueError(f"fp8 weights need torch.float8_e4m3fn, which torch {torch.__version__} lacks")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"fp8 weights run on CUDA GPUs (FP8 matmul from compute capability 8.9) and the "
                         f"CPU, not on {device}")


@functools.lru_cache(maxsize=None)
def fp8_matmul_supported(device_index: int) -> bool:
    """An NVIDIA GPU with FP8 matrix units (compute capability >= 8.9), and Triton is there (ROCm
    GPUs use the other e4m3 variant, e4m3fnuz, in their matrix units: they dequantize)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def describe_paths(device: torch.device, dtype: torch.dtype) -> str:
    """What ``fp8_linear`` runs on ``device`` with ``dtype`` activations, in words (logged at load)."""
    device = torch.device(device)
    check_fp8_device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        if fp8_matmul_supported(index):
            return (f"fp8 weights on {name}: Triton W8A16 kernel up to {W8A16_MAX_TOKENS} tokens, Triton W8A8 "
                    "kernel (per-token activation scales) above")
        where = f"{name} (compute capability {major}.{minor}, FP8 matmul needs 8.9)"
    else:
        where = "the CPU"
    return (f"fp8 weights on {where}: no FP8 matmul, each linear layer dequantizes its weight to {dtype} "
            "for every matmul (memory saved, not time)")


def log_fp8_paths(device: torch.device, dtype: torch.dtype) -> None:
    text = describe_paths(device, dtype)
    (logger.warning if "no FP8 matmul" in text else logger.info)(text)


def _path(x: torch.Tensor, weight: torch.Tensor | None = None) -> str:
    """The matmul an fp8 projection of ``x`` (rows [..., K]) runs by default."""
    if x.device.type != "cuda" or not fp8_matmul_supported(x.device.index or 0):
        return "dequant"
    return "w8a16" if x.numel() // x.shape[-1] <= W8A16_MAX_TOKENS else "w8a8"


class QuantizedRows(NamedTuple):
    """Activations a producer (a norm, the SwiGLU) quantized for a W8A8 projection, so that the
    projection skips its own quantizer: ``data`` float8 e4m3 [rows, K], ``scale`` float32 [rows]
    (``data * scale[:, None]`` is the activation), ``dtype`` the activations' (and output's) dtype."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def quantizes_input(x: torch.Tensor) -> bool:
    """Whether an fp8 projection of ``x`` (rows [..., K]) runs W8A8, i.e. quantizes ``x`` per row
    first: its producer may then hand over ``QuantizedRows`` instead, fused into its own kernel."""
    return (FORCE_PATH or _path(x)) == "w8a8"


def producer_quantizes(x: torch.Tensor) -> bool:
    """Whether the producer of ``x``, the input of an fp8 projection, hands it over quantized
    (``QuantizedRows``): the projection runs W8A8 and ``FUSE_QUANTIZERS`` is on."""
    return FUSE_QUANTIZERS and quantizes_input(x)


def fp8_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None, path: str | None = None) -> torch.Tensor:
    """``x @ (weight * scale[:, None])^T + bias`` for a float8 ``weight`` [N, K] and float32
    ``scale`` [N]; ``path`` ("w8a16", "w8a8", "scaled_mm", "dequant"): force one (benchmarks, tests).
    ``x`` may come quantized already (``QuantizedRows``, when ``quantizes_input``): W8A8 on it."""
    if isinstance(x, QuantizedRows):
        from zipage.kernels.fp8_linear import w8a8_linear_quantized
        return w8a8_linear_quantized(x.data, x.scale, weight, scale, bias, x.dtype)
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    path = path or FORCE_PATH or _path(x, weight)
    if path == "w8a16":
        from zipage.kernels.fp8_linear import w8a16_linear
        y = w8a16_linear(x, weight, scale, bias)
    elif path == "w8a8":
        from zipage.kernels.fp8_linear import w8a8_linear
        y = w8a8_linear(x, weight, scale, bias)
    elif path == "scaled_mm":
        y = scaled_mm_linear(x, weight, scale, bias)
    else:
        y = F.linear(x, dequantize_rows(weight, scale, x.dtype), bias)
    return y.reshape(*shape[:-1], weight.shape[0])


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 x / s, s [M, 1] float32) with a dynamic scale per token (row) of ``x``."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: per-token float8 activations times the float8 weight on the FP8 matrix units,
    both row-wise scales applied by ``torch._scaled_mm`` (bf16 out)."""
    xq, x_scale = quantize_activations(x)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1),
                         out_dtype=torch.bfloat16)
    y = y.to(x.dtype)
    return y if bias is None else y + bias
