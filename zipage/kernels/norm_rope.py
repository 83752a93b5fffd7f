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

from zipage.kernels.common import launch_kernel, pdl_launch, split_pdl
from zipage.kernels.store_kv import check_store_args

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: the eager twins are used
    triton = None

AVAILABLE = triton is not None


if triton is not None:
    from zipage.kernels.common import wait_for_previous_kernel
    from zipage.kernels.fp8_linear import store_quantized_row
    from zipage.kernels.store_kv import fp8_row_scale, round_to_fp8

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
        """RMSNorm (optional) then RoPE of every head of one token; ``out`` is [tokens, heads, 2 * half].
        Returns the rotated halves [HEADS_PAD, HALF_PAD] (in the input's dtype)."""
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
        o1, o2 = (f1 * cos - f2 * sin).to(dtype), (f2 * cos + f1 * sin).to(dtype)
        tl.store(out, o1, mask=mask)
        tl.store(out + half, o2, mask=mask)
        return o1, o2

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
        _norm_rope_token(positions_ptr, q_ptr, k_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, q_out_ptr, k_out_ptr,
                         q_stride_token, q_stride_head, k_stride_token, k_stride_head, num_heads, num_kv_heads, half,
                         eps, HAS_NORM, HEADS_PAD, KV_HEADS_PAD, HALF_PAD)

    @triton.jit
    def _norm_rope_token(positions_ptr, q_ptr, k_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, q_out_ptr, k_out_ptr,
                         q_stride_token, q_stride_head, k_stride_token, k_stride_head, num_heads, num_kv_heads, half,
                         eps, HAS_NORM: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
                         HALF_PAD: tl.constexpr):
        """This program's token (its id) normed and rotated, stored into ``q_out`` / ``k_out``: returns
        (token, the half-row offsets [1, HALF_PAD], the query halves, the key halves)."""
        token = tl.program_id(0).to(tl.int64)
        position = tl.load(positions_ptr + token).to(tl.int64)
        dims = tl.arange(0, HALF_PAD)[None, :]
        cos = tl.load(cos_sin_ptr + position * (2 * half) + dims, mask=dims < half, other=0.0)
        sin = tl.load(cos_sin_ptr + position * (2 * half) + half + dims, mask=dims < half, other=0.0)
        q1, q2 = _rotate_heads(q_ptr, q_stride_token, q_stride_head, q_out_ptr, token, num_heads, half, q_weight_ptr,
                               cos, sin, eps, HAS_NORM, HEADS_PAD, HALF_PAD)
        k1, k2 = _rotate_heads(k_ptr, k_stride_token, k_stride_head, k_out_ptr, token, num_kv_heads, half,
                               k_weight_ptr, cos, sin, eps, HAS_NORM, KV_HEADS_PAD, HALF_PAD)
        return token, dims, q1, q2, k1, k2

    @triton.jit
    def _norm_rope_store_kernel(
        positions_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, q_out_ptr, k_out_ptr,
        q_stride_token, q_stride_head, k_stride_token, k_stride_head, val_stride_token, val_stride_head,
        num_heads, num_kv_heads, half, eps,
        k_cache_ptr, v_cache_ptr, slot_mapping_ptr, cache_stride_block, cache_stride_slot, cache_stride_head,
        v_stride_block, v_stride_slot, v_stride_head, v_stride_dim,
        query_cache_ptr, query_slots_ptr, query_cache_stride_row, query_cache_stride_head,
        k_scale_ptr, v_scale_ptr, scale_stride_block, scale_stride_slot,
        HAS_NORM: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
        PAGE_SIZE: tl.constexpr, HAS_QUERY: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr = False,
    ):
        """One program per token: ``_norm_rope_kernel``'s work, then ``store_kv.store_kv``'s with the
        rotated key (and query) still in registers: the key and value into the cache slot (float8 with
        their scales for a float8 cache), the query into its observation-window row."""
        wait_for_previous_kernel(PDL)
        token, dims, q1, q2, k1, k2 = _norm_rope_token(
            positions_ptr, q_ptr, k_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, q_out_ptr, k_out_ptr,
            q_stride_token, q_stride_head, k_stride_token, k_stride_head, num_heads, num_kv_heads, half, eps,
            HAS_NORM, HEADS_PAD, KV_HEADS_PAD, HALF_PAD)
        if HAS_QUERY:
            q_heads = tl.arange(0, HEADS_PAD)[:, None]
            q_mask = (q_heads < num_heads) & (dims < half)
            row = tl.load(query_slots_ptr + token).to(tl.int64)
            q_row = query_cache_ptr + row * query_cache_stride_row + q_heads * query_cache_stride_head + dims
            tl.store(q_row, q1, mask=q_mask)
            tl.store(q_row + half, q2, mask=q_mask)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:  # a padding row: nothing stored
            return
        heads = tl.arange(0, KV_HEADS_PAD)[:, None]
        mask = (heads < num_kv_heads) & (dims < half)
        v_row = v_ptr + token * val_stride_token + heads * val_stride_head + dims
        v1 = tl.load(v_row, mask=mask, other=0.0)
        v2 = tl.load(v_row + half, mask=mask, other=0.0)
        block, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
        k_at = k_cache_ptr + block * cache_stride_block + offset * cache_stride_slot + heads * cache_stride_head + dims
        v_at = (v_cache_ptr + block * v_stride_block + offset * v_stride_slot + heads * v_stride_head
                + dims * v_stride_dim)
        if FP8:  # each row quantized over both halves: store_kv's numbers
            kf1, kf2 = k1.to(tl.float32), k2.to(tl.float32)
            vf1, vf2 = v1.to(tl.float32), v2.to(tl.float32)
            k_scale = fp8_row_scale(tl.maximum(tl.max(tl.abs(kf1), 1), tl.max(tl.abs(kf2), 1)))
            v_scale = fp8_row_scale(tl.maximum(tl.max(tl.abs(vf1), 1), tl.max(tl.abs(vf2), 1)))
            tl.store(k_at, round_to_fp8(kf1, k_scale), mask=mask)
            tl.store(k_at + half, round_to_fp8(kf2, k_scale), mask=mask)
            tl.store(v_at, round_to_fp8(vf1, v_scale), mask=mask)
            tl.store(v_at + half * v_stride_dim, round_to_fp8(vf2, v_scale), mask=mask)
            scale_at = block * scale_stride_block + offset * scale_stride_slot + tl.arange(0, KV_HEADS_PAD)
            scale_mask = tl.arange(0, KV_HEADS_PAD) < num_kv_heads
            tl.store(k_scale_ptr + scale_at, k_scale, mask=scale_mask)
            tl.store(v_scale_ptr + scale_at, v_scale, mask=scale_mask)
        else:
            tl.store(k_at, k1, mask=mask)
            tl.store(k_at + half, k2, mask=mask)
            tl.store(v_at, v1, mask=mask)
            tl.store(v_at + half * v_stride_dim, v2, mask=mask)


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


