"""The ``zipage`` command line: generate, demo, bench, serve, eval, train-synthetic."""

from __future__ import annotations

import argparse
import json
import sys


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    g.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    g.add_argument("--block-size", type=int, default=256)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--piecewise-graph-tokens", type=int, default=None, metavar="N",
                   help="steps with prompt tokens (prefill, or decodes beside prompt chunks) of at most N tokens "
                        "replay their layers' non-attention parts as CUDA graphs (0: such steps run eagerly; "
                        "default: 2048 on one GPU, else 0)")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before scheduling the next one")
    g.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt whole, in a step of its own (the default splits prompts into "
                        "chunks of at most --max-num-batched-tokens, run beside the decoding requests)")
    g.add_argument("--prefill-attention-span", type=_attention_span, default=0, metavar="SPAN|model",
                   help="a prompt chunk of n tokens after p cached ones costs n * (1 + (p + n/2) / SPAN) of "
                        "--max-num-batched-tokens, so that chunks deep into long prompts get fewer tokens "
                        "('model': the span from the model's FLOPs; default 0: a chunk costs its tokens)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--logprobs-mode", default="raw", choices=["raw", "processed"],
                   help="log probabilities of the model's logits (raw) or of the distribution sampled from "
                        "(processed: after penalties, temperature, top-k/top-p/min-p)")
    g.add_argument("--structured-outputs-disable-any-whitespace", action="store_true",
                   help="JSON schemas of structured output allow no whitespace but one space after ',' and ':' "
                        "(a model then cannot spend its tokens on whitespace)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="fp8: store keys and values as float8 e4m3 with a scale per token and KV head")
    g.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantize the linear layers' weights to float8 e4m3 at load (a published FP8 "
                        "checkpoint is detected without this)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model's heads and weights over this many GPUs (processes)")
    g.add_argument("--all-reduce", default="nccl", choices=["nccl", "one-shot"],
                   help="how tensor-parallel GPUs sum their partial outputs: NCCL, or one-shot (each GPU "
                        "reads its peers' rows over NVLink, fused with the norm after it)")
    add_trust_remote_code_arg(g)
    c = parser.add_argument_group("compression (off unless --kv-budget-tokens is given)")
    c.add_argument("--kv-budget-tokens", type=int, default=None,
                   help="compress: keep this many tokens per layer and KV head (multiple of --block-size)")
    c.add_argument("--compression-window", type=int, default=16)
    c.add_argument("--redundancy", default="lightning", choices=["lightning", "raw", "off"])
    c.add_argument("--keep-prompt", action="store_true",
                   help="never evict a request's prompt tokens (up to half the budget)")
    c.add_argument("--prefill-compression", default="long", choices=["long", "always", "off"],
                   help="compress a prompt between its chunks: only one too long to be cached whole (long), "
                        "every prompt that reaches the budget (always: a request then never holds more than "
                        "its budget plus one chunk), or never (off: prompts are cached whole)")


def add_trust_remote_code_arg(parser) -> None:
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run Python code shipped in the model directory (its auto_map), if it needs any; "
                             "without this such a model is refused")


def _attention_span(text: str) -> int | None:
    if text == "model":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 'model' or an integer >= 0, got {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict:
    from zipage.config import CompressionConfig
    compression = None
    if args.kv_budget_tokens is not None:
        compression = CompressionConfig(kv_budget_tokens=args.kv_budget_tokens, window=args.compression_window,
                                        redundancy=args.redundancy, keep_prompt=args.keep_prompt,
                                        prefill_compression=getattr(args, "prefill_compression", "long"))
    return dict(compression=compression, device=args.device, dtype=args.dtype, block_size=args.block_size,
                gpu_memory_utilization=args.gpu_memory_utilization,
                kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                enable_prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager,
                piecewise_graph_tokens=getattr(args, "piecewise_graph_tokens", None),
                async_scheduling=not args.no_async_scheduling,
                enable_chunked_prefill=not getattr(args, "no_chunked_prefill", False),
                prefill_attention_span=getattr(args, "prefill_attention_span", 0), seed=args.seed,
                load_format=args.load_format,
                tensor_parallel_size=args.tensor_parallel_size, all_reduce=getattr(args, "all_reduce", "nccl"),
                logprobs_mode=args.logprobs_mode,
                structured_outputs_disable_any_whitespace=args.structured_outputs_disable_any_whitespace,
                kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                trust_remote_code=getattr(args, "trust_remote_code", False))


def _generate(args: argparse.Namespace) -> int:
    from zipage import LLM

    with LLM(args.model, **engine_kwargs(args)) as llm:
        _print_outputs(llm, args)
    return 0


def _print_outputs(llm, args: argparse.Namespace) -> None:
    from zipage import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, max_tokens=args.max_tokens, seed=args.sample_seed,
                            stop=args.stop or None, ignore_eos=args.ignore_eos)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for out in outputs:
        c, m = out.outputs[0], out.metrics
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason, "metrics": output_metrics(out)}))
        else:
            compressed = (f", {m.num_compressions} compressions, {m.evicted_tokens} tokens evicted"
                          if m.num_compressions else "")
            print(f"--- prompt: {out.prompt!r}\n{c.text}\n[{len(c.token_ids)} tokens, {c.finish_reason}{compressed}]")


def output_metrics(out) -> dict:
    """One request's counters for ``generate --json``: its compressions and what they evicted (tokens
    per layer and KV head), the most KV blocks it held, prefix-cache hits, preemptions and timings."""
    m = out.metrics
    return dict(prompt_tokens=len(out.prompt_token_ids), num_compressions=m.num_compressions,
                evicted_tokens=m.evicted_tokens, peak_blocks=m.peak_blocks,
                num_cached_prompt_tokens=m.num_cached_prompt_tokens, num_preemptions=m.num_preemptions,
                time_to_first_token_s=m.time_to_first_token, decode_time_s=m.decode_time)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zipage", description="Zipage: LLM inference with compressed PagedAttention (a fixed KV budget "
                                   "per request) on local HuggingFace checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text from prompts with a local checkpoint")
    gen.add_argument("--model", required=True, help="local HuggingFace checkpoint directory")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true",
                     help="one JSON object per output: text, token ids, finish reason and metrics (compressions, "
                          "evicted tokens, peak KV blocks, cached prompt tokens, preemptions, timings)")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    from zipage.bench.cli import add_bench_parser
    from zipage.demo import add_demo_parser
    from zipage.server.cli import add_serve_parser
    add_demo_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    from zipage.batch import add_batch_parser
    add_batch_parser(sub)
    from zipage.quality.eval import add_eval_parser
    from zipage.quality.train import add_train_parser
    add_eval_parser(sub)
    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"zipage: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
