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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from zipage.kernels.common import dot_precision


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
                     num_pairs, n, k, top_k,
                     stride_am, stride_we, stride_wn, stride_wk, stride_om,
                     ROWS_ARE_TOKENS: tl.constexpr, SCALE_BY_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
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
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
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
             tiles: tuple[int, int, int, int] = TILES) -> torch.Tensor:
    """``out[p] = a[row of p] @ weight[expert of p].T`` (times ``pair_weights[p]`` if given) for every
    pair ``p``; ``a`` rows are tokens (``rows_are_tokens``) or pairs; ``weight`` is [experts, n, k]."""
    num_pairs = a.shape[0] * top_k if rows_are_tokens else a.shape[0]
    _, n, k = weight.shape
    assert a.shape[1] == k and a.stride(1) == 1 and weight.stride(2) == 1, "contiguous rows expected"
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n, block_k, num_warps, num_stages = tiles
    block_n = min(block_n, triton.next_power_of_2(max(n, 16)))
    block_k = min(block_k, triton.next_power_of_2(max(k, 16)))
    grid = (sorted_pairs.numel() // block_m, triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](a, weight, out, pair_weights if pair_weights is not None else out, sorted_pairs,
                           block_experts, num_rows, num_pairs, n, k, top_k,
                           a.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0),
                           ROWS_ARE_TOKENS=rows_are_tokens, SCALE_BY_WEIGHT=pair_weights is not None,
                           PRECISION=dot_precision(a.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                           num_warps=num_warps, num_stages=num_stages)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor, top_k: int,
              renormalize: bool, block_m: int = 16, tiles: tuple[int, int, int, int] = TILES) -> torch.Tensor:
    """The MoE MLP of tokens ``x`` [T, H]: ``w13`` [E, 2I, H] (gate rows, then up rows), ``w2`` [E, H, I]."""
    weights, ids = route(router_logits, top_k, renormalize)
    sorted_pairs, block_experts, num_rows = align_pairs(ids, w13.shape[0], block_m)
    gate_up = moe_gemm(x, w13, sorted_pairs, block_experts, num_rows, top_k, rows_are_tokens=True,
                       block_m=block_m, tiles=tiles)
    hidden = F.silu(gate_up[:, :w2.shape[2]]) * gate_up[:, w2.shape[2]:]
    out = moe_gemm(hidden, w2, sorted_pairs, block_experts, num_rows, top_k, rows_are_tokens=False,
                   pair_weights=weights.flatten(), block_m=block_m, tiles=tiles)
    return out.view(x.shape[0], top_k, -1).sum(dim=1)


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                    renormalize: bool) -> torch.Tensor:
    """The twin of ``fused_moe``: each expert that got tokens runs on its tokens (in x's dtype,
    the routing weights applied in float32)."""
    weights, ids = route(router_logits, top_k, renormalize)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for expert in torch.unique(ids).tolist():
        token, slot = torch.nonzero(ids == expert, as_tuple=True)
        gate_up = x[token] @ w13[expert].T
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, token, (hidden @ w2[expert].T).float() * weights[token, slot, None])
    return out.to(x.dtype)
