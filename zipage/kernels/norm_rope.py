"""RMSNorm (with the residual add before it) and Qwen3's query/key norm with RoPE,
each one Triton kernel per call.

A decode step runs these four times per layer on a few rows; compiled by
``torch.compile`` they took nine kernels per layer on an H200 (the profile in
``docs/benchmarks.md``), and at decode sizes each kernel costs its launch gap more
than its work. Here each call is one program per token.

The rounding follows the eager twins in ``layers/norm.py`` and ``layers/rotary.py``
step for step (sums in the input dtype, statistics in float32, the normalised value
rounded before the weight multiplies it), so outputs differ from them only by the
order of a float32 sum.
"""

import torch

from zipage.kernels.common import pdl_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: the eager twins are used
    triton = None

AVAILABLE = triton is not None


if triton is not None:
    from zipage.kernels.common import wait_for_previous_kernel
    from zipage.kernels.fp8_linear import store_quantized_row

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr,
        residual_ptr,
        weight_ptr,
        out_ptr,
        residual_out_ptr,
        x_stride,
        residual_stride,
        hidden,
        eps,
        scale_ptr,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        QUANTIZE: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """One program per row: ``out = weight * norm(x + residual)``, ``residual_out = x + residual``.
        QUANTIZE: ``out`` (float8 e4m3) and ``scale`` hold the normalised row quantized as
        ``fp8_linear.quantize_rows_fp8`` would quantize it (for a W8A8 projection after the norm)."""
        wait_for_previous_kernel(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the add rounds as in the input dtype
            tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
        normed = (xf * rstd).to(x.dtype)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
        if QUANTIZE:
            store_quantized_row(out.to(tl.float32), cols, mask, out_ptr + row * hidden, scale_ptr + row)
        else:
            tl.store(out_ptr + row * hidden + cols, out, mask=mask)

    @triton.jit
    def _rotate_heads(x_ptr, x_stride_token, x_stride_head, out_ptr, token, num_heads, half, weight_ptr, cos, sin,
                      eps, HAS_NORM: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
        """RMSNorm (optional) then RoPE of every head of one token; ``out`` is [tokens, heads, 2 * half]."""
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, HALF_PAD)[None, :]
        mask = (heads < num_heads) & (dims < half)
        base = x_ptr + token * x_stride_token + heads * x_stride_head + dims
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + half, mask=mask, other=0.0)
        dtype = x1.dtype
        if HAS_NORM:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            square_sum = tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)
            rstd = tl.rsqrt(square_sum / (2 * half) + eps)[:, None]
            w1 = tl.load(weight_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)
            w2 = tl.load(weight_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)
            x1 = (w1 * (f1 * rstd).to(dtype).to(tl.float32)).to(dtype)
            x2 = (w2 * (f2 * rstd).to(dtype).to(tl.float32)).to(dtype)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        out = out_ptr + (token * num_heads + heads) * (2 * half) + dims
        tl.store(out, (f1 * cos - f2 * sin).to(dtype), mask=mask)
        tl.store(out + half, (f2 * cos + f1 * sin).to(dtype), mask=mask)

    @triton.jit
    def _norm_rope_kernel(
        positions_ptr,
        q_ptr,
        k_ptr,
        cos_sin_ptr,
        q_weight_ptr,
        k_weight_ptr,
        q_out_ptr,
        k_out_ptr,
        q_stride_token,
        q_stride_head,
        k_stride_token,
        k_stride_head,
        num_heads,
        num_kv_heads,
        half,
        eps,
        HAS_NORM: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        KV_HEADS_PAD: tl.constexpr,
        HALF_PAD: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """One program per token: every query and key head, normed (Qwen3) and rotated."""
        wait_for_previous_kernel(PDL)
        token = tl.program_id(0).to(tl.int64)
        position = tl.load(positions_ptr + token).to(tl.int64)
        dims = tl.arange(0, HALF_PAD)[None, :]
        cos = tl.load(cos_sin_ptr + position * (2 * half) + dims, mask=dims < half, other=0.0)
        sin = tl.load(cos_sin_ptr + position * (2 * half) + half + dims, mask=dims < half, other=0.0)
        _rotate_heads(q_ptr, q_stride_token, q_stride_head, q_out_ptr, token, num_heads, half, q_weight_ptr, cos,
                      sin, eps, HAS_NORM, HEADS_PAD, HALF_PAD)
        _rotate_heads(k_ptr, k_stride_token, k_stride_head, k_out_ptr, token, num_kv_heads, half, k_weight_ptr, cos,
                      sin, eps, HAS_NORM, KV_HEADS_PAD, HALF_PAD)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * norm(x)`` over the last dimension (twin: ``layers.norm.rms_norm_eager``)."""
    return _add_rms_norm(x, None, weight, eps)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(weight * norm(x + residual), x + residual)`` (twin: ``layers.norm.add_rms_norm``)."""
    return _add_rms_norm(x, residual, weight, eps)


def add_rms_norm_quantize_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``weight * norm(x + residual)`` quantized per row to float8 e4m3 for a W8A8 projection:
    ((e4m3 rows [M, hidden], float32 scales [M]), x + residual); without ``residual`` the first
    element alone. The same numbers as the norm followed by ``fp8_linear.quantize_rows_fp8``."""
    return _add_rms_norm(x, residual, weight, eps, quantize=True)


def _add_rms_norm(x, residual, weight, eps, quantize=False):
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # a view for the model's [tokens, hidden] rows, strided or not
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None:
        residual = residual.reshape(-1, shape[-1]).contiguous()
    assert weight.shape == x.shape[1:]
    rows, hidden = x.shape
    out = torch.empty((rows, hidden), dtype=torch.float8_e4m3fn if quantize else x.dtype, device=x.device)
    scales = torch.empty(rows, dtype=torch.float32, device=x.device) if quantize else weight  # (not read)
    residual_out = x
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        residual_out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, residual_out,
            x.stride(0), residual.stride(0) if residual is not None else 0, hidden, eps, scales,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden), QUANTIZE=quantize,
            num_warps=4 if hidden <= 2048 else 8, **pdl_launch(x.device),
        )
    normed = (out, scales) if quantize else out.view(shape)
    if residual is None:
        return normed
    return normed, residual_out.view(shape)


def rope_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor):
    """RoPE of ``q`` and ``k`` (twin: ``layers.rotary.apply_rope``); see ``norm_rope_triton``."""
    return norm_rope_triton(positions, q, k, cos_sin)


def norm_rope_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                     q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0):
    """RoPE of ``q`` [tokens, heads, dim] and ``k`` [tokens, kv_heads, dim] at ``positions``, after a
    per-head RMSNorm when the weights are given (Qwen3; twin: ``layers.rotary.norm_and_apply_rope``).
    ``q`` and ``k`` may be strided views (of a fused qkv output); the outputs are contiguous."""
    assert q.dim() == k.dim() == 3
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    tokens, num_heads, head_dim = q.shape
    assert k.shape[0] == tokens and k.shape[2] == head_dim and head_dim % 2 == 0
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and cos_sin.shape[1] == head_dim
    has_norm = q_weight is not None
    assert has_norm == (k_weight is not None)
    q_out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, k.shape[1], head_dim), dtype=k.dtype, device=k.device)
    if tokens:
        _norm_rope_kernel[(tokens,)](
            positions, q, k, cos_sin, q_weight if has_norm else cos_sin, k_weight if has_norm else cos_sin,
            q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), num_heads, k.shape[1], head_dim // 2,
            eps, HAS_NORM=has_norm, HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]), HALF_PAD=triton.next_power_of_2(head_dim // 2),
            **pdl_launch(q.device),
        )
    return q_out, k_out
