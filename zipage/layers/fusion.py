"""Elementwise work fused into one kernel per call with ``torch.compile``.

A decode step of a 36-layer model runs a few hundred small elementwise ops
(RMSNorm, residual adds, RoPE, SwiGLU, the sampler's noise): each reads and
writes the whole activation, and at decode sizes each is one launch of a few
microseconds. Compiled, each group below becomes generated kernels; the norms
and RoPE, which ``torch.compile`` split into several kernels each on an H200,
are one hand-written Triton kernel per call instead (``kernels/norm_rope.py``).

The functions are plain PyTorch; ``fused`` calls their compiled form only after
``enable_fusion(True)`` (the model runner does so on CUDA unless
``enforce_eager``), so the CPU and the tests run the same code eagerly.
"""

from __future__ import annotations

import functools

import torch

_enabled = False


def enable_fusion(on: bool) -> None:
    global _enabled
    _enabled = on


def fusion_enabled() -> bool:
    return _enabled


def fused(fn=None, *, kernel=None):
    """Run ``fn`` eagerly, or fused once fusion is on: by ``kernel`` (a hand-written kernel
    taking ``fn``'s arguments) where one is given, else by ``fn`` compiled (dynamic shapes)."""
    if fn is None:
        return functools.partial(fused, kernel=kernel)
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args):
        nonlocal compiled
        if not _enabled:
            return fn(*args)
        if wrapper.kernel is not None:
            return wrapper.kernel(*args)
        if compiled is None:
            # Each distinct model (dtype, head layout) costs a recompile; a process that builds many
            # (the tests) needs more than dynamo's default of 8 before it falls back to eager.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args)

    wrapper.eager = fn
    wrapper.kernel = kernel
    return wrapper
