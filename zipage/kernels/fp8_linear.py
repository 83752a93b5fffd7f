"""FP8-weight matmuls for decode-sized batches: ``y = (x @ W^T) * scale (+ bias)``.

``W`` is float8 e4m3 ``[N, K]`` with one float32 ``scale`` per output channel (row of W).
Two variants share one kernel body:

- **W8A16** (``w8a16_linear``): ``x`` ``[M, K]`` in bf16 or fp16 (float32 too, for the CPU
  interpreter). The kernel reads each fp8 byte once, converts the tile to the activations'
  dtype in registers (exact: every e4m3 value is a bf16 and an fp16 value) and accumulates
  in float32 on the matrix units; the per-channel scale multiplies the accumulator once, at
  the end. ``w8a16_linear_torch`` is its PyTorch twin.
- **W8A8** (``w8a8_linear``): the activations quantized to e4m3 per token first (dynamic
  scale amax / 448, ``quantize_rows_fp8``, one small kernel: 2-4 us on an H200), then
  fp8 x fp8 products on Hopper's fp8 matrix units with no conversion of the weight at all;
  both scales multiply the accumulator. ~2.7% relative error (the activations' rounding)
  where W8A16 has ~0.25% (against bf16 on the same weights). On an H200 it beats W8A16 from
  ~64 tokens on (no conversion, matrix units twice as fast) and ``torch._scaled_mm`` with
  torch's activation quantization at every size measured (``scripts/fp8_gemm_sweep.py``).
  ``w8a8_linear_torch`` is its twin. A producer may quantize the rows in its own kernel
  (``silu_mul_quantize`` here, the norm's ``norm_rope.add_rms_norm_quantize_triton``): then
  ``w8a8_linear_quantized`` takes them as they are.

A decode-sized GEMM must stream the weight at the memory's speed, so:

- The weight is read as rows of ``BLOCK_K`` contiguous bytes (16-byte vector copies into
  shared memory; every K offset a multiple of ``BLOCK_K``, so the compiler can prove the
  alignment), and the K loop is software-pipelined (``num_stages``: that many tiles in
  flight while the matrix units work on the current one).
- Orientation: by default ``acc[BLOCK_M, BLOCK_N] = x_tile @ W_tile^T``; W8A16 converts the
  weight tile in registers (a layout with 16 contiguous bytes per thread) and stores it once
  for the matrix units. ``swap_ab`` computes ``out^T = W_tile @ x_tile^T`` instead: with fp8
  operands (W8A8) the weight tile goes from shared memory straight into the fp8 wgmma, whose
  left operand spans 64 rows, while the few tokens are the right operand (any BLOCK_M >= 16).
  (For W8A16 the swapped form makes the compiler convert the weight in the matrix units'
  register layout, two bytes at a time: slower.)
- Conversion: ``fp8 -> bf16`` through Triton goes via fp16 and a conversion instruction
  that runs at a quarter of the ALU rate: about one per element, which alone caps a kernel
  near 60% of an H200's copy bandwidth. ``common.fp8_to_bf16`` builds the bf16 bits with
  integer ops on four bytes at once (three per two elements) and one bf16x2 multiply.
- TMA (``W8A16Config.tma``, W8A8 with ``swap_ab`` only; ``_fp8_dot_tma_kernel``): the tensor
  memory accelerator copies each weight and activation tile into shared memory from a
  descriptor and two coordinates, with no per-thread addresses, vector loads or masks (rows
  and columns past the edges arrive as zeros), and the matrix units read both from there.
  Needs Hopper, rows 16-byte aligned and tiles of at most 256 rows and bytes (``tma_ready``;
  elsewhere the pointer kernel runs the same tiles). It is a candidate of the sweep, not in
  ``TUNED``: on an H200 it beat the pointer kernel's best by 0-10% a Qwen3-8B layer, but not
  the whole reasoning-8k run (docs/fp8.md).
- Split-K: with few output tiles (small N, or M = 1 with wide tiles) the K range is split so
  that enough programs stream the weight at once. Each split writes a float32 partial; the
  last split of a tile to finish (an atomic counter per tile) sums the partials in split
  order (deterministic), scales, adds the bias, casts and stores, and resets its counter to
  0 for the next launch: one launch, no second reduction kernel. The counters live in a
  zeroed buffer kept per device (``_tile_counters``); the first call must come before any
  CUDA-graph capture (the engine's warm-up does that), and launches that share the buffer
  must not run concurrently (one stream). The split count is a function of the shapes
  alone: no host sync, CUDA-graph safe.

Configs: ``choose_config`` looks up ``TUNED`` (per variant, M bucket and weight shape;
measured on an H200 by ``scripts/fp8_gemm_sweep.py``) and falls back to a heuristic.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from zipage.kernels.common import (device_capability, dot_precision, fast_fp8_widening, is_fp8, pdl_launch,
                                   round_to_e4m3, wait_for_previous_kernel, widen_fp8)

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: only the PyTorch twins are usable
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without tensor descriptors: the pointer kernel runs every config
    TensorDescriptor = None

FP8_MAX = 448.0
ACT_AMAX_FLOOR = 1e-12  # a row of zeros gets this amax (its scale is then tiny, its values 0)

# Split K until there are about this many programs per SM (several resident per SM keep
# enough loads in flight to cover the memory latency), keeping at least MIN_K_ITERS
# iterations of the K loop per split (a pipeline needs a few to reach its steady state) and
# the float32 partials (written once, read once, mostly from L2) below WORKSPACE_SHARE of
# the weight's bytes.
PROGRAMS_PER_SM = 2
MIN_K_ITERS = 4
WORKSPACE_SHARE = 0.25
# The activation quantizers (``quantize_rows_fp8``, ``silu_mul_quantize``) read a row of up to
# this many elements (a power of two) once, held in registers, instead of twice in blocks (the
# amax, then the values; one program per row, so the second pass's loads wait on the first's).
# On an H200 reading once took 0.6-0.9x the time alone and made fp8 decode steps up to 2% faster
# (docs/fp8.md; scripts/gpu_fp8.sh quantizers). 0 turns it off.
ONE_PASS_MAX_WIDTH = 16384

TILE_COUNTERS = 1 << 14  # output tiles that can split K in one launch (counters per device)
TMA_MAX_BOX = 256  # elements of a TMA copy's box along each dimension


@dataclass(frozen=True)
class W8A16Config:
    """One launch's tiling (W8A16 and W8A8 alike). ``swap_ab``: the kernel computes
    ``out^T = W @ x^T`` (the weight tile as the left operand) instead of ``out = x @ W^T``."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = False
    tma: bool = False  # W8A8, swap_ab: tiles loaded by the tensor memory accelerator (_fp8_dot_tma_kernel)

    def short(self) -> str:
        return (f"{'tma ' if self.tma else ''}"
                f"{'swap ' if self.swap_ab else ''}m{self.block_m} n{self.block_n} "
                f"k{self.block_k} s{self.split_k} w{self.num_warps} st{self.num_stages}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def m_bucket(m: int) -> int:
    """The M range a config is tuned for, by its upper end: 16 (1 to 16 tokens, one M tile of
    16: the same kernel; measured at 1), 64, 128 and 256 (and above)."""
    return 16 if m <= 16 else min(256, max(64, _next_pow2(m)))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 4  # the CPU interpreter: any small number exercises the split path
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# (variant, M bucket, N, K) -> config, the fastest measured on an H200 (132 SMs) by
# scripts/fp8_gemm_sweep.py (2026-12-02, torch 2.11, Triton 3.6) for the linear layers of
# Qwen3-8B (qkv 6144x4096, o 4096x4096, gate_up 24576x4096, down 4096x12288); the comment is
# the kernel's weight + activation bytes over its time, against 4.3 TB/s (the bucket of 16
# was measured at M = 1). Other shapes use the heuristic.
TUNED: dict[tuple[str, int, int, int], W8A16Config] = {
    ("w8a16", 16, 4096, 4096): W8A16Config(16, 64, 128, 4, 4, 4),  # o: 45%
    ("w8a16", 64, 4096, 4096): W8A16Config(64, 64, 128, 4, 4, 4),  # o: 28%
    ("w8a16", 128, 4096, 4096): W8A16Config(64, 64, 128, 2, 4, 3),  # o: 21%
    ("w8a16", 256, 4096, 4096): W8A16Config(64, 128, 64, 2, 4, 3),  # o: 15%
    ("w8a16", 16, 4096, 12288): W8A16Config(16, 64, 128, 8, 4, 4),  # down: 67%
    ("w8a16", 64, 4096, 12288): W8A16Config(64, 64, 128, 4, 4, 3),  # down: 41%
    ("w8a16", 128, 4096, 12288): W8A16Config(128, 64, 64, 4, 4, 3),  # down: 28%
    ("w8a16", 256, 4096, 12288): W8A16Config(64, 128, 64, 2, 4, 3),  # down: 17%
    ("w8a16", 16, 6144, 4096): W8A16Config(16, 64, 128, 4, 4, 4),  # qkv: 53%
    ("w8a16", 64, 6144, 4096): W8A16Config(64, 64, 128, 2, 4, 3),  # qkv: 30%
    ("w8a16", 128, 6144, 4096): W8A16Config(128, 64, 64, 2, 4, 3),  # qkv: 22%
    ("w8a16", 256, 6144, 4096): W8A16Config(64, 128, 64, 2, 4, 3),  # qkv: 17%
    ("w8a16", 16, 24576, 4096): W8A16Config(16, 64, 256, 1, 4, 3),  # gate_up: 81%
    ("w8a16", 64, 24576, 4096): W8A16Config(64, 64, 128, 1, 4, 2),  # gate_up: 47%
    ("w8a16", 128, 24576, 4096): W8A16Config(128, 64, 64, 1, 4, 3),  # gate_up: 38%
    ("w8a16", 256, 24576, 4096): W8A16Config(128, 128, 64, 2, 4, 3),  # gate_up: 21%
    ("w8a8", 16, 4096, 4096): W8A16Config(16, 64, 256, 4, 4, 4, swap_ab=True),  # o: 40%
    ("w8a8", 64, 4096, 4096): W8A16Config(64, 64, 128, 2, 4, 4),  # o: 33%
    ("w8a8", 128, 4096, 4096): W8A16Config(64, 64, 128, 2, 4, 4, swap_ab=True),  # o: 32%
    ("w8a8", 256, 4096, 4096): W8A16Config(128, 64, 128, 1, 4, 4, swap_ab=True),  # o: 32%
    ("w8a8", 16, 4096, 12288): W8A16Config(16, 64, 256, 4, 4, 4, swap_ab=True),  # down: 58%
    ("w8a8", 64, 4096, 12288): W8A16Config(64, 64, 128, 4, 4, 4),  # down: 48%
    ("w8a8", 128, 4096, 12288): W8A16Config(64, 64, 128, 2, 4, 4, swap_ab=True),  # down: 42%
    ("w8a8", 256, 4096, 12288): W8A16Config(128, 64, 128, 2, 4, 4, swap_ab=True),  # down: 36%
    ("w8a8", 16, 6144, 4096): W8A16Config(16, 64, 512, 1, 4, 3, swap_ab=True),  # qkv: 51%
    ("w8a8", 64, 6144, 4096): W8A16Config(64, 64, 128, 1, 4, 4),  # qkv: 42%
    ("w8a8", 128, 6144, 4096): W8A16Config(64, 64, 128, 1, 4, 4, swap_ab=True),  # qkv: 42%
    ("w8a8", 256, 6144, 4096): W8A16Config(256, 64, 128, 1, 8, 4, swap_ab=True),  # qkv: 39%
    ("w8a8", 16, 24576, 4096): W8A16Config(16, 64, 256, 1, 4, 3, swap_ab=True),  # gate_up: 80%
    ("w8a8", 64, 24576, 4096): W8A16Config(64, 64, 128, 1, 4, 4),  # gate_up: 75%
    ("w8a8", 128, 24576, 4096): W8A16Config(128, 64, 128, 1, 4, 3, swap_ab=True),  # gate_up: 70%
    ("w8a8", 256, 24576, 4096): W8A16Config(128, 64, 128, 1, 4, 3, swap_ab=True),  # gate_up: 49%
}
TUNED_SMS = 132  # the split counts above assume this many SMs; elsewhere the heuristic runs


def split_for(tiles: int, k: int, block_k: int, m: int, num_sms: int) -> int:
    """K splits (a power of two) so that ``tiles * split`` programs keep the SMs busy."""
    k_blocks = -(-k // block_k)
    # workspace traffic 8 * split * m * n bytes (float32 write + read) <= share * n * k bytes
    max_split = max(1, min(k_blocks // MIN_K_ITERS, int(WORKSPACE_SHARE * k / (8 * max(m, 1)))))
    split = 1
    while tiles * split < PROGRAMS_PER_SM * num_sms and split * 2 <= max_split:
        split *= 2
    return split


def choose_config(m: int, n: int, k: int, num_sms: int, variant: str = "w8a16") -> W8A16Config:
    """Tiles and K splits for an ``[m, k] x [k, n]`` problem (``variant``: "w8a16" or "w8a8"):
    ``TUNED`` where measured, else a heuristic (``scripts/fp8_gemm_sweep.py`` measures the
    alternatives)."""
    bucket = m_bucket(m)
    tuned = TUNED.get((variant, bucket, n, k)) if num_sms == TUNED_SMS else None
    if tuned is not None:
        return tuned
    # The shapes that won the sweep most often (see TUNED). W8A16: every token in one M tile
    # up to 128 (the weight read once); at 256 four M tiles of 64 next to each other in the
    # grid, the weight tile read by the second to fourth from L2 (a tile of 256 rows leaves
    # too little shared memory for the pipeline). W8A8 at a few tokens and from 128 on: the
    # weight as wgmma's left operand, straight from shared memory (swap_ab).
    if variant == "w8a8":
        if bucket <= 16:
            block_m, block_n, block_k, stages, swap = 16, 64, 256, 4, True
        elif bucket <= 64:
            block_m, block_n, block_k, stages, swap = 64, 64, 128, 4, False
        else:
            block_m, block_n, block_k, stages, swap = 128, 64, 128, 3, True
    elif bucket <= 16:
        block_m, block_n, block_k, stages, swap = 16, 64, 256, 3, False
    elif bucket <= 64:
        block_m, block_n, block_k, stages, swap = 64, 64, 128, 3, False
    elif bucket <= 128:
        block_m, block_n, block_k, stages, swap = 128, 64, 64, 3, False
    else:
        block_m, block_n, block_k, stages, swap = 64, 128, 64, 3, False
    tiles = -(-m // block_m) * -(-n // block_n)
    split = split_for(tiles, k, block_k, m, num_sms)
    return W8A16Config(block_m, block_n, block_k, split, 4, stages, swap_ab=swap)


def candidates(m: int, n: int, k: int, num_sms: int, variant: str = "w8a16") -> list[W8A16Config]:
    """The configs ``scripts/fp8_gemm_sweep.py`` (and ``zipage bench linear --sweep``) time for
    one problem: tile shapes for M's bucket, each with the K splits around the heuristic's."""
    bucket = m_bucket(m)
    w8a8 = variant == "w8a8"
    tiles: list[tuple] = []  # (block_m, block_n, block_k, warps, stages, swap)
    if bucket <= 16:
        # the few tokens in an M tile of 16 (mma.sync); W8A8 also with the weight as wgmma's
        # left operand (swap: 64 or 128 weight rows, 16 token columns)
        for bn, bk, stages in [(32, 256, 3), (32, 256, 4), (32, 512, 3), (64, 128, 4), (64, 256, 2), (64, 256, 3),
                               (64, 256, 4), (64, 512, 2), (64, 512, 3), (128, 128, 3), (128, 256, 2), (128, 256, 3)]:
            tiles.append((16, bn, bk, 4, stages, False))
        if w8a8:
            for bn, bk, stages in [(64, 256, 3), (64, 256, 4), (64, 512, 3), (128, 256, 3), (128, 128, 4)]:
                tiles.append((16, bn, bk, 4, stages, True))
    else:
        # every token in one M tile (the weight read once), or two to four M tiles next to
        # each other in the grid (the same weight tile, the second read from L2)
        for bm in sorted({min(256, max(32, bucket)), min(128, max(32, bucket)), 64}, reverse=True):
            if bm > max(32, bucket):
                continue
            if bm == 256 and not w8a8:
                continue  # the converted weight tile leaves too little shared memory for the pipeline
            for bn, bk, warps, stages in [(64, 64, 4, 3), (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 4, 4),
                                          (64, 256, 4, 2), (128, 64, 4, 3), (128, 64, 8, 4), (128, 128, 4, 2),
                                          (128, 128, 8, 2), (128, 128, 8, 3), (256, 64, 8, 3)]:
                if bm * bn > 128 * 128 and warps == 4 or (bm < bucket and bn > 128):
                    continue  # the accumulator would take most of 4 warps' registers; few tiles
                if bm < min(256, bucket) and (bn, bk, stages) not in [(64, 128, 3), (128, 64, 3), (128, 128, 2)]:
                    continue  # several M tiles: a few shapes only
                tiles.append((bm, bn, bk, warps, stages, False))
            if w8a8:
                for bn, bk, stages in [(64, 128, 3), (64, 128, 4), (128, 128, 3)]:
                    tiles.append((bm, bn, bk, 4 if bm * bn <= 64 * 128 else 8, stages, True))
    tma_tiles = []
    if w8a8:
        # the swapped tiles again with both operands loaded by TMA (bulk copies, no per-thread
        # addresses), and K tiles of 256 bytes (TMA's longest box) for each M tile
        tma_tiles = [t for t in tiles if t[5] and t[2] <= TMA_MAX_BOX]
        tma_tiles += [(bm, 64, 256, 4 if bm <= 128 else 8, 3, True) for bm in sorted({t[0] for t in tma_tiles})]
    configs = []
    tagged = [(t, False) for t in tiles] + [(t, True) for t in dict.fromkeys(tma_tiles)]
    for (bm, bn, bk, warps, stages, swap), tma in tagged:
        count = -(-m // bm) * -(-n // bn)
        base = split_for(count, k, bk, m, num_sms)
        k_blocks = -(-k // bk)
        for split in sorted({1, base, 2 * base, max(1, base // 2)}):
            if split > 1 and (k_blocks // split < 2 or count * split > 16 * num_sms):
                continue
            configs.append(W8A16Config(bm, bn, bk, split, warps, stages, swap, tma))
    return configs


_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device) -> torch.Tensor:
    """A zeroed int32 counter per output tile, kept per device; the kernel leaves them zero."""
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fp8 matmul with split K: call it once outside CUDA-graph capture first "
                               "(its tile counters are allocated and zeroed then)")
        counters = _counters[device] = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=device)
    return counters


if triton is not None:
    _FP8_MAX = tl.constexpr(FP8_MAX)
    _AMAX_FLOOR = tl.constexpr(ACT_AMAX_FLOOR)

    @triton.jit
    def _finish(acc, rm, rn, M, N, stride_om, scale_ptr, xscale_ptr, bias_ptr, out_ptr,
                HAS_BIAS: tl.constexpr, HAS_XSCALE: tl.constexpr):
        """Scale (per channel, and per token for W8A8), add the bias, cast and store. ``acc``
        is indexed by ``rm`` and ``rn``, each broadcastable to its shape (either orientation)."""
        n_ok = rn < N
        acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)
        if HAS_XSCALE:
            acc = acc * tl.load(xscale_ptr + rm, mask=rm < M, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rm.to(tl.int64) * stride_om + rn, acc.to(out_ptr.dtype.element_ty),
                 mask=(rm < M) & n_ok)

    @triton.jit
    def _epilogue(acc, rm, rn, pid_k, tile, M, N, stride_om, SPLIT_K,
                  scale_ptr, xscale_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr,
                  HAS_BIAS: tl.constexpr, HAS_XSCALE: tl.constexpr):
        """Store the tile, or with split K its float32 partial; the last split of the tile to
        arrive sums all partials in split order and stores the output (see the module doc)."""
        if SPLIT_K == 1:
            _finish(acc, rm, rn, M, N, stride_om, scale_ptr, xscale_ptr, bias_ptr, out_ptr, HAS_BIAS, HAS_XSCALE)
        else:
            mask = (rm < M) & (rn < N)
            part = part_ptr + rm.to(tl.int64) * N + rn
            plane = M.to(tl.int64) * N  # one split's [M, N] partial
            tl.store(part + pid_k * plane, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the counter moves
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros_like(acc)
                for s in range(SPLIT_K):  # .cg: from L2, where the other splits' stores are
                    total += tl.load(part + s * plane, mask=mask, other=0.0, cache_modifier=".cg")
                _finish(total, rm, rn, M, N, stride_om, scale_ptr, xscale_ptr, bias_ptr, out_ptr,
                        HAS_BIAS, HAS_XSCALE)
                tl.store(counter_ptr + tile, 0)  # every split has arrived: ready for the next launch

    @triton.jit(do_not_specialize=["M", "blocks_per_split", "SPLIT_K"])
    def _fp8_dot_kernel(
        x_ptr, xscale_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr,
        M, N, K, stride_xm, stride_wn, stride_om, blocks_per_split, SPLIT_K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr, A8: tl.constexpr,
        FAST_CVT: tl.constexpr, SWAP_AB: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    ):
        """Program (m tile, n tile, k split): ``acc[BLOCK_N, BLOCK_M] = W[n tile, k range] @
        x[m tile, k range]^T``; ``A8``: x is float8 with per-row scales ``xscale``."""
        wait_for_previous_kernel(PDL)
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn_local = tl.arange(0, BLOCK_N)
        rn = pid_n * BLOCK_N + rn_local
        rk = tl.arange(0, BLOCK_K)
        k_start = pid_k * blocks_per_split * BLOCK_K  # a multiple of BLOCK_K: aligned vector loads
        k_end = tl.minimum(k_start + blocks_per_split * BLOCK_K, K)
        # 64-bit row bases as scalars, 32-bit offsets inside the tile
        w_ptrs = (w_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_wn + k_start
                  + (rn_local[:, None] * stride_wn + rk[None, :]))
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + k_start + rk[None, :]
        m_ok = rm[:, None] < M
        n_ok = rn[:, None] < N
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                if EVEN_N:
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=n_ok, other=0.0)
                x = tl.load(x_ptrs, mask=m_ok, other=0.0)
            else:
                k_ok = (k0 + rk)[None, :] < k_end
                w = tl.load(w_ptrs, mask=n_ok & k_ok, other=0.0)
                x = tl.load(x_ptrs, mask=m_ok & k_ok, other=0.0)
            if not A8:
                w = widen_fp8(w, x.dtype, FAST_CVT)
            if SWAP_AB:
                acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION, out_dtype=tl.float32)
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION, out_dtype=tl.float32)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        tile = pid_m * tl.num_programs(1) + pid_n
        if SWAP_AB:
            _epilogue(acc, rm[None, :], rn[:, None], pid_k, tile, M, N, stride_om, SPLIT_K,
                      scale_ptr, xscale_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, HAS_BIAS, A8)
        else:
            _epilogue(acc, rm[:, None], rn[None, :], pid_k, tile, M, N, stride_om, SPLIT_K,
                      scale_ptr, xscale_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, HAS_BIAS, A8)

    @triton.jit(do_not_specialize=["M", "blocks_per_split", "SPLIT_K"])
    def _fp8_dot_tma_kernel(
        w_desc, x_desc, xscale_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr,
        M, N, K, stride_om, blocks_per_split, SPLIT_K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
        NUM_STAGES: tl.constexpr, PDL: tl.constexpr = False,
    ):
        """W8A8 with the weight as the left operand (``swap_ab``), both operands loaded by the
        tensor memory accelerator: program (m tile, n tile, k split) computes ``acc[BLOCK_N,
        BLOCK_M] = W[n tile, k range] @ xq[m tile, k range]^T``. A TMA copy fills a whole tile
        of shared memory from one descriptor and two coordinates (no per-thread addresses, no
        masks: rows past M or N and columns past K arrive as zeros)."""
        wait_for_previous_kernel(PDL)
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        k_start = pid_k * blocks_per_split * BLOCK_K
        k_end = tl.minimum(k_start + blocks_per_split * BLOCK_K, K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            w = w_desc.load([off_n, k0])
            x = x_desc.load([off_m, k0])
            acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.float32)
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        tile = pid_m * tl.num_programs(1) + pid_n
        _epilogue(acc, rm[None, :], rn[:, None], pid_k, tile, M, N, stride_om, SPLIT_K,
                  scale_ptr, xscale_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, HAS_BIAS, True)

    @triton.jit
    def quantize_row_block(y, scale):
        """float32 ``y`` / ``scale`` clamped to e4m3's range and rounded to it (still float32): the
        numbers of ``_quantize_rows_kernel``, for the kernels that quantize rows."""
        return round_to_e4m3(tl.minimum(tl.maximum(tl.fdiv(y, scale, ieee_rounding=True), -_FP8_MAX), _FP8_MAX))

    @triton.jit
    def store_quantized_row(y, cols, mask, q_row_ptr, scale_ptr):
        """A whole row ``y`` (float32 at columns ``cols``, zeros where not ``mask``) quantized as
        ``_quantize_rows_kernel`` quantizes it: its scale (amax / 448) stored at ``scale_ptr``, its
        e4m3 values from ``q_row_ptr``. (The addresses are formed after the amax, so that they
        are not held across it.)"""
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), _AMAX_FLOOR) / _FP8_MAX
        tl.store(scale_ptr, scale)
        tl.store(q_row_ptr + cols, quantize_row_block(y, scale).to(q_row_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul(x_ptr, row, stride_xm, half, cols, mask, OUT_DTYPE: tl.constexpr):
        """``silu(gate) * up`` of one row's columns ``cols`` (float32 math, rounded once to
        OUT_DTYPE, then float32)."""
        gate = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_xm + half + cols, mask=mask, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        return y.to(OUT_DTYPE).to(tl.float32)

    @triton.jit
    def _silu_mul_quantize_kernel(x_ptr, q_ptr, s_ptr, half, stride_xm, stride_qm, OUT_DTYPE: tl.constexpr,
                                  BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr = False):
        """One row per program: ``y = silu(gate) * up`` of ``x = [gate | up]``, then its amax and
        ``q = y / (amax / 448)`` in e4m3, as ``quantize_rows_fp8`` quantizes a stored ``y``.
        ONE_PASS (the row fits one BLOCK): the row is read once and held, else twice."""
        wait_for_previous_kernel(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        if ONE_PASS:
            row_y = _silu_mul(x_ptr, row, stride_xm, half, cols, cols < half, OUT_DTYPE)
            store_quantized_row(row_y, cols, cols < half, q_ptr + row * stride_qm, s_ptr + row)
            return
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, half, BLOCK):
            y = _silu_mul(x_ptr, row, stride_xm, half, k0 + cols, k0 + cols < half, OUT_DTYPE)
            amax = tl.maximum(amax, tl.abs(y))
        scale = tl.maximum(tl.max(amax, axis=0), _AMAX_FLOOR) / _FP8_MAX
        tl.store(s_ptr + row, scale)
        for k0 in range(0, half, BLOCK):
            y = _silu_mul(x_ptr, row, stride_xm, half, k0 + cols, k0 + cols < half, OUT_DTYPE)
            q = quantize_row_block(y, scale)
            tl.store(q_ptr + row * stride_qm + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=k0 + cols < half)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr,
                              ONE_PASS: tl.constexpr, PDL: tl.constexpr = False):
        """One row per program: amax, then ``q = clamp(x / (amax / 448))`` in e4m3 (to nearest).
        ONE_PASS (the row fits one BLOCK): the row is read once and held, else twice."""
        wait_for_previous_kernel(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        if ONE_PASS:
            row_x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
            store_quantized_row(row_x, cols, cols < K, q_ptr + row * stride_qm, s_ptr + row)
            return
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=k0 + cols < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0), _AMAX_FLOOR) / _FP8_MAX
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            q = quantize_row_block(x, scale)
            tl.store(q_ptr + row * stride_qm + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=k0 + cols < K)


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    if triton is None:
        raise RuntimeError(f"{name} needs Triton")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(1) != 1 or scale.shape != (n,):
        raise ValueError(f"{name}: x {tuple(x.shape)}, weight {tuple(weight.shape)} (strides "
                         f"{weight.stride()}), scale {tuple(scale.shape)} do not fit")


def tma_ready(x: torch.Tensor, weight: torch.Tensor, config: W8A16Config) -> bool:
    """Whether a TMA launch can take these operands with this tiling (else the pointer kernel
    runs the same config): float8 activations (W8A8) and the weight as the left operand, a
    Triton with tensor descriptors, on a GPU with TMA (Hopper or newer; the interpreter
    emulates it), rows 16-byte aligned, and boxes of at most TMA_MAX_BOX rows and bytes."""
    if TensorDescriptor is None or not config.swap_ab or not is_fp8(x.dtype):
        return False
    if x.device.type == "cuda" and device_capability(x.device)[0] < 9:
        return False
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) == 1 for t in (x, weight))
    return aligned and max(config.block_m, config.block_n, config.block_k) <= TMA_MAX_BOX


def _launch(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, scale: torch.Tensor,
            bias: torch.Tensor | None, config: W8A16Config, out_dtype: torch.dtype,
            out: torch.Tensor | None) -> torch.Tensor:
    """One launch of the kernel (``x_scale``: W8A8, x float8)."""
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or out.stride(1) != 1:
        raise ValueError(f"out: {tuple(out.shape)} {out.dtype} (strides {out.stride()}); expected ({m}, {n}) "
                         f"{out_dtype} with contiguous rows")
    if m == 0:
        return out
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    k_blocks = triton.cdiv(k, bk)
    split = max(1, min(config.split_k, k_blocks))
    if split > 1 and m_tiles * n_tiles > TILE_COUNTERS:
        split = 1  # more tiles than counters: these fill the GPU without splitting anyway
    blocks_per_split = triton.cdiv(k_blocks, split)
    split = triton.cdiv(k_blocks, blocks_per_split)  # no empty split
    if split > 1:
        part, counters = torch.empty(split, m, n, dtype=torch.float32, device=x.device), _tile_counters(x.device)
    else:  # not read; float32 and int32 views, so that both cases share one compiled kernel
        part, counters = scale, scale.view(torch.int32)
    grid = (m_tiles, n_tiles, split)
    if config.tma and tma_ready(x, weight, config):
        w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
        x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        _fp8_dot_tma_kernel[grid](
            w_desc, x_desc, x_scale, scale, bias if bias is not None else scale, out, part, counters,
            m, n, k, out.stride(0), blocks_per_split, split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            HAS_BIAS=bias is not None, NUM_STAGES=config.num_stages, num_warps=config.num_warps,
            **pdl_launch(x.device))
        return out
    fast = fast_fp8_widening(x.dtype, x.device)
    common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
                  EVEN_N=n % bn == 0, HAS_BIAS=bias is not None, num_warps=config.num_warps,
                  num_stages=config.num_stages)
    bias_arg = bias if bias is not None else scale
    _fp8_dot_kernel[grid](
        x, x_scale if x_scale is not None else scale, weight, scale, bias_arg, out, part, counters,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), blocks_per_split, split,
        A8=x_scale is not None, FAST_CVT=fast and x_scale is None, SWAP_AB=config.swap_ab,
        PRECISION=dot_precision(x.dtype), **common, **pdl_launch(x.device))
    return out


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 config: W8A16Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(x @ weight^T) * scale + bias`` in ``x``'s dtype; x ``[M, K]``, weight float8 ``[N, K]``
    (rows contiguous), scale float32 ``[N]``, bias ``[N]``. ``config``: override the table;
    ``out``: write there (``[M, N]``, x's dtype)."""
    _check(x, weight, scale, "w8a16_linear")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if config is None:
        config = choose_config(m, weight.shape[0], k, _num_sms(x.device.index if x.device.type == "cuda" else None))
    return _launch(x, None, weight, scale, bias, config, x.dtype, out)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 ``x / s``, float32 ``s`` [M]) with ``s = max(amax(|row|), 1e-12) / 448`` per row."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block, one_pass, warps = _row_blocks(k, 8192)
        _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=block, ONE_PASS=one_pass,
                                    num_warps=warps, **pdl_launch(x.device))
    return q, s


