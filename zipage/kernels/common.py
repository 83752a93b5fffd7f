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
