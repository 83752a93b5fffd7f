"""Tiles of the paged-decode kernel on a GPU: bf16 and float8 caches, Qwen3-8B heads.

For each batch and context, times ``paged_decode_attention`` (20 calls in a CUDA graph)
with the bf16 cache's tuned tile and, for a float8 cache, every candidate tile (tokens per
K/V tile, num_warps, num_stages), widened by Triton's conversion and by
``common.fp8_to_bf16``, after checking each
output against the PyTorch twin. Prints ms and the share of the copy bandwidth on the
bytes read (K, V and, for float8, their scales), and writes the rows as JSON.

    python scripts/decode_tile_sweep.py [--batch 64,256] [--context 1024,4096] [--out tiles.json]

``--fp8-probabilities`` times each float8 tile again with P @ V on float8 matrix units
(``paged_decode.FP8_PROBABILITIES``), with the compiler's register count and with each cap of
``--max-registers`` (``paged_decode.FP8_PROBS_MAX_REGISTERS``); its error is against the same
exact twin. ``--widening-registers`` times the float8 widening kernel capped at each of its register
counts too (``paged_decode.FP8_WIDENING_MAX_REGISTERS``); ``--ragged`` gives the requests contexts of
random lengths up to ``--context``.
"""

from __future__ import annotations

import argparse
import json

import torch

from zipage.bench.common import COPY_BANDWIDTH_BYTES_PER_S
from zipage.bench.kernels import _as_fp8, _graph_us, _paged_problem, _rel_err
from zipage.kernels import common, paged_decode
from zipage.kernels.paged_decode import decode_tile, paged_decode_attention, paged_decode_attention_torch

TILES = [(32, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 3), (128, 8, 3), (128, 8, 2)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="64,256")
    p.add_argument("--context", default="1024,4096")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--default-only", action="store_true",
                   help="time each cache's default tile only (the engine's kernels, bf16 against fp8)")
    p.add_argument("--fp8-probabilities", action="store_true",
                   help="also time each float8 tile with P @ V on float8 matrix units")
    p.add_argument("--max-registers", default="168,128",
                   help="with --fp8-probabilities: register caps to time it with too (comma-separated)")
    p.add_argument("--widening-registers", default="",
                   help="register caps to time the float8 widening kernel with too (comma-separated; "
                        "paged_decode.FP8_WIDENING_MAX_REGISTERS)")
    p.add_argument("--ragged", action="store_true",
                   help="contexts of random lengths from 1 to --context instead of all equal")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device = torch.device("cuda")
    rows = []
    for batch in [int(x) for x in args.batch.split(",")]:
        for context in [int(x) for x in args.context.split(",")]:
            k, v, tables, lens = _paged_problem(batch, context, args.block_size, args.heads, args.kv_heads,
                                                args.head_dim, torch.bfloat16, device, ragged=args.ragged)
            q = torch.randn(batch, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
            scale = args.head_dim ** -0.5
            for fp8 in (False, True):
                kc, vc, scales = _as_fp8(k, v, fp8)
                ref = paged_decode_attention_torch(q.float(), kc, vc, tables, lens, scale,
                                                   **{n: t for n, t in scales.items()}) if fp8 else \
                    paged_decode_attention_torch(q.float(), k.float(), v.float(), tables, lens, scale)
                read = 2 * int(lens.sum()) * args.kv_heads * (args.head_dim * kc.element_size() + (4 if fp8 else 0))
                default = decode_tile(args.head_dim, kc.dtype)
                tiles = TILES if fp8 and not args.default_only else [default]  # bf16: its tile, the yardstick
                for tile in tiles:
                    for fast in ((False, True) if fp8 and not args.default_only else (fp8,)):
                        caps = [None] + [int(r) for r in args.max_registers.split(",") if r]
                        variants = [(False, None)] + ([(True, cap) for cap in caps] if fp8 and args.fp8_probabilities
                                                      else [])
                        if fp8:  # the widening kernel capped
                            variants += [(False, int(r)) for r in args.widening_registers.split(",") if r]
                        for probs, cap in variants:
                            row = _time(q, kc, vc, tables, lens, scale, scales, ref, tile, fast, probs, cap)
                            if row is None:
                                print(f"batch {batch} context {context} fp8 {fp8} tile {tile}: does not run")
                                continue
                            row.update(batch=batch, context=context, cache="fp8" if fp8 else "bf16",
                                       default=tile == default and not probs and cap is None,
                                       of_copy=read / (row["ms"] / 1e3) / COPY_BANDWIDTH_BYTES_PER_S)
                            rows.append(row)
                            print(f"batch {batch:4d} context {context:5d} {row['cache']:4s} tile {str(tile):13s} "
                                  f"fast {int(fast)} fp8 P@V {int(probs)} regs {cap or '-':>3} "
                                  f"{'*' if row['default'] else ' '} "
                                  f"{row['ms'] * 1e3:8.1f} us {row['of_copy']:6.1%} of copy  err {row['rel_err']:.1e}",
                                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _time(q, kc, vc, tables, lens, scale, scales, ref, tile, fast, probs, max_registers):
    """The kernel's ms (20 calls in a CUDA graph) and its error against ``ref``, or None for a tile
    that does not fit (shared memory, registers)."""
    common.FAST_FP8_WIDENING, paged_decode.FP8_PROBABILITIES = fast, probs
    if probs:
        paged_decode.FP8_PROBS_MAX_REGISTERS = max_registers
    else:
        paged_decode.FP8_WIDENING_MAX_REGISTERS = max_registers
    try:
        out = paged_decode_attention(q, kc, vc, tables, lens, scale, tile=tile, **scales)
        err = _rel_err(out, ref)
        ms = _graph_us(lambda: paged_decode_attention(q, kc, vc, tables, lens, scale, tile=tile, **scales),
                       calls=20) / 1e3
    except Exception as e:  # noqa: BLE001
        print(f"  {type(e).__name__}: {str(e)[:200]}")
        return None
    finally:
        common.FAST_FP8_WIDENING, paged_decode.FP8_PROBABILITIES = True, False
        paged_decode.FP8_PROBS_MAX_REGISTERS = paged_decode.FP8_WIDENING_MAX_REGISTERS = None
    return dict(tile=list(tile), fast_widening=fast, fp8_probabilities=probs, max_registers=max_registers, ms=ms,
                rel_err=err)


if __name__ == "__main__":
    raise SystemExit(main())