def _row_blocks(width: int, two_pass_block: int) -> tuple[int, bool, int]:
    """(BLOCK, ONE_PASS, num_warps) of a quantizer over rows of ``width`` elements: the whole row
    in one block, read once, when it fits ``ONE_PASS_MAX_WIDTH``; else blocks of
    ``two_pass_block`` read twice (the amax first, then the quantized values)."""
    block = triton.next_power_of_2(width)
    if block <= ONE_PASS_MAX_WIDTH:
        return block, True, max(4, min(16, block // 512))
    return min(two_pass_block, block), False, 8


def silu_mul_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_fp8(silu(gate) * up)`` of ``x = [gate | up]`` ([M, 2I]) in one kernel, the
    product rounded once to ``x``'s dtype first (as a stored activation would be): (e4m3 [M, I],
    float32 scales [M]). The W8A8 path of a down projection reads these instead of the product."""
    m, width = x.shape
    half = width // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, half, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block, one_pass, warps = _row_blocks(half, 4096)
        _silu_mul_quantize_kernel[(m,)](x, q, s, half, x.stride(0), q.stride(0), OUT_DTYPE=_tl_dtype(x.dtype),
                                        BLOCK=block, ONE_PASS=one_pass, num_warps=warps, **pdl_launch(x.device))
    return q, s


def silu_mul_quantize_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_mul_quantize``'s twin."""
    gate, up = x.float().chunk(2, dim=-1)
    return quantize_rows_fp8_torch((gate / (1.0 + torch.exp(-gate)) * up).to(x.dtype))


def _tl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                config: W8A16Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: ``x`` quantized per token to e4m3 (``quantize_rows_fp8``), then the fp8 x fp8
    matmul with both scales on the float32 accumulator; output in ``x``'s dtype."""
    _check(x, weight, scale, "w8a8_linear")
    xq, x_scale = quantize_rows_fp8(x)
    return w8a8_linear_quantized(xq, x_scale, weight, scale, bias, x.dtype, config, out)


def w8a8_linear_quantized(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None, out_dtype: torch.dtype, config: W8A16Config | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """``w8a8_linear`` on activations its producer quantized already (``xq`` e4m3 [M, K], rows
    contiguous, ``x_scale`` float32 [M]: a fused norm or SwiGLU), output in ``out_dtype``."""
    _check(xq, weight, scale, "w8a8_linear")
    m, k = xq.shape
    if xq.stride(1) != 1 or x_scale.shape != (m,):
        raise ValueError(f"w8a8_linear: quantized rows {tuple(xq.shape)} (strides {xq.stride()}) with scales "
                         f"{tuple(x_scale.shape)} do not fit")
    if config is None:
        config = choose_config(m, weight.shape[0], k, _num_sms(xq.device.index if xq.device.type == "cuda" else None),
                               "w8a8")
    return _launch(xq, x_scale, weight, scale, bias, config, out_dtype, out)


def w8a16_linear_torch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A16 kernel's twin: float32 products of x and the fp8 weight, the scale on the output."""
    y = (x.float() @ weight.float().t()) * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_rows_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_fp8``'s twin."""
    s = x.float().abs().amax(dim=1).clamp_min(ACT_AMAX_FLOOR) / FP8_MAX
    return (x.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def w8a8_linear_torch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 kernel's twin: the activations quantized per row, float32 products of the two
    e4m3 operands, both scales on the output."""
    xq, s = quantize_rows_fp8_torch(x)
    y = (xq.float() @ weight.float().t()) * s[:, None] * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
