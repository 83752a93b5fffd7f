"""All-reduce at a decode step's sizes on this host's GPUs: NCCL (the engine's default, through
``torch.distributed.all_reduce``) against PyTorch's symmetric-memory kernels (the activations copied
into a buffer every rank can read over NVLink, then ``one_shot_all_reduce``, each rank reading all
peers' rows, or ``two_shot_all_reduce_``, a reduce-scatter then an all-gather) and the engine's own
one-shot kernel (``zipage``: ``all_reduce="one-shot"``, ``kernels/one_shot.py``). Two more rows
time what the engine runs after each row-parallel projection, the sum then the residual add and
RMSNorm: ``nccl+norm`` (NCCL, then the norm kernel) against ``zipage+norm`` (one fused kernel).

A tensor-parallel decode step of Qwen3-8B runs 72 of them (two a layer), each summing
``rows x hidden`` bf16 values, rows being the step's requests. For each size every variant's sum is
first checked against NCCL's (bit for bit; world size 2 adds two values, which every algorithm
rounds the same way), then timed as ``--calls`` calls captured in one CUDA graph (as the engine's
steps run), replayed, and divided by the calls. Rank 0 prints the table and writes ``--out``.

    python scripts/allreduce_sweep.py [--gpus 2] [--rows 1,16,64,128,256] [--hidden 4096] [--out F]

``--device cpu`` runs the same harness on gloo without graphs (only the ``nccl`` row, there gloo:
the symmetric-memory kernels need CUDA); the tests use it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_module
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zipage import distributed

VARIANTS = ("nccl", "one_shot", "two_shot", "zipage", "nccl+norm", "zipage+norm")
EPS = 1e-6
TIMED_REPLAYS = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _symmetric_buffer(numel: int, dtype: torch.dtype, device: torch.device, group_name: str):
    """A buffer of ``numel`` elements every rank maps, or the reason there is none."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        buf = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group_name)
        return buf, None
    except Exception as error:  # noqa: BLE001 - reported in the table, the NCCL rows still run
        return None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]


