"""The tensor-parallel group: this process's rank, the group's size, and the collectives
the sharded layers use.

Every process of the group runs the same model on its share of the weights (its
query and KV heads, its slice of the MLP and of the vocabulary). At size 1, the
default, nothing here touches ``torch.distributed``: each collective returns its
input, so a single process runs exactly as without tensor parallelism.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from zipage.kernels import one_shot

_rank = 0
_size = 1
_one_shot: one_shot.Region | None = None  # the one-shot all-reduce's buffers, when it is on
# The largest sum the one-shot all-reduce takes (larger ones, long prompts' rows, go to NCCL): a
# decode step's rows fit many times over (256 rows of Qwen3-8B are 2 MiB), and from about this
# size a one-shot read of every peer's rows no longer beats NCCL's ring.
ONE_SHOT_BUFFER_BYTES = 8 << 20
# Groups (by name) this process has set symmetric memory up for. PyTorch keeps a group's
# symmetric-memory state (its store) by name for the life of the process, and a new group gets
# the same name as the one before it ("0"): a second setup would wait in the rendezvous forever
# (seen on two H200s, torch 2.11), so it is refused instead.
_symmetric_groups: set[str] = set()


def init_tensor_parallel(rank: int | None = None, size: int | None = None, backend: str | None = None,
                         init_method: str | None = None, timeout_s: float = 600.0) -> None:
    """Join the group of ``size`` processes as ``rank`` (default: ``RANK`` / ``WORLD_SIZE``).

    ``backend`` defaults to NCCL when CUDA is present, else gloo; ``init_method`` to
    ``env://`` (``MASTER_ADDR`` / ``MASTER_PORT``). Size 1 sets no process group up.
    """
    global _rank, _size
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    size = int(os.environ.get("WORLD_SIZE", 1)) if size is None else size
    if not (isinstance(size, int) and size >= 1 and 0 <= rank < size):
        raise ValueError(f"tensor-parallel rank must be in [0, size) with size >= 1, got rank={rank}, size={size}")
    if size > 1:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _rank, _size = rank, size


def destroy_tensor_parallel() -> None:
    """Leave the group (every rank does, when the engine closes).

    With NCCL the communicators are aborted rather than destroyed: the orderly
    teardown (``destroy_process_group``) hung at close on an H200 pair (torch 2.11,
    CUDA graphs holding the communicator), whichever rank called it first, while an
    abort does not wait on the peers. The engine only closes between steps, so no
    collective is in flight; or rank 0 leaves after a step failed in the middle
    (``ParallelRunner``), once it has killed the other ranks: an abort also ends its
    collectives still queued, and gloo's destroy waits on no peer."""
    global _rank, _size, _one_shot
    _one_shot = None  # before the group goes: its buffers are mapped through it
    if _size > 1 and dist.is_initialized():
        if dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()  # also forgets the group, as destroy does
        else:
            dist.destroy_process_group()
    _rank, _size = 0, 1


def enable_one_shot_all_reduce(device: torch.device, buffer_bytes: int = ONE_SHOT_BUFFER_BYTES,
                               timeout_s: float = 600.0) -> None:
    """Sum activations with the one-shot kernel (``kernels/one_shot.py``) from now on: every rank
    of the group calls this once its CUDA device is set. Each allocates a region of symmetric
    memory (PyTorch's ``torch.distributed._symmetric_memory``) and maps its peers'; raises
    ``RuntimeError`` naming what is missing (no NCCL group, no peer access, Triton absent)."""
    global _one_shot
    if _size == 1:
        return
    if not one_shot.AVAILABLE:
        raise RuntimeError("the one-shot all-reduce needs Triton; use all_reduce='nccl'")
    if not dist.is_initialized() or dist.get_backend() != "nccl" or device.type != "cuda":
        raise RuntimeError(f"the one-shot all-reduce needs an NCCL group on CUDA devices, got "
                           f"{dist.get_backend() if dist.is_initialized() else 'no group'} on {device}")
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    check_fresh_symmetric_group(group_name)
    _symmetric_groups.add(group_name)
    region = symm_mem.empty(one_shot.Region.region_bytes(_size, buffer_bytes), dtype=torch.uint8, device=device)
    region[: one_shot.Region.signal_bytes(_size)].zero_()  # no signal pending
    handle = symm_mem.rendezvous(region, group_name)
    bases = torch.tensor([int(p) for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    dist.barrier()  # every rank's signals are zero before any rank signals
    _one_shot = one_shot.Region(bases, _rank, _size, buffer_bytes, torch.zeros(2, dtype=torch.int32, device=device),
                                timeout_s, owner=(region, handle))


def check_fresh_symmetric_group(group_name: str) -> None:
    """Raise ``RuntimeError`` when this process has set the one-shot all-reduce up for a group of
    this name before (an earlier engine): one engine with it per process."""
    if group_name in _symmetric_groups:
        raise RuntimeError("all_reduce='one-shot' works for one tensor-parallel engine per process: this "
                           "process built one before, and PyTorch's symmetric memory keeps that group's state "
                           "(a second setup would wait forever); build this engine with all_reduce='nccl', or "
                           "in a new process")


def one_shot_enabled() -> bool:
    return _one_shot is not None


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


def partition(num_units: int, what: str = "units") -> tuple[int, int]:
    """(first, count) of the ``num_units`` units (heads, rows) this rank holds.

    With at least as many units as ranks, each rank holds an equal run of them; with
    fewer (KV heads on many GPUs), each unit is replicated on ``size / num_units``
    neighbouring ranks, so a rank holds the one KV head its query heads use.
    """
    if num_units >= _size:
        if num_units % _size:
            raise ValueError(f"{what}={num_units} must be divisible by tensor_parallel_size={_size}")
        count = num_units // _size
        return _rank * count, count
    if _size % num_units:
        raise ValueError(f"tensor_parallel_size={_size} must be divisible by {what}={num_units} "
                         "to replicate them across ranks")
    return _rank * num_units // _size, 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the group, in place."""
    if _size > 1:
        if _one_shot_fits(x):
            return one_shot.all_reduce(x, _one_shot)
        dist.all_reduce(x)
    return x


def _one_shot_fits(x: torch.Tensor) -> bool:
    return _one_shot is not None and x.is_cuda and x.is_contiguous() and _one_shot.fits(x)


class PartialSum:
    """A row-parallel projection's output before the sum over the group: its consumer (the
    RMSNorm after it) sums it together with its own work (``all_reduce_add_rms_norm``)."""
    __slots__ = ("partial",)

    def __init__(self, partial: torch.Tensor):
        self.partial = partial

    def reduce(self) -> torch.Tensor:
        return all_reduce(self.partial)


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(weight * norm(s + residual), s + residual)``, ``s`` the sum of ``x`` over the group, in
    one kernel with the one-shot all-reduce; None where that does not apply (the caller then
    sums and norms in two steps)."""
    if not _one_shot_fits(x) or residual.dtype != x.dtype:
        return None
    return one_shot.all_reduce_add_rms_norm(x, residual, weight, eps, _one_shot)


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    if _size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def all_reduce_min(values: list[int], device: torch.device) -> list[int]:
    """The group-wide minimum of each integer (cache sizes every rank must share)."""
    if _size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()