def norm_rope_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cos_sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                       eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       query_cache: torch.Tensor | None = None, query_slots: torch.Tensor | None = None, *,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, launches=None):
    """``norm_rope_triton`` then ``store_kv.store_kv`` of the rotated key, ``v`` and (with
    ``query_cache``) the rotated query, in one launch; the same numbers. Returns the rotated
    ``(q, k)`` as ``norm_rope_triton`` does; the other arguments are ``store_kv``'s."""
    assert q.dim() == k.dim() == 3
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    has_query = query_cache is not None
    check_store_args(k, v, k_cache, v_cache, slot_mapping, q if has_query else None, query_cache, query_slots,
                     k_scale, v_scale)
    assert head_dim % 2 == 0 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and cos_sin.shape[1] == head_dim
    assert k_cache.stride(3) == 1 and slot_mapping.is_contiguous()
    has_norm = q_weight is not None
    assert has_norm == (k_weight is not None)
    if has_query:
        assert query_cache.stride(2) == 1 and query_slots.is_contiguous()
    q_out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    fp8 = k_scale is not None
    if not has_query:  # placeholders, never read
        query_cache, query_slots = q_out, slot_mapping
    if not fp8:  # placeholders, never read
        k_scale = v_scale = slot_mapping
    args = (positions, q, k, v, cos_sin, q_weight if has_norm else cos_sin, k_weight if has_norm else cos_sin,
            q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            num_heads, num_kv_heads, head_dim // 2, eps,
            k_cache, v_cache, slot_mapping, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            *v_cache.stride(),
            query_cache, query_slots, query_cache.stride(0), query_cache.stride(1),
            k_scale, v_scale, k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0)
    constexprs = dict(HAS_NORM=has_norm, HEADS_PAD=triton.next_power_of_2(num_heads),
                      KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
                      HALF_PAD=triton.next_power_of_2(head_dim // 2), PAGE_SIZE=k_cache.shape[1],
                      HAS_QUERY=has_query, FP8=fp8)
    pdl, options = split_pdl(pdl_launch(q.device))
    launch_kernel(_norm_rope_store_kernel, (tokens,), args, {**constexprs, **pdl}, launches, **options)
    return q_out, k_out