def _calls(variant: str, x: torch.Tensor, buf: torch.Tensor | None, group_name: str):
    """One all-reduce of ``x`` by ``variant``: a function returning the summed tensor (the +norm
    variants: the norm of the sum plus a residual, whose weight and residual are fixed here)."""
    n = x.numel()
    if variant.endswith("+norm"):
        from zipage.kernels.norm_rope import add_rms_norm_triton

        g = torch.Generator(device="cpu").manual_seed(7)
        residual = torch.randn(x.shape, generator=g).to(x.device, x.dtype)
        weight = torch.randn(x.shape[-1], generator=g).to(x.device, x.dtype)
        if variant == "nccl+norm":
            def call():
                dist.all_reduce(x)
                return add_rms_norm_triton(x, residual, weight, EPS)[0]
        else:
            def call():
                return distributed.all_reduce_add_rms_norm(x, residual, weight, EPS)[0]
        return call
    if variant == "zipage":
        def call():
            return distributed.all_reduce(x)
    elif variant == "nccl":
        def call():
            dist.all_reduce(x)
            return x
    elif variant == "one_shot":
        def call():
            buf[:n].copy_(x.view(-1))
            return torch.ops.symm_mem.one_shot_all_reduce(buf[:n], "sum", group_name).view_as(x)
    else:
        def call():
            buf[:n].copy_(x.view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_(buf[:n], "sum", group_name)
            return buf[:n].view_as(x)
    return call


def _time_us(call, calls: int, device: torch.device) -> float:
    """Microseconds a call: ``calls`` of them in one CUDA graph, the median of the replays (on the
    CPU: run one after another)."""
    if device.type != "cuda":
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        dist.barrier()
        return 1e6 * (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(TIMED_REPLAYS):
        dist.barrier()  # the ranks start each replay together
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return 1000 * sorted(times)[len(times) // 2] / calls


def _worker(rank: int, size: int, port: int, args: argparse.Namespace, queue) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # the engine's group (torch.distributed's default group under it), as the engine's ranks join it
    distributed.init_tensor_parallel(rank, size, "nccl" if device.type == "cuda" else "gloo",
                                     f"tcp://127.0.0.1:{port}")
    try:
        group_name = dist.group.WORLD.group_name
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        rows_list = [int(r) for r in args.rows.split(",")]
        buf, why = (None, "needs CUDA") if device.type != "cuda" else \
            _symmetric_buffer(max(rows_list) * args.hidden, dtype, device, group_name)
        ours_why = "needs CUDA"
        if device.type == "cuda":
            try:
                distributed.enable_one_shot_all_reduce(device)
                ours_why = None
            except Exception as error:  # noqa: BLE001 - reported in the table
                ours_why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
        results = []
        for rows in rows_list:
            g = torch.Generator(device="cpu").manual_seed(1000 * rank + rows)
            data = torch.randn(rows, args.hidden, generator=g).to(device, dtype)
            expected = data.clone()
            dist.all_reduce(expected)
            for variant in VARIANTS:
                row = dict(rows=rows, hidden=args.hidden, bytes=data.numel() * data.element_size(), variant=variant)
                missing = (why if buf is None else None) if variant in ("one_shot", "two_shot") else \
                    ours_why if variant.startswith("zipage") else "needs CUDA" if variant == "nccl+norm" and \
                    device.type != "cuda" else None
                if missing:
                    results.append({**row, "unavailable": missing})
                    continue
                x = data.clone()
                try:
                    got = _calls(variant, x, buf, group_name)()
                    want = expected
                    if variant.endswith("+norm"):  # against NCCL's sum through the norm kernel
                        want = _calls("nccl+norm", data.clone(), buf, group_name)()
                    row["equal_to_nccl"] = bool(torch.equal(got, want))
                    x.zero_()  # timed on zeros: repeated sums stay finite
                    row["us"] = _time_us(_calls(variant, x, buf, group_name), args.calls, device)
                except Exception as error:  # noqa: BLE001 - one variant failing never stops the sweep
                    row["unavailable"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                results.append(row)
        if rank == 0:
            queue.put(results)
    finally:
        distributed.destroy_tensor_parallel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=2, help="ranks (GPUs) in the group (default 2)")
    p.add_argument("--rows", default="1,16,64,128,256", help="rows (requests) of each all-reduce, comma-separated")
    p.add_argument("--hidden", type=int, default=4096, help="values a row (Qwen3-8B: 4,096)")
    p.add_argument("--calls", type=int, default=72, help="all-reduces captured in one graph (a Qwen3-8B step: 72)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.gpus < 2:
        print(f"--gpus must be >= 2, got {args.gpus}", file=sys.stderr)
        return 2
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        print(f"needs {args.gpus} CUDA GPUs; this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.gpus, port, args, queue)) for r in range(args.gpus)]
    for proc in procs:
        proc.start()
    results = None
    while results is None:
        try:
            results = queue.get(timeout=5)
        except queue_module.Empty:
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed:
                for proc in procs:
                    proc.kill()
                print(f"rank {procs.index(failed[0])} exited with code {failed[0].exitcode}", file=sys.stderr)
                return 1
    for proc in procs:
        proc.join(timeout=60)
    print(f"{'rows':>5} {'bytes':>9} " + " ".join(f"{v:>18}" for v in VARIANTS))
    for rows in sorted({r["rows"] for r in results}):
        cells = []
        for variant in VARIANTS:
            r = next(r for r in results if r["rows"] == rows and r["variant"] == variant)
            cells.append(f"{'-':>18}" if "us" not in r else
                         f"{r['us']:7.2f} us {'equal' if r['equal_to_nccl'] else 'DIFFERS':>7}")
        size = next(r["bytes"] for r in results if r["rows"] == rows)
        print(f"{rows:>5} {size:>9} " + " ".join(cells))
    for reason in sorted({r["unavailable"] for r in results if "unavailable" in r}):
        print(f"unavailable: {reason}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(benchmark="allreduce", gpus=args.gpus, device=args.device, calls=args.calls,
                           torch=torch.__version__, rows=results), f, indent=1)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
