"""The W8A8 activation quantizers, a row read once against twice, timed on a GPU.

``quantize_rows_fp8`` (the attention output before ``o_proj``) and ``silu_mul_quantize`` (the
SwiGLU before the down projection) run one program per row. With
``fp8_linear.ONE_PASS_MAX_WIDTH`` at 0 they read a row twice, a block at a time (its amax
first, then the values to quantize); above the row's width they read it once and hold it in
registers. Each setting is checked against the other (the same bytes and scales) and timed
per call inside a CUDA graph, at Qwen3-8B's widths by default, with the share of the copy
bandwidth on the bytes read and written:

    python scripts/fp8_quantizer_sweep.py [--rows 1,64,128,256] [--hidden 4096] [--intermediate 12288]
"""

from __future__ import annotations

import argparse

import torch

from zipage.bench.common import COPY_BANDWIDTH_BYTES_PER_S
from zipage.bench.kernels import _graph_us
from zipage.kernels import fp8_linear

ONE_PASS_SETTING = 16384  # ONE_PASS_MAX_WIDTH for "once": rows of up to 16,384 elements


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,64,128,256")
    parser.add_argument("--hidden", type=int, default=4096, help="width of quantize_rows_fp8's rows")
    parser.add_argument("--intermediate", type=int, default=12288, help="width of silu_mul_quantize's output")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{'kernel':>18} {'rows':>5} {'twice':>10} {'once':>10} {'once/twice':>10}  share of copy (twice, once)")
    for m in rows:
        x = torch.randn(m, args.hidden, device="cuda", dtype=torch.bfloat16)
        gate_up = torch.randn(m, 2 * args.intermediate, device="cuda", dtype=torch.bfloat16)
        cases = [("quantize_rows_fp8", lambda: fp8_linear.quantize_rows_fp8(x), m * args.hidden * 3 + 4 * m),
                 ("silu_mul_quantize", lambda: fp8_linear.silu_mul_quantize(gate_up),
                  m * args.intermediate * 5 + 4 * m)]
        for name, fn, nbytes in cases:
            times, outputs, default = {}, {}, fp8_linear.ONE_PASS_MAX_WIDTH
            for setting in (0, ONE_PASS_SETTING):
                fp8_linear.ONE_PASS_MAX_WIDTH = setting
                outputs[setting] = fn()
                times[setting] = _graph_us(fn)
            fp8_linear.ONE_PASS_MAX_WIDTH = default
            (q_two, s_two), (q_one, s_one) = outputs[0], outputs[ONE_PASS_SETTING]
            same = torch.equal(s_two, s_one) and torch.equal(q_two.view(torch.uint8), q_one.view(torch.uint8))
            shares = [nbytes / (times[s] * 1e-6) / COPY_BANDWIDTH_BYTES_PER_S for s in (0, ONE_PASS_SETTING)]
            print(f"{name:>18} {m:>5} {times[0]:>7.2f} us {times[ONE_PASS_SETTING]:>7.2f} us "
                  f"{times[ONE_PASS_SETTING] / times[0]:>10.2f}  {shares[0]:.0%}, {shares[1]:.0%}"
                  f"{'' if same else '  OUTPUTS DIFFER'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
