"""W8A16 matmul for decode-sized batches: ``y = (x @ W^T) * scale (+ bias)``.

``W`` is float8 e4m3 ``[N, K]`` with one float32 ``scale`` per output channel (row of W),
``x`` is ``[M, K]`` in bf16 or fp16 (float32 too, for the CPU interpreter). At a few
tokens a linear layer is bound by reading its weight, so the kernel reads each fp8
byte once, converts the tile to the activations' dtype in registers (exact: every
e4m3 value is a bf16 and an fp16 value) and accumulates in float32 with ``tl.dot``;
the per-channel scale multiplies the accumulator once, at the end.

Program (n tile, k split, m tile) covers ``BLOCK_N`` output channels over one share of
K. With few output tiles (a small layer at batch 1) the K dimension is split so that
enough programs stream the weight at once; each split then writes a float32 partial to
a workspace and a second kernel sums the splits, scales, adds the bias and casts. The
number of splits is a function of the shapes alone (no host sync: CUDA-graph safe).
``w8a16_linear_torch`` is the PyTorch twin.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from zipage.kernels.common import dot_precision

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: only the PyTorch twin is usable
    triton = None

# Split K until there are this many programs per SM (several resident per SM keep enough
# loads in flight to cover the memory latency), while the float32 partials a split writes
# and the reduction reads stay below WORKSPACE_SHARE of the weight's bytes (they grow with
# M; most stay in L2). Not yet tuned on a GPU: ``zipage bench linear --sweep`` times the
# alternatives.
PROGRAMS_PER_SM = 4
WORKSPACE_SHARE = 0.25


@dataclass(frozen=True)
class W8A16Config:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 4  # the CPU interpreter: any small number exercises the split path
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_config(m: int, n: int, k: int, num_sms: int) -> W8A16Config:
    """Tile sizes and K splits for an ``[m, k] x [k, n]`` problem (heuristic, see the module
    doc; ``zipage bench linear --sweep`` measures the alternatives)."""
    block_m = max(16, min(64, _next_pow2(m)))
    block_k = 256 if block_m <= 16 else 128
    k_blocks = -(-k // block_k)
    # workspace traffic 8 * split * m * n bytes (write + read, float32) <= share * n * k bytes
    max_split = max(1, min(k_blocks // 2, int(WORKSPACE_SHARE * k / (8 * max(m, 1)))))
    target = PROGRAMS_PER_SM * num_sms
    m_tiles = -(-m // block_m)
    block_n = 64
    split = 1
    while m_tiles * -(-n // block_n) * split < target and split * 2 <= max_split:
        split *= 2
    if m_tiles * -(-n // block_n) * split < target:
        block_n = 32
    return W8A16Config(block_m, block_n, block_k, split)


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _w8a16_kernel(
        x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr,
        M, N, K, stride_xm, stride_wn, stride_om, k_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, EVEN_NK: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    ):
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm[:, None] < M
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_NK:
                x = tl.load(x_ptrs + k0, mask=m_mask, other=0.0)
                w = tl.load(w_ptrs + k0)
            else:
                k_mask = (k0 + rk)[None, :] < k_end
                x = tl.load(x_ptrs + k0, mask=m_mask & k_mask, other=0.0)
                w = tl.load(w_ptrs + k0, mask=(rn[:, None] < N) & k_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
        n_mask = rn < N
        mask = m_mask & n_mask[None, :]
        if SPLIT_K == 1:
            acc = acc * tl.load(scale_ptr + rn, mask=n_mask, other=0.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            offsets = (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
            tl.store(part_ptr + offsets, acc, mask=mask)

    @triton.jit(do_not_specialize=["M"])
    def _split_k_reduce_kernel(
        part_ptr, scale_ptr, bias_ptr, out_ptr, M, N, stride_om,
        SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        row, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = rn < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in range(SPLIT_K):
            acc += tl.load(part_ptr + (s * M + row) * N + rn, mask=mask, other=0.0)
        acc = acc * tl.load(scale_ptr + rn, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=mask)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 config: W8A16Config | None = None) -> torch.Tensor:
    """``(x @ weight^T) * scale + bias`` in ``x``'s dtype; x ``[M, K]``, weight float8 ``[N, K]``
    (rows contiguous), scale float32 ``[N]``, bias ``[N]``. ``config``: override the heuristic."""
    if triton is None:
        raise RuntimeError("the W8A16 kernel needs Triton")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(1) != 1 or scale.shape != (n,):
        raise ValueError(f"w8a16_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)} (strides "
                         f"{weight.stride()}), scale {tuple(scale.shape)} do not fit")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if config is None:
        config = choose_config(m, n, k, _num_sms(x.device.index if x.device.type == "cuda" else None))
    k_blocks = -(-k // config.block_k)
    split = max(1, min(config.split_k, k_blocks))
    k_per_split = -(-k_blocks // split) * config.block_k
    split = -(-k // k_per_split)  # no empty split
    even = n % config.block_n == 0 and k % k_per_split == 0
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(n, config.block_n), split, triton.cdiv(m, config.block_m))
    bias_arg = bias if bias is not None else scale
    _w8a16_kernel[grid](
        x, weight, scale, bias_arg, out, part, m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split, EVEN_NK=even,
        HAS_BIAS=bias is not None and split == 1, PRECISION=dot_precision(x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _split_k_reduce_kernel[(m, triton.cdiv(n, block))](
            part, scale, bias_arg, out, m, n, out.stride(0), SPLIT_K=split, BLOCK_N=block,
            HAS_BIAS=bias is not None, num_warps=4)
    return out


def w8a16_linear_torch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's twin: float32 products of x and the fp8 weight, the scale on the output."""
    y = (x.float() @ weight.float().t()) * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
