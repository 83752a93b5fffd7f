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

_rank = 0
_size = 1


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
    global _rank, _size
    if _size > 1 and dist.is_initialized():
        if dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()  # also forgets the group, as destroy does
        else:
            dist.destroy_process_group()
    _rank, _size = 0, 1


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
        dist.all_reduce(x)
    return x


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
