"""Where a step's time goes: the kernels that ran, grouped by kind, per step.

``StepProfiler`` records a few steps with ``torch.profiler``: on CUDA the device
kernels (also those replayed inside CUDA graphs), on the CPU the outermost ATen
operators (``aten::linear`` with the products inside it).
``breakdown`` groups them by kind (matrix products, attention, KV store, the
fused elementwise kernels, collectives...) and sets their time per step against
the step's wall time; the rest, when no kernel ran, is the time lost between
kernels and on the host.
"""

from __future__ import annotations

import re

import torch

from zipage.runner.trace import merge_intervals

# (kind, pattern on the lower-cased kernel or operator name); the first match wins
KINDS = [
    ("collective", r"nccl|all_reduce|allreduce|all_gather|allgather|one_shot"),
    ("compression", r"window_lse|window_attention|redundancy|choose_kept|compact_single_pass|gather_kept|"
                    r"scatter_kept|topk"),
    ("attention", r"decode_split|decode_merge|decode_fp8_probs|prefill_kernel|merge_parts|flash|attention|sdpa"),
    ("kv store", r"store_kv"),
    ("matmul", r"gemm|gemv|cutlass|cublas|nvjet|xmma|matmul|fp8_dot|aten::mm$|aten::addmm|aten::bmm|aten::linear"),
    ("fp8 quantize", r"quantize_rows|silu_mul_quantize"),  # kernels/fp8_linear.py, unfused activations
    ("norm and rope", r"add_rms_norm_kernel|norm_rope_kernel"),  # kernels/norm_rope.py
    ("fused elementwise", r"^triton_"),
    ("elementwise, unfused", r"elementwise|reduce_kernel|^aten::(to|mul|add|sub|div|pow|mean|rsqrt|silu|neg|exp|"
                             r"sum|max|min|where|lt|gt|ge|le|clone|embedding|index|arange|floor_divide|softmax)$"),
    ("copy / fill", r"memcpy|memset|copy|fill|index_put|scatter|gather|cat"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "other")


def breakdown(kernels: list[tuple[str, float, float]], num_steps: int, step_s: float) -> list[dict]:
    """Rows per kind: kernels and milliseconds per step, share of the step.

    ``kernels``: (name, start, end) in microseconds over ``num_steps`` steps that took
    ``step_s`` seconds each (wall time, measured apart from the profiler). The last
    row, ``no kernel running``, is the step's time minus the time at least one kernel ran.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    step_ms = 1000 * step_s
    totals: dict[str, list[float]] = {}
    for name, start, end in kernels:
        entry = totals.setdefault(kind_of(name), [0, 0.0])
        entry[0] += 1
        entry[1] += (end - start) / 1000
    rows = [dict(kind=kind, kernels_per_step=count / num_steps, ms_per_step=ms / num_steps,
                 share=ms / num_steps / step_ms if step_ms else None)
            for kind, (count, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1])]
    busy_ms = sum(b - a for a, b in merge_intervals([(s, e) for _, s, e in kernels])) / 1000 / num_steps
    rows.append(dict(kind="no kernel running", kernels_per_step=0.0, ms_per_step=max(0.0, step_ms - busy_ms),
                     share=max(0.0, step_ms - busy_ms) / step_ms if step_ms else None))
    return rows


class StepProfiler:
    """``start()`` before the steps to record, ``stop()`` after them; ``stop`` returns the
    kernels (CUDA) or outermost ATen operators (CPU) as (name, start_us, end_us)."""

    def __init__(self, device: torch.device):
        from torch.profiler import ProfilerActivity, profile

        self.cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profile = profile(activities=activities)

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._profile.start()

    def stop(self) -> list[tuple[str, float, float]]:
        from torch.autograd import DeviceType

        if self.cuda:
            torch.cuda.synchronize()
        self._profile.stop()
        events = self._profile.events()
        if self.cuda:
            chosen = [e for e in events if e.device_type == DeviceType.CUDA]
        else:
            chosen = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")
                      and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
        return [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in chosen]
