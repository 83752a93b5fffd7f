"""One-shot all-reduce over memory every rank of the group maps (NVLink peers), optionally
fused with the residual add and RMSNorm that follow a row-parallel projection.

A tensor-parallel decode step sums each layer's partial outputs over the ranks twice (after
the attention's output projection and after the MLP), a few hundred kilobytes each time.
NCCL's all-reduce spends most of its time at those sizes on latency; here every rank copies
its rows into its own symmetric buffer, waits until every peer has done the same, and reads
the peers' rows straight from their memory: one kernel, one round of signals.

Layout of a rank's symmetric region (the same on every rank, ``Region``):

    [signal slots: MAX_PROGRAMS x world int32][buffer 0][buffer 1]

Signals. Program ``p`` of rank ``r`` announces that its rows are in place by setting slot
``(p, r)`` of every peer from 0 to 1 (a release at system scope, after a CTA barrier: the
writes of all its threads come first), then waits for its own slots ``(p, q)`` of every peer
``q`` and resets them to 0 (an acquire). A slot a peer has not consumed yet makes the next
announcement wait, so no signal is lost; the slots are ready again after every call.

Buffers. Calls alternate between the two buffers by a per-rank count of calls (``epoch``,
device memory, advanced by the last program to finish). A rank writes buffer ``e % 2`` at call
``e`` once its call ``e - 1`` has finished (the kernel is launched without programmatic
dependent launch, so it starts after the kernel before it has ended), which means every peer
had started call ``e - 1``, so had finished call ``e - 2``, the last one to read that buffer. No
barrier is needed at the end of a call, and the scheme does not depend on which calls a CUDA
graph holds or on the order of graphs and eager calls: only on every rank making the same calls
in the same order, which the engine's ranks do (they run the same forwards).

Sums run in float32 over the ranks in rank order, so every rank gets the same bits; with two
ranks they equal NCCL's (one rounding of ``a + b``). The fused form then rounds, adds the
residual and norms exactly as ``norm_rope._add_rms_norm_kernel``.

A peer that never arrives (it died inside a step) would leave the kernel spinning; after
``timeout_s`` of waiting it traps instead, which fails this rank's device work loudly rather
than silently summing stale rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zipage.kernels.common import multiprocessor_count

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: the NCCL path is used
    triton = None

AVAILABLE = triton is not None
MAX_PROGRAMS = 128  # programs a call (and signal slots per peer); at most one per SM on an H200
SIGNAL_BYTES_ALIGN = 256


@dataclass
class Region:
    """One rank's view of the group's symmetric regions.

    ``bases``: int64 device tensor [world] of every rank's region address (this rank's at
    ``rank``); ``buffer_bytes``: bytes of each of the two buffers (the largest all-reduce);
    ``epoch``: int32 device tensor [2], this rank's call count and the count of its programs
    that finished the current call; ``timeout_s``: how long a program waits for a peer; every
    rank's programs must be able to run at once, each on its own GPU, or, in the tests, the
    group's on one GPU (``max_programs`` there).
    """
    bases: torch.Tensor
    rank: int
    world: int
    buffer_bytes: int
    epoch: torch.Tensor
    timeout_s: float = 600.0
    max_programs: int = MAX_PROGRAMS  # programs a call at most (fewer: more rows each)
    owner: object = None  # what keeps the regions mapped (the symmetric tensor and its handle)

    @staticmethod
    def signal_bytes(world: int) -> int:
        raw = MAX_PROGRAMS * world * 4
        return -(-raw // SIGNAL_BYTES_ALIGN) * SIGNAL_BYTES_ALIGN

    @staticmethod
    def region_bytes(world: int, buffer_bytes: int) -> int:
        """Bytes of the region a rank allocates for ``buffer_bytes`` a buffer."""
        return Region.signal_bytes(world) + 2 * buffer_bytes

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.buffer_bytes


if triton is not None:
    @triton.jit
    def _globaltimer(USE_TIMER: tl.constexpr):
        if USE_TIMER:
            return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                             pack=1)
        else:
            return 0

    @triton.jit
    def _trap(USE_TIMER: tl.constexpr):
        if USE_TIMER:
            tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _swap_signal(slot, expected, new, start, timeout_ns, RELEASE: tl.constexpr, USE_TIMER: tl.constexpr):
        """Spin until ``slot`` holds ``expected``, then set it to ``new`` (system scope)."""
        if RELEASE:
            seen = tl.atomic_cas(slot, expected, new, sem="release", scope="sys")
        else:
            seen = tl.atomic_cas(slot, expected, new, sem="acquire", scope="sys")
        while seen != expected:
            if USE_TIMER:
                if _globaltimer(USE_TIMER) - start > timeout_ns:
                    _trap(USE_TIMER)
            if RELEASE:
                seen = tl.atomic_cas(slot, expected, new, sem="release", scope="sys")
            else:
                seen = tl.atomic_cas(slot, expected, new, sem="acquire", scope="sys")

    @triton.jit(do_not_specialize=["x_stride", "residual_stride", "rows"])  # one binary for every step's rows
    def _one_shot_kernel(
        x_ptr,
        x_stride,
        bases_ptr,
        epoch_ptr,
        residual_ptr,
        residual_stride,
        weight_ptr,
        out_ptr,
        residual_out_ptr,
        rows,
        hidden,
        signal_bytes,
        buffer_bytes,
        eps,
        timeout_ns,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        NORM: tl.constexpr,
        BLOCK: tl.constexpr,
        USE_TIMER: tl.constexpr,
    ):
        """Sum ``x`` [rows, hidden] over the ranks into ``out``; NORM: ``residual_out = sum + residual``
        and ``out = weight * norm(residual_out)``. Program ``p`` handles rows p, p + grid, ..."""
        pid = tl.program_id(0)
        grid = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        dtype = x_ptr.dtype.element_ty
        epoch = tl.load(epoch_ptr, volatile=True)
        offset = signal_bytes + (epoch % 2).to(tl.int64) * buffer_bytes  # this call's buffer
        own = tl.load(bases_ptr + RANK)
        own_rows = (own + offset).to(tl.pointer_type(dtype))
        first = pid.to(tl.int64)
        steps = (rows - pid + grid - 1) // grid  # rows of this program
        for i in range(0, steps):
            r = first + i * grid
            tl.store(own_rows + r * hidden + cols, tl.load(x_ptr + r * x_stride + cols, mask=mask), mask=mask)

        # every thread's rows are written before the announcement
        tl.debug_barrier()
        start = _globaltimer(USE_TIMER)
        for q in tl.static_range(WORLD):
            if q != RANK:
                peer_slot = (tl.load(bases_ptr + q)).to(tl.pointer_type(tl.int32)) + pid * WORLD + RANK
                _swap_signal(peer_slot, 0, 1, start, timeout_ns, True, USE_TIMER)
        own_slots = own.to(tl.pointer_type(tl.int32)) + pid * WORLD
        for q in tl.static_range(WORLD):
            if q != RANK:
                _swap_signal(own_slots + q, 1, 0, start, timeout_ns, False, USE_TIMER)
        tl.debug_barrier()

        for i in range(0, steps):
            r = first + i * grid
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for q in tl.static_range(WORLD):
                rows_q = (tl.load(bases_ptr + q) + offset).to(tl.pointer_type(dtype))
                acc += tl.load(rows_q + r * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            total = acc.to(dtype)
            if NORM:
                res = tl.load(residual_ptr + r * residual_stride + cols, mask=mask, other=0.0)
                total = (total.to(tl.float32) + res.to(tl.float32)).to(dtype)  # the add rounds as its dtype
                tl.store(residual_out_ptr + r * hidden + cols, total, mask=mask)
                xf = total.to(tl.float32)
                rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
                normed = (xf * rstd).to(dtype)
                w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
                tl.store(out_ptr + r * hidden + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(dtype),
                         mask=mask)
            else:
                tl.store(out_ptr + r * hidden + cols, total, mask=mask)

        # the last program to finish advances the call count (read by every program at its start)
        tl.debug_barrier()
        finished = tl.atomic_add(epoch_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if finished == grid - 1:
            tl.atomic_xchg(epoch_ptr + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(epoch_ptr, 1, sem="release", scope="gpu")


def _use_timer(device: torch.device) -> bool:
    return device.type == "cuda"  # the CPU interpreter has no inline assembly


def _launch(x, region: Region, residual, weight, eps, out, residual_out, norm: bool) -> None:
    rows, hidden = x.shape
    if rows == 0:
        return
    if x.stride(1) != 1:
        raise ValueError(f"one-shot all-reduce needs rows with contiguous columns, got strides {tuple(x.stride())}")
    if not region.fits(x):
        raise ValueError(f"all-reduce of {x.numel() * x.element_size()} bytes does not fit the "
                         f"{region.buffer_bytes}-byte one-shot buffer")
    grid = min(rows, region.max_programs, multiprocessor_count(x.device) if x.is_cuda else MAX_PROGRAMS)
    _one_shot_kernel[(grid,)](
        x, x.stride(0), region.bases, region.epoch,
        residual if norm else x, residual.stride(0) if norm else 0, weight if norm else x,
        out, residual_out if norm else out,
        rows, hidden, Region.signal_bytes(region.world), region.buffer_bytes, eps, int(region.timeout_s * 1e9),
        RANK=region.rank, WORLD=region.world, NORM=norm, BLOCK=triton.next_power_of_2(hidden),
        USE_TIMER=_use_timer(x.device), num_warps=4 if hidden <= 2048 else 8,
    )


def all_reduce(x: torch.Tensor, region: Region) -> torch.Tensor:
    """Sum ``x`` (rows of the group's shape, on every rank) over the group, in place."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    _launch(rows, region, None, None, 0.0, rows, None, norm=False)
    return x


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            region: Region) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * norm(s + residual), s + residual)`` with ``s`` the sum of ``x`` over the group:
    the all-reduce followed by ``layers.norm.add_rms_norm``, in one kernel."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    residual = residual.reshape(-1, shape[-1]).contiguous()
    if residual.shape != rows.shape or residual.dtype != rows.dtype or weight.shape != rows.shape[1:]:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} and weight {tuple(weight.shape)} "
                         f"do not match rows {tuple(rows.shape)} {rows.dtype}")
    out = torch.empty_like(rows)
    residual_out = torch.empty_like(rows)
    _launch(rows, region, residual, weight, eps, out, residual_out, norm=True)
    return out.view(shape), residual_out.view(shape)
