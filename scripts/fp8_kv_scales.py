"""FP8 KV cache: per-token-per-head dynamic scales against a static scale per (layer, KV head).

Records the post-RoPE queries, keys and values of every attention layer while the engine
prefills held-out problems (statement and reference solution) of a trained checkpoint, then
measures, per layer, the relative error of the causal attention output when the keys and
values are stored as float8 e4m3 (dequantized exactly as the kernels do) with

* dynamic scales: amax over head_dim / 448 for every token and KV head (what the engine does);
* a static scale per (layer, KV head): amax of the first problem's prefill / 448, applied to
  every later problem (values beyond it saturate at +-448);

both against the unquantized float64 attention. It also prints the bytes per token of each,
and, with --generate N, the greedy accuracy of N problems with kv_cache_dtype "auto" and "fp8".

    python scripts/fp8_kv_scales.py --model checkpoints/tracing-14m --problems 8 --generate 8
"""

from __future__ import annotations

import argparse
import json
import time

import torch

FP8_MAX = 448.0


def attention(q, k, v, scale):
    """Causal GQA attention in float64: q [n, Hq, d], k / v [n, H, d] -> [n, Hq, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    n = q.shape[0]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def fp8_round_trip(x, scale):
    """x [n, H, d] stored as float8 with ``scale`` (broadcast against [n, H, 1]) and read back."""
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.double() * scale.double()


def dynamic(x):
    return fp8_round_trip(x, x.float().abs().amax(-1, keepdim=True).clamp_min(1e-8) / FP8_MAX)


def record(model_dir, encoded, block_size=32):
    """{layer: [(q, k, v) per problem]} from one prefill of statement + solution per problem."""
    from zipage import LLM, SamplingParams

    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=block_size, enforce_eager=True,
              max_model_len=max(e.length for e in encoded) + block_size, enable_prefix_caching=False)
    captured: dict[int, list] = {}
    hooks = []
    for index, layer in enumerate(llm.engine.runner.model.attention_layers()):
        def hook(module, args, index=index):
            q, k, v = args
            if q.shape[0] > 1:  # the prefill
                captured.setdefault(index, []).append((q.detach().double(), k.detach().double(),
                                                       v.detach().double()))
        hooks.append(layer.register_forward_pre_hook(hook))
    scale = llm.engine.runner.spec.head_dim ** -0.5
    for e in encoded:  # one at a time: a prefill of one sequence per step
        llm.generate([e.prompt_ids + e.reference_ids[:-1]], SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False)
    for h in hooks:
        h.remove()
    return captured, scale


def measure(captured, scale):
    rows = []
    for layer, items in sorted(captured.items()):
        _, k0, v0 = items[0]  # calibration: the first problem's prefill
        k_static = k0.float().abs().amax(dim=(0, 2)).clamp_min(1e-8)[None, :, None] / FP8_MAX
        v_static = v0.float().abs().amax(dim=(0, 2)).clamp_min(1e-8)[None, :, None] / FP8_MAX
        err = {"dynamic": [0.0, 0.0], "static": [0.0, 0.0]}
        saturated, total = 0, 0
        for q, k, v in items[1:]:
            ref = attention(q, k, v, scale)
            for name, (kq, vq) in {"dynamic": (dynamic(k), dynamic(v)),
                                   "static": (fp8_round_trip(k, k_static), fp8_round_trip(v, v_static))}.items():
                out = attention(q, kq, vq, scale)
                err[name][0] += (out - ref).norm().item() ** 2
                err[name][1] += ref.norm().item() ** 2
            saturated += int((k.float().abs() > k_static * FP8_MAX).sum()
                             + (v.float().abs() > v_static * FP8_MAX).sum())
            total += 2 * k.numel()
        rows.append(dict(layer=layer,
                         dynamic=(err["dynamic"][0] / err["dynamic"][1]) ** 0.5,
                         static=(err["static"][0] / err["static"][1]) ** 0.5,
                         saturated=saturated / max(total, 1)))
    return rows


def generate(model_dir, encoded, kv_cache_dtype):
    from zipage.quality import eval as qeval
    start = time.perf_counter()
    result = qeval.run_engine(model_dir, encoded, device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype)
    return dict(accuracy=result["accuracy"], prefix_fraction=result["prefix_fraction"],
                seconds=round(time.perf_counter() - start, 1), tokens=result["prefix"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/tracing-14m")
    p.add_argument("--task", default="tracing")
    p.add_argument("--problems", type=int, default=8, help="prefills recorded (the first calibrates; 0: none)")
    p.add_argument("--generate", type=int, default=0, help="problems decoded greedily with auto and fp8 KV")
    p.add_argument("--start", type=int, default=0, help="first held-out problem")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from zipage.quality import eval as qeval
    from zipage.quality import tasks
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    encoded = qeval.encode(tokenizer, tasks.held_out_problems(max(args.problems, args.generate), args.task,
                                                               start=args.start))
    record_out = {}
    if args.problems >= 2:
        record_out.update(measure_and_print(args, encoded))
    if args.generate:
        for dtype in ("auto", "fp8"):
            result = generate(args.model, encoded[:args.generate], dtype)
            record_out[dtype] = {k: v for k, v in result.items() if k != "outputs"}
            print(f"greedy, kv_cache_dtype={dtype}: {result['accuracy']:.3f} exact, correct-prefix fraction "
                  f"{result['prefix_fraction']:.3f} ({result['seconds']} s)")
        agree = [a == b for a, b in zip(record_out["auto"].pop("tokens"), record_out["fp8"].pop("tokens"))]
        print(f"problems with the same correct prefix under both: {sum(agree)}/{len(agree)}")
    print(json.dumps(record_out))


def measure_and_print(args, encoded) -> dict:
    captured, scale = record(args.model, encoded[:args.problems])
    rows = measure(captured, scale)
    spec = captured[0][0][1].shape  # [n, H, d]
    head_dim = spec[2]
    print(f"{args.model}: {args.problems} prefills of {min(e.length for e in encoded[:args.problems])}-"
          f"{max(e.length for e in encoded[:args.problems])} tokens, head_dim {head_dim}; "
          "relative error of the attention output (float64 reference), float8 e4m3 keys and values")
    print(f"{'layer':>5} {'dynamic':>10} {'static':>10} {'saturated (static)':>19}")
    for r in rows:
        print(f"{r['layer']:>5} {r['dynamic']:>10.4f} {r['static']:>10.4f} {r['saturated']:>19.2e}")
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("dynamic", "static")}
    print(f"{'mean':>5} {mean['dynamic']:>10.4f} {mean['static']:>10.4f}")
    print(f"bytes per token and KV head (K and V): bf16 {4 * head_dim}, fp8 dynamic {2 * head_dim + 8} "
          f"(+{400 / head_dim:.2f}% for the scales), fp8 static {2 * head_dim}")
    return dict(rows=rows, mean=mean)


if __name__ == "__main__":
    main()
