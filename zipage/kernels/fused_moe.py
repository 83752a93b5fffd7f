"""Mixture-of-experts MLP: top-k routing and a grouped GEMM over the tokens each expert got.

A token routed to ``k`` experts makes ``k`` (token, expert) *pairs*, pair ``p`` being token
``p // k``'s ``p % k``-th choice. ``align_pairs`` orders the pairs by expert, each expert's
run padded to a multiple of ``block_m``, so that every ``block_m`` rows of the order belong
to one expert; it runs as a few device ops with sizes fixed by the batch, so it needs no
host synchronisation and a CUDA graph can hold it. ``moe_gemm`` then multiplies each block
of rows by its expert's matrix: the gate-up projection reads token rows, the down
projection reads pair rows and scales each by its routing weight. The pairs of a token
are summed at the end.

``fused_moe`` is the whole MLP on the device; ``fused_moe_torch`` is its plain PyTorch twin
(a loop over the experts that got tokens), used on the CPU and in tests.

FP8 experts (``quantization="fp8"``, ``layers/quant.py``): ``w13`` and ``w2`` hold float8
e4m3 with a float32 scale per output row of each expert (``w13_scale`` [E, 2I], ``w2_scale``
[E, H]). The grouped GEMM then reads the float8 weights, widens them to the activations'
dtype in registers (exact), accumulates in float32 and multiplies each output column by its
row's scale (W8A16): a decode step, which reads nearly every expert from a few dozen tokens
on, reads half the bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from zipage.kernels.common import dot_precision, fast_fp8_widening, is_fp8, widen_fp8


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64): softmax over the experts, the top k,
    rescaled to sum to one when ``renormalize`` (``norm_topk_prob``)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def align_pairs(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    """Pairs ordered by expert, each expert's run padded to ``block_m`` rows.

    Returns ``sorted_pairs`` (pair index per row; ``num_pairs`` marks padding), ``block_experts``
    (the expert of each block of ``block_m`` rows) and ``num_rows`` (a one-element device tensor:
    rows in use). Sizes depend only on the batch: ``num_pairs + num_experts * (block_m - 1)``
    rows at most, rounded up to whole blocks.
    """
    flat = expert_ids.flatten()
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - first_of_expert[sorted_experts]
    max_rows = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[(padded_ends - padded)[sorted_experts] + rank] = order
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_experts, padded_ends[-1:]


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, pair_weights_ptr, sorted_pairs_ptr, block_experts_ptr, num_rows_ptr,
                     w_scale_ptr, num_pairs, n, k, top_k,
                     stride_am, stride_we, stride_wn, stride_wk, stride_om, stride_se,
                     ROWS_ARE_TOKENS: tl.constexpr, SCALE_BY_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
                     FP8: tl.constexpr, FAST_FP8: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_rows_ptr):
        return  # a block past the rows in use (the grid is sized for the worst case)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs // top_k if ROWS_ARE_TOKENS else pairs
    expert = tl.load(block_experts_ptr + block)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & (ks[None, :] < k), other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=(cols[None, :] < n) & (ks[:, None] < k), other=0.0)
        if FP8:  # float8 -> the activations' dtype, exactly; the row scales come after the sum
            w = widen_fp8(w, a.dtype, FAST_FP8)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if FP8:
        acc = acc * tl.load(w_scale_ptr + expert * stride_se + cols, mask=cols < n, other=0.0)[None, :]
    if SCALE_BY_WEIGHT:
        acc = acc * tl.load(pair_weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < n))


# Tiles: (block_n, block_k, num_warps, num_stages). Decode-sized batches give each expert a
# few rows, so the GEMM streams its experts' weights: wide K tiles and several stages keep
# enough bytes in flight (see docs/benchmarks.md, the MoE layer).
TILES = (64, 128, 4, 4)


def moe_gemm(a: torch.Tensor, weight: torch.Tensor, sorted_pairs, block_experts, num_rows, top_k: int,
             rows_are_tokens: bool, pair_weights: torch.Tensor | None = None, block_m: int = 16,
             tiles: tuple[int, int, int, int] = TILES, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[p] = a[row of p] @ weight[expert of p].T`` (times ``pair_weights[p]`` if given) for every
    pair ``p``; ``a`` rows are tokens (``rows_are_tokens``) or pairs; ``weight`` is [experts, n, k],
    float8 with ``weight_scale`` [experts, n] (float32, per output row) or in ``a``'s dtype without."""
    num_pairs = a.shape[0] * top_k if rows_are_tokens else a.shape[0]
    _, n, k = weight.shape
    assert a.shape[1] == k and a.stride(1) == 1 and weight.stride(2) == 1, "contiguous rows expected"
    fp8 = is_fp8(weight.dtype)
    assert fp8 == (weight_scale is not None), "a float8 weight goes with its weight_scale, and only it"
    if fp8:
        assert weight_scale.shape == weight.shape[:2] and weight_scale.dtype == torch.float32
        assert weight_scale.stride(1) == 1, "contiguous scales expected"
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n, block_k, num_warps, num_stages = tiles
    block_n = min(block_n, triton.next_power_of_2(max(n, 16)))
    block_k = min(block_k, triton.next_power_of_2(max(k, 16)))
    grid = (sorted_pairs.numel() // block_m, triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](a, weight, out, pair_weights if pair_weights is not None else out, sorted_pairs,
                           block_experts, num_rows, weight_scale if fp8 else out, num_pairs, n, k, top_k,
                           a.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0),
                           weight_scale.stride(0) if fp8 else 0,
                           ROWS_ARE_TOKENS=rows_are_tokens, SCALE_BY_WEIGHT=pair_weights is not None,
                           PRECISION=dot_precision(a.dtype), FP8=fp8,
                           FAST_FP8=fp8 and fast_fp8_widening(a.dtype, a.device),
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                           num_warps=num_warps, num_stages=num_stages)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor, top_k: int,
              renormalize: bool, block_m: int = 16, tiles: tuple[int, int, int, int] = TILES,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE MLP of tokens ``x`` [T, H]: ``w13`` [E, 2I, H] (gate rows, then up rows), ``w2`` [E, H, I];
    float8 experts come with their row scales ``w13_scale`` [E, 2I] and ``w2_scale`` [E, H]."""
    weights, ids = route(router_logits, top_k, renormalize)
    sorted_pairs, block_experts, num_rows = align_pairs(ids, w13.shape[0], block_m)
    gate_up = moe_gemm(x, w13, sorted_pairs, block_experts, num_rows, top_k, rows_are_tokens=True,
                       block_m=block_m, tiles=tiles, weight_scale=w13_scale)
    hidden = F.silu(gate_up[:, :w2.shape[2]]) * gate_up[:, w2.shape[2]:]
    out = moe_gemm(hidden, w2, sorted_pairs, block_experts, num_rows, top_k, rows_are_tokens=False,
                   pair_weights=weights.flatten(), block_m=block_m, tiles=tiles, weight_scale=w2_scale)
    return out.view(x.shape[0], top_k, -1).sum(dim=1)


def _expert_product(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``a @ weight.T`` in ``a``'s dtype; a float8 ``weight`` times its row ``scale``, in float32
    (the kernel's order: the product of the exact values, then the scale)."""
    if scale is None:
        return a @ weight.T
    return ((a.float() @ weight.float().T) * scale).to(a.dtype)


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                    renormalize: bool, w13_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of ``fused_moe``: each expert that got tokens runs on its tokens (in x's dtype,
    the routing weights applied in float32)."""
    weights, ids = route(router_logits, top_k, renormalize)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for expert in torch.unique(ids).tolist():
        token, slot = torch.nonzero(ids == expert, as_tuple=True)
        gate_up = _expert_product(x[token], w13[expert], None if w13_scale is None else w13_scale[expert])
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = _expert_product(hidden, w2[expert], None if w2_scale is None else w2_scale[expert])
        out.index_add_(0, token, down.float() * weights[token, slot, None])
    return out.to(x.dtype)
