"""``zipage bench linear``: the linear layers of one decode step, bf16 against fp8 weights.

Every decoder layer of a shape (``--shape``, default qwen3-8b) gets its own qkv, o, gate/up
and down weights, so the step reads them from memory as a model does (not from L2). One
step runs all of them on ``batch`` tokens, captured in a CUDA graph; each method is timed
at each batch size:

- ``bf16``: ``F.linear`` on bf16 weights;
- ``w8a16``: the Triton W8A16 kernel (fp8 weights, bf16 activations), with the configs of
  ``choose_config`` (the table measured by ``scripts/fp8_gemm_sweep.py``);
- ``w8a8``: the Triton W8A8 kernel (the activations quantized per token by a Triton kernel,
  in the timed step, then fp8 x fp8 products);
- ``scaled_mm``: W8A8 through ``torch._scaled_mm`` (the activations quantized per token, in
  the timed step);
- ``auto``: what the engine runs (``layers/quant.py``: w8a16 up to 64 tokens, then scaled_mm).

``of_copy`` is the step's weight bytes over its time, as a fraction of the device's copy
bandwidth. ``--sweep`` also times the W8A16 kernel's candidate configs (``candidates``) per
layer shape and batch, beside the default's, over all the layers (a quicker look than
``scripts/fp8_gemm_sweep.py``, which times both kernels against ``torch`` per layer).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from zipage.bench.common import copy_bandwidth, print_table, write_json

METHODS = ("bf16", "w8a16", "w8a8", "scaled_mm", "auto")


def add_linear_parser(sub) -> None:
    p = sub.add_parser("linear", help="the linear layers of one decode step: bf16 vs fp8 weights (GPU)")
    p.add_argument("--shape", default="qwen3-8b", help="a shape of zipage.utils.checkpoint.SHAPES")
    p.add_argument("--batch", default="1,64,128,256", help="comma-separated tokens per step")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="one rank's share of every layer")
    p.add_argument("--sweep", action="store_true", help="also time W8A16 tile/split choices per layer shape")
    p.add_argument("--device", default="cuda", help="cuda; cpu runs the same code as a check (its times mean little)")
    p.add_argument("--out", default=None, help="write JSON results here")
    p.set_defaults(func=run_linear_bench)


def layer_shapes(shape: str, tp: int = 1) -> dict[str, tuple[int, int]]:
    """{name: (out_features, in_features)} of one rank's linear layers of one decoder layer."""
    from zipage.utils.checkpoint import SHAPES

    s = SHAPES[shape]
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    head_dim = s.get("head_dim") or hidden // s["num_attention_heads"]
    q, kv = s["num_attention_heads"] * head_dim, max(1, s["num_key_value_heads"] // tp) * head_dim
    return {"qkv": (q // tp + 2 * kv, hidden), "o": (hidden, q // tp), "gate_up": (2 * inter // tp, hidden),
            "down": (hidden, inter // tp)}


def _time_step_ms(step, device: torch.device, iters: int = 20) -> float:
    """Median time of one replay of ``step`` captured in a CUDA graph (on the CPU: of one call)."""
    step()  # compiles outside the capture
    if device.type != "cuda":
        import time
        times = []
        for _ in range(3):
            start = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - start))
        return sorted(times)[1]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    from zipage.bench.kernels import _time_ms
    return _time_ms(graph.replay, iters=iters)


def run_linear_bench(args: argparse.Namespace) -> int:
    from zipage.kernels.fp8_linear import _num_sms, candidates, choose_config, w8a16_linear, w8a8_linear
    from zipage.layers import quant

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("zipage bench linear needs a CUDA GPU (or --device cpu, a check of the code)")
    if device.type == "cuda" and not quant.fp8_matmul_supported(device.index or 0):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no FP8 "
                         "matmul: the fp8 paths need compute capability 8.9")
    # bf16 as a model runs; the CPU check in fp16 (the Triton interpreter's bf16 tl.dot is wrong)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    from zipage.utils.checkpoint import SHAPES
    shapes = layer_shapes(args.shape, args.tensor_parallel_size)
    num_layers = args.layers or SHAPES[args.shape]["num_hidden_layers"]
    copy_bps, copy_source = copy_bandwidth(device)
    gen = torch.Generator(device=device).manual_seed(0)
    bf16, fp8 = [], []  # per decoder layer: {name: weight} / {name: (q, scale)}
    for _ in range(num_layers):
        weights = {name: torch.randn(n, k, device=device, dtype=dtype, generator=gen) * 0.02
                   for name, (n, k) in shapes.items()}
        if "bf16" in methods:
            bf16.append(weights)
        fp8.append({name: quant.quantize_rows(w) for name, w in weights.items()})
        del weights
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        inputs = {name: torch.randn(batch, k, device=device, dtype=dtype, generator=gen)
                  for name, (_, k) in shapes.items()}
        # one layer's outputs, checked against bf16 on the fp8 weights' values
        reference = {name: F.linear(inputs[name], quant.dequantize_rows(*fp8[0][name], dtype))
                     for name in shapes}
        for method in methods:
            if method == "bf16":
                def step():
                    for layer in bf16:
                        for name, w in layer.items():
                            F.linear(inputs[name], w)
                nbytes = sum(w.numel() * 2 for layer in bf16 for w in layer.values())
                error = None
            else:
                path = None if method == "auto" else method

                def matmul(x, q, s, path=path):
                    return w8a8_linear(x, q, s) if path == "w8a8" else quant.fp8_linear(x, q, s, path=path)

                def step():
                    for layer in fp8:
                        for name, (q, s) in layer.items():
                            matmul(inputs[name], q, s)
                nbytes = sum(q.numel() + 4 * s.numel() for layer in fp8 for q, s in layer.values())
                try:
                    error = max(_rel_err(matmul(inputs[n], *fp8[0][n]), reference[n]) for n in shapes)
                except Exception as failure:  # noqa: BLE001
                    print(f"{method} at batch {batch}: {type(failure).__name__}: {failure}")
                    continue
            try:
                ms = _time_step_ms(step, device)
            except Exception as failure:  # noqa: BLE001 - reported, the other methods still run
                print(f"{method} at batch {batch}: {type(failure).__name__}: {failure}")
                continue
            rows.append(dict(method=method, batch=batch, ms=ms, weight_gb=nbytes / 1e9,
                             tb_per_s=nbytes / ms / 1e9, of_copy=nbytes / (ms / 1e3) / copy_bps,
                             rel_err_vs_bf16=error))
            print_table(rows[-1:], list(rows[-1]))
        if args.sweep:
            sms = _num_sms(device.index or 0 if device.type == "cuda" else None)
            for name, (n, k) in shapes.items():
                x = inputs[name]
                nbytes = n * k * num_layers
                heuristic = choose_config(batch, n, k, sms)
                results = []
                for config in dict.fromkeys([heuristic] + candidates(batch, n, k, sms)):
                    try:
                        ms = _time_step_ms(lambda c=config: [w8a16_linear(x, *layer[name], config=c) for layer in fp8],
                                           device)
                    except Exception as error:  # noqa: BLE001 - a config that does not fit (shared memory)
                        print(f"  {config}: {type(error).__name__}")
                        continue
                    results.append((ms, config))
                best_ms, best = min(results, key=lambda r: r[0])
                heuristic_ms = next((ms for ms, c in results if c == heuristic), None)
                if heuristic_ms is None:
                    heuristic_ms = _time_step_ms(lambda: [w8a16_linear(x, *layer[name]) for layer in fp8], device)
                row = dict(method="sweep", batch=batch, layer=name, n=n, k=k, default=heuristic.short(),
                           default_of_copy=nbytes / (heuristic_ms / 1e3) / copy_bps, best=best.short(),
                           best_of_copy=nbytes / (best_ms / 1e3) / copy_bps)
                rows.append(row)
                print_table([row], list(row))
    print(f"\ncopy bandwidth: {copy_bps / 1e12:.2f} TB/s ({copy_source}); {num_layers} layers of {args.shape}, "
          f"tensor-parallel size {args.tensor_parallel_size}")
    timed = [r for r in rows if r["method"] != "sweep"]
    print_table(timed, list(timed[0]))
    write_json(args.out, dict(benchmark="linear", shape=args.shape, layers=num_layers, copy_bandwidth=copy_bps,
                              tensor_parallel_size=args.tensor_parallel_size, rows=rows))
    return 0


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()
