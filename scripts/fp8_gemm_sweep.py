"""Time the fp8-weight GEMMs of a decode step on the GPU and pick the best config per shape.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python scripts/fp8_gemm_sweep.py --out DIR

For each linear layer of Qwen3-8B (qkv 4096->6144, o 4096->4096, gate_up 4096->24576,
down 12288->4096) and each batch M (1, 64, 128, 256) it times, inside CUDA graphs (no
launch overhead between the calls, the gaps a decode step's graph has are counted):

- ``copy``: a device-to-device copy of the fp8 weight (bytes read + written): what one
  launch of this size reaches in a graph, ramp-up and tail included;
- ``bf16``: ``torch.matmul`` on bf16 weights (the unquantized model);
- ``scaled_mm``: W8A8 as the engine runs it above 64 tokens (``quant.scaled_mm_linear``:
  the activations quantized per token by torch ops, then ``torch._scaled_mm`` with row-wise
  scales); ``scaled_mm-gemm``: the ``_scaled_mm`` call alone, on pre-quantized activations;
- every candidate config of the Triton kernels (``zipage/kernels/fp8_linear.py``:
  ``candidates``): W8A16 and W8A8 (the activations quantized by a Triton
  kernel, included in the time), and the configs ``choose_config`` picks now (``default``);
  ``quantize-x``: that activation kernel alone; ``w8a16-tritoncvt`` (M <= 64): the default
  W8A16 config with Triton's own fp8 -> bf16 conversion instead of the integer-op one.

Every call reads a different copy of the weight (enough copies to exceed the L2 cache four
times), so the weights come from memory as in a model. Each time is the median over 60
replays of a graph of those calls, divided by the calls. GB/s counts the fp8 weight (bf16 for
``bf16``), its scales, the activations and the output once; ``%copy`` is that over 4.3 TB/s
(the H200's measured device-to-device copy). Every candidate is first checked against its
PyTorch twin (relative error below 1e-2) and skipped if it fails or does not compile; one
failing config never stops the run (compiles and first checks run in worker processes, so
even a crash of one stays there).

Writes DIR/fp8_gemm_sweep.json (every row) and DIR/tuned.py (the best config per variant,
M bucket and shape, as entries of ``TUNED`` in ``zipage/kernels/fp8_linear.py``: paste them
there). Bounded by ``--budget-s`` (default 270 s of the whole run; the run of 2026-12-02
took 61 s with 16 compile processes): past it, the remaining candidates are skipped (the
baselines and defaults still run).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
COPY_BYTES_PER_S = 4.3e12
MAX_REL_ERR = 1e-2
TIMED_REPLAYS = 60


# -- problems and checks (shared by the workers and the main process) ------------------
def make_weight(n: int, k: int, seed: int):
    import torch
    from zipage.layers import quant

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    q, s = quant.quantize_rows(w)
    return w, q, s


def make_input(m: int, k: int, seed: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)


def run_variant(variant: str, x, q, s, config, out=None):
    from zipage.kernels import fp8_linear as F

    return (F.w8a16_linear if variant == "w8a16" else F.w8a8_linear)(x, q, s, config=config, out=out)


def twin(variant: str, x, q, s):
    from zipage.kernels import fp8_linear as F

    return (F.w8a16_linear_torch if variant == "w8a16" else F.w8a8_linear_torch)(x, q, s)


def rel_err(out, ref) -> float:
    import torch

    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm()).item()


def check(variant, x, q, s, config) -> float:
    """Relative error of one call against the twin, the output poisoned first (NaN in every
    element the kernel fails to write)."""
    import torch

    out = torch.full((x.shape[0], q.shape[0]), math.nan, dtype=x.dtype, device=x.device)
    run_variant(variant, x, q, s, config, out)
    torch.cuda.synchronize()
    return rel_err(out, twin(variant, x, q, s))


# -- workers: compile each kernel config and check it once, in parallel -----------------
def worker(tasks: mp.Queue, results: mp.Queue) -> None:
    import torch  # noqa: F401 - CUDA in this process
    from zipage.kernels.fp8_linear import W8A16Config

    cache = {}
    while True:
        task = tasks.get()
        if task is None:
            return
        key, variant, fields, m, n, k = task
        results.put(("start", key, os.getpid()))
        start = time.perf_counter()
        try:
            if (n, k) not in cache:
                cache[(n, k)] = make_weight(n, k, seed=n + k)[1:]
            q, s = cache[(n, k)]
            x = make_input(m, k, seed=m)
            err = check(variant, x, q, s, W8A16Config(**fields))
            results.put(("done", key, err, time.perf_counter() - start, None))
        except Exception as error:  # noqa: BLE001 - reported; the sweep skips this config
            message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
            results.put(("done", key, math.inf, time.perf_counter() - start, message))
            if "CUDA error" in message or "illegal" in message:
                return  # this process's CUDA context is gone: the main process starts another


def precompile(tasks: dict, jobs: int, timeout_s: float) -> dict:
    """{key: (error, seconds, message)} for every task, run by ``jobs`` worker processes (a
    worker that dies takes only its current task with it: another one starts)."""
    ctx = mp.get_context("spawn")
    task_q, result_q = ctx.Queue(), ctx.Queue()
    for key, task in tasks.items():
        task_q.put((key, *task))
    procs = [ctx.Process(target=worker, args=(task_q, result_q), daemon=True) for _ in range(min(jobs, len(tasks)))]
    for p in procs:
        p.start()
    results, running = {}, {}  # running: key -> (pid, start time)
    deadline = time.perf_counter() + timeout_s
    while len(results) < len(tasks) and time.perf_counter() < deadline:
        try:
            message = result_q.get(timeout=1.0)
        except queue.Empty:
            message = None
        if message is not None and message[0] == "start":
            running[message[1]] = (message[2], time.perf_counter())
        elif message is not None:
            _, key, err, seconds, text = message
            running.pop(key, None)
            results[key] = (err, seconds, text)
            print(f"  compiled+checked {len(results)}/{len(tasks)}: {key} err={err:.2e} {seconds:.1f}s"
                  + (f" FAILED {text}" if text else ""), flush=True)
        for i, p in enumerate(procs):
            if not p.is_alive() and p.exitcode not in (0, None):
                lost = [key for key, (pid, _) in running.items() if pid == p.pid]
                for key in lost:
                    results[key] = (math.inf, 0.0, f"worker died (exit code {p.exitcode})")
                    running.pop(key)
                    print(f"  {key}: worker died (exit code {p.exitcode})", flush=True)
                procs[i] = ctx.Process(target=worker, args=(task_q, result_q), daemon=True)
                procs[i].start()
            elif not p.is_alive() and p.exitcode == 0 and task_q.empty() is False:
                procs[i] = ctx.Process(target=worker, args=(task_q, result_q), daemon=True)
                procs[i].start()
    for key in tasks:
        results.setdefault(key, (math.inf, 0.0, "not compiled before the deadline"))
    for _ in procs:
        task_q.put(None)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return results


# -- timing ---------------------------------------------------------------------------
def time_calls(fns, replays: int = TIMED_REPLAYS) -> float:
    """Milliseconds per call: ``fns`` (one call each) captured in one CUDA graph, the graph
    replayed, the median replay time divided by the calls."""
    import torch

    for fn in fns[:2]:
        fn()  # compiled (or loaded from the cache) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2] / len(fns)


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        err = "" if r.get("rel_err") is None else f"{r['rel_err']:.1e}"
        print(f"  {r['layer']:>7} M={r['m']:<4} {r['method']:<14} {r.get('config', ''):<40} "
              f"{1000 * r['ms']:9.2f} us {r['gb_per_s']:8.0f} GB/s {100 * r['of_copy']:6.1f}% {err}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for fp8_gemm_sweep.json and tuned.py")
    parser.add_argument("--batches", default="1,64,128,256")
    parser.add_argument("--layers", default=",".join(SHAPES), help=f"from {', '.join(SHAPES)}")
    parser.add_argument("--variants", default="w8a16,w8a8")
    parser.add_argument("--budget-s", type=float, default=270.0, help="the whole run's time bound")
    parser.add_argument("--jobs", type=int, default=0, help="compile processes (default: CPUs, at most 16)")
    parser.add_argument("--max-candidates", type=int, default=0, help="per (layer, M, variant); 0: all")
    parser.add_argument("--match", default="", help="only the candidates whose config contains this "
                        "(e.g. 'tma'; the baselines and the defaults always run)")
    args = parser.parse_args()
    t0 = time.perf_counter()

    import torch
    from zipage.kernels import common
    from zipage.kernels import fp8_linear as F
    from zipage.layers import quant

    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    import triton
    print(f"{props.name}: {sms} SMs, L2 {l2 / 2**20:.0f} MiB; torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    batches = [int(b) for b in args.batches.split(",") if b]
    layers = [name for name in args.layers.split(",") if name]
    variants = [v for v in args.variants.split(",") if v]

    # every candidate, and one compile task per distinct compiled kernel (the split is a
    # run-time argument: a config and its splits share a binary; the task runs the largest)
    plan = {}  # (layer, m, variant) -> [config]
    tasks = {}
    for layer in layers:
        n, k = SHAPES[layer]
        for m in batches:
            for variant in variants:
                configs = [c for c in F.candidates(m, n, k, sms, variant) if args.match in c.short()]
                if args.max_candidates:
                    configs = configs[:args.max_candidates]
                default = F.choose_config(m, n, k, sms, variant)
                plan[(layer, m, variant)] = (configs, default)
                for c in configs + [default]:
                    key = compile_key(variant, c)
                    if key not in tasks or tasks[key][1]["split_k"] < c.split_k:
                        tasks[key] = (variant, dict(c.__dict__), m, n, k)
    jobs = args.jobs or min(16, os.cpu_count() or 4)
    print(f"{sum(len(c) for c, _ in plan.values())} candidates, {len(tasks)} kernels to compile "
          f"({jobs} processes)", flush=True)
    compiled = precompile(tasks, jobs, timeout_s=max(30.0, 0.5 * args.budget_s))
    broken = {key for key, (err, _, _) in compiled.items() if not err < MAX_REL_ERR}
    print(f"compiled and checked in {time.perf_counter() - t0:.0f} s; {len(broken)} kernels failed", flush=True)

    rows = []
    for layer in layers:
        n, k = SHAPES[layer]
        fp8_bytes = n * k + 4 * n
        copies = max(2, math.ceil(4 * l2 / fp8_bytes))
        weights = [make_weight(n, k, seed=i) for i in range(copies)]
        bf16 = [w for w, _, _ in weights[:max(2, math.ceil(4 * l2 / (2 * n * k)))]]
        fp8 = [(q, s) for _, q, s in weights]
        for m in batches:
            x = make_input(m, k, seed=m)
            act_bytes = 2 * m * k + 2 * m * n  # bf16 activations in, bf16 out
            fp8_io = fp8_bytes + act_bytes
            layer_rows = []

            def record(method, ms, nbytes, config="", rel=None, **extra):
                row = dict(layer=layer, n=n, k=k, m=m, method=method, config=config, ms=ms,
                           gb_per_s=nbytes / ms / 1e6, of_copy=nbytes / (ms / 1e3) / COPY_BYTES_PER_S,
                           rel_err=rel, **extra)
                layer_rows.append(row)
                return row

            def attempt(method, fn_for, nbytes, **extra):
                try:
                    ms = time_calls([fn_for(i) for i in range(len(fp8) if "bf16" not in method else len(bf16))])
                    return record(method, ms, nbytes, **extra)
                except Exception as error:  # noqa: BLE001 - reported, the sweep goes on
                    print(f"  {layer} M={m} {method} {extra.get('config', '')}: {type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}"[:300], flush=True)
                    return None

            # the same bytes copied (read and written) by one launch each: what a kernel of this
            # size reaches in a graph (launch, ramp-up and tail included)
            copy_dst = torch.empty_like(fp8[0][0])
            attempt("copy", lambda i: (lambda: copy_dst.copy_(fp8[i][0])), 2 * n * k)
            attempt("bf16", lambda i: (lambda: torch.matmul(x, bf16[i].t())), 2 * n * k + act_bytes)
            attempt("scaled_mm", lambda i: (lambda: quant.scaled_mm_linear(x, *fp8[i])), fp8_io,
                    rel=rel_err(quant.scaled_mm_linear(x, *fp8[0]), F.w8a8_linear_torch(x, *fp8[0])))
            xq, xs = quant.quantize_activations(x)
            attempt("scaled_mm-gemm", lambda i: (lambda: torch._scaled_mm(
                xq, fp8[i][0].t(), scale_a=xs, scale_b=fp8[i][1].view(1, -1), out_dtype=torch.bfloat16)), fp8_io)
            attempt("quantize-x", lambda i: (lambda: F.quantize_rows_fp8(x)), 2 * m * k + m * k + 4 * m)
            for variant in variants:
                configs, default = plan[(layer, m, variant)]
                for label, config in [("default", default)] + [("candidate", c) for c in configs]:
                    if label == "candidate" and time.perf_counter() - t0 > args.budget_s:
                        print(f"  budget of {args.budget_s:.0f} s spent: the remaining {variant} candidates of "
                              f"{layer} M={m} are skipped", flush=True)
                        break
                    if compile_key(variant, config) in broken:
                        continue
                    try:
                        err = check(variant, x, *fp8[0], config)
                    except Exception as error:  # noqa: BLE001
                        print(f"  {variant} {config.short()}: {type(error).__name__}", flush=True)
                        continue
                    if not err < MAX_REL_ERR:
                        print(f"  {layer} M={m} {variant} {config.short()}: relative error {err:.2e}, skipped",
                              flush=True)
                        continue
                    attempt(f"{variant}-{label}" if label == "default" else variant,
                            lambda i, c=config, v=variant: (lambda: run_variant(v, x, *fp8[i], c)), fp8_io,
                            config=config.short(), rel=err, fields=dict(config.__dict__))
                    if label == "default" and variant == "w8a16" and m <= 64:
                        # the same config with Triton's own fp8 -> bf16 conversion, for comparison
                        common.FAST_FP8_WIDENING = False
                        try:
                            attempt("w8a16-tritoncvt", lambda i, c=config: (lambda: run_variant("w8a16", x, *fp8[i], c)),
                                    fp8_io, config=config.short())
                        finally:
                            common.FAST_FP8_WIDENING = True
            rows += layer_rows
            shown = [r for r in layer_rows if r["method"] in ("copy", "bf16", "scaled_mm", "scaled_mm-gemm", "quantize-x",
                                                              "w8a16-tritoncvt")
                     or r["method"].endswith("default")]
            for variant in variants:
                shown += sorted([r for r in layer_rows if r["method"] == variant], key=lambda r: r["ms"])[:3]
            print_rows(shown)
        del weights, bf16, fp8
        torch.cuda.empty_cache()

    # the best config per (variant, layer, M), and the summary
    best = {}
    for r in rows:
        if r["method"] in variants or r["method"].endswith("-default"):
            variant = r["method"].split("-")[0]
            key = (variant, r["layer"], r["m"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    print(f"\n{'layer':>7} {'M':>4} | {'copy':>6} {'bf16':>6} {'sc_mm':>6} | {'w8a16 default':>14} {'w8a16 best':>11} "
          f"{'w8a8 best':>10}  (% of {COPY_BYTES_PER_S / 1e12:.1f} TB/s)   best w8a16 config / best w8a8 config")
    for layer in layers:
        for m in batches:
            def pct(method):
                found = [r for r in rows if r["layer"] == layer and r["m"] == m and r["method"] == method]
                return f"{100 * found[0]['of_copy']:5.1f}%" if found else "    -"
            b16, b8 = best.get(("w8a16", layer, m)), best.get(("w8a8", layer, m))
            p16 = f"{100 * b16['of_copy']:5.1f}%" if b16 else "-"
            p8 = f"{100 * b8['of_copy']:5.1f}%" if b8 else "-"
            c16 = b16["config"] if b16 else "-"
            c8 = b8["config"] if b8 else "-"
            print(f"{layer:>7} {m:>4} | {pct('copy'):>6} {pct('bf16'):>6} {pct('scaled_mm'):>6} | {pct('w8a16-default'):>14} "
                  f"{p16:>11} {p8:>10}   {c16} / {c8}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_gemm_sweep.json"), "w") as f:
        json.dump(dict(device=props.name, sms=sms, torch=torch.__version__, triton=triton.__version__,
                       copy_bytes_per_s=COPY_BYTES_PER_S, rows=rows,
                       compile_failures={k: v[2] for k, v in compiled.items() if v[2]}), f, indent=1)
    with open(os.path.join(args.out, "tuned.py"), "w") as f:
        f.write(f"# measured on {props.name} ({sms} SMs) by scripts/fp8_gemm_sweep.py\nTUNED = {{\n")
        for (variant, layer, m), r in sorted(best.items()):
            c = F.W8A16Config(**r["fields"])
            n, k = SHAPES[layer]
            args_text = ", ".join(map(str, (c.block_m, c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages)))
            args_text += ", swap_ab=True" if c.swap_ab else ""
            args_text += ", tma=True" if c.tma else ""
            f.write(f'    ("{variant}", {F.m_bucket(m)}, {n}, {k}): W8A16Config({args_text}),'
                    f"  # {layer}: {100 * r['of_copy']:.0f}%\n")
        f.write("}\n")
    print(f"\nwrote {args.out}/fp8_gemm_sweep.json and tuned.py in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


def compile_key(variant, config) -> str:
    """What makes a distinct binary (not the split: a run-time argument)."""
    return f"{variant} {config.short().replace(f' s{config.split_k} ', ' ')}"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001 - whatever was printed stays; the traceback says where it stopped
        traceback.print_exc()
        sys.exit(1)
