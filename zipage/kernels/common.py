"""Small helpers shared by the kernel wrappers.

Triton compiles a kernel once per specialization of its integer arguments (an argument equal
to 1, or divisible by 16, gets its own binary). Arguments that change from step to step (the
width of a batch's block table, a compression batch's longest length, a split count) are
listed in the kernel's ``do_not_specialize``: otherwise a server meets a new combination now
and then and stalls for a compile (a second or more) in the middle of serving.
"""

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """Matrix-unit precision for ``tl.dot``: exact IEEE products for float32 inputs
    (TF32 would cost ~1e-3 relative error), the native path for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


# -- FP8 KV cache (docs/fp8.md, "KV cache") ----------------------------------------
# Keys and values stored as float8 e4m3 (torch.float8_e4m3fn, Triton's float8e4nv) with a
# float32 scale per token and KV head: scale = amax over head_dim / FP8_MAX, so that the
# largest element of every row maps to +-448; a row of zeros (or of values below
# FP8_AMAX_FLOOR) gets the floor instead of 0 and stores zeros (or its tiny values).
FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-8


def is_fp8(dtype: torch.dtype) -> bool:
    return FP8_DTYPE is not None and dtype == FP8_DTYPE


def fp8_scales_torch(x: torch.Tensor) -> torch.Tensor:
    """Dynamic scale of every row ``x[..., :]`` (float32, the shape of x without its last dimension)."""
    return x.float().abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR) / FP8_MAX


def quantize_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale rounded to float8 e4m3 (to nearest, ties to even), scale) per row of ``x``."""
    scale = fp8_scales_torch(x)
    q = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8_torch(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q`` (float8 rows) times their ``scale`` (the shape of q without its last dimension)."""
    return (q.to(torch.float32) * scale[..., None].float()).to(dtype)
