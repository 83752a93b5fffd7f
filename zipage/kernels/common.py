"""Small helpers shared by the kernel wrappers."""

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """Matrix-unit precision for ``tl.dot``: exact IEEE products for float32 inputs
    (TF32 would cost ~1e-3 relative error), the native path for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"
