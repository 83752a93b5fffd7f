"""``zipage bench moe``: one mixture-of-experts MLP layer against its bytes.

For each batch size the layer (router, grouped GEMMs, combine) runs on random bf16 weights of a
model shape, in a CUDA graph. Its floor is the bytes it must read: the router, the experts the
batch's tokens actually chose (counted from this batch's routing), and the activations, at the
measured copy bandwidth. ``--sweep`` also times other GEMM tiles, to choose the default.
``--quantization fp8`` runs float8 experts with per-row scales (W8A16), whose bytes halve.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from zipage.bench.common import COPY_BANDWIDTH_BYTES_PER_S, print_table, write_json

SWEEP = [(n, k, w, s) for n, k, w, s in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4))
         if n * k <= 16384]


def add_moe_parser(sub) -> None:
    p = sub.add_parser("moe", help="one mixture-of-experts layer against the bytes of the experts it touches",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--batch", default="1,64,256", help="tokens per step, comma-separated")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--sweep", action="store_true", help="also time every tile of the sweep; report the best")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="float8 experts (per-row scales)")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run_moe_bench)


def _time(fn, iters: int) -> float:
    graph = torch.cuda.CUDAGraph()
    fn()  # compile
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def run_moe_bench(args: argparse.Namespace) -> int:
    from zipage.kernels.fused_moe import TILES, fused_moe, route
    from zipage.utils.checkpoint import SHAPES

    if not torch.cuda.is_available():
        raise ValueError("zipage bench moe times CUDA kernels: no GPU is visible")
    shape = SHAPES[args.shape]
    if "num_experts" not in shape:
        raise ValueError(f"shape {args.shape!r} has no experts")
    hidden, inter = shape["hidden_size"], shape["moe_intermediate_size"]
    experts, top_k = shape["num_experts"], shape["num_experts_per_tok"]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dtype) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=dtype) * 0.02
    gate = torch.randn(experts, hidden, device=dev, dtype=dtype) * 0.02
    scales = {}
    if args.quantization == "fp8":
        w13, scales["w13_scale"] = _quantized(w13)
        w2, scales["w2_scale"] = _quantized(w2)
    scale_bytes = sum(s[0].numel() * s.element_size() for s in scales.values())
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size() + scale_bytes
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        x = torch.randn(batch, hidden, device=dev, dtype=dtype)
        _, ids = route(x @ gate.T, top_k, True)
        touched = int(torch.unique(ids).numel())
        floor_bytes = touched * expert_bytes + gate.numel() * 2 + batch * hidden * 2 * (2 + top_k) \
            + batch * top_k * 3 * inter * 2 * 2
        floor = floor_bytes / COPY_BANDWIDTH_BYTES_PER_S
        tiles = [TILES] + ([t for t in SWEEP if t != TILES] if args.sweep else [])
        timed = []
        for t in tiles:
            try:
                timed.append((_time(lambda: fused_moe(x, w13, w2, x @ gate.T, top_k, True, tiles=t, **scales),
                                     args.iters), t))
            except Exception as error:  # noqa: BLE001 - a tile that does not fit this GPU's shared memory
                print(f"tiles {t}: {type(error).__name__}")
        default = timed[0][0]
        best, best_tiles = min(timed)
        rows.append(dict(batch=batch, experts_touched=touched, floor_MB=floor_bytes / 1e6, ms=default * 1e3,
                         roofline_fraction=floor / default, best_ms=best * 1e3, best_tiles=str(best_tiles),
                         best_fraction=floor / best))
    experts_dtype = "fp8 experts (W8A16)" if scales else "bf16"
    print(f"{args.shape}: {experts} experts, {top_k} per token, hidden {hidden}, expert intermediate {inter}; "
          f"{experts_dtype}, CUDA graph; floor at {COPY_BANDWIDTH_BYTES_PER_S / 1e12:.2f} TB/s")
    print_table(rows, list(rows[0]))
    write_json(args.out, dict(benchmark="moe", shape=args.shape, quantization=args.quantization, rows=rows))
    return 0


def _quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 experts, float32 scales [experts, rows]) of ``w`` [experts, rows, columns], per row."""
    from zipage.layers.quant import quantize_rows
    q, s = quantize_rows(w.reshape(-1, w.shape[-1]))
    return q.view(w.shape), s.view(w.shape[:2])
