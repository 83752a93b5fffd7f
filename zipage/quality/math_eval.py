"""``zipage eval math``: pass@1 and throughput of a real checkpoint on math problems.

Reads a local JSONL file (one problem per line: ``question`` or ``problem``, and
``answer``), applies the checkpoint's chat template with the system prompt of
``SYSTEM_PROMPT``, samples ``n`` completions per problem (seeds 0..n-1 per
problem), takes the last ``\\boxed{...}`` of each completion and checks it against
the answer with math-verify. pass@1 is the mean, over problems, of the share of
correct samples. Each mode (full KV, then Zipage at ``--kv-budget-tokens``) runs all
requests in one engine and reports output tokens per second.

    zipage eval math --model path/to/Qwen3-8B --data amc23.jsonl --n 32 --max-tokens 32768
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, or None.

    ``\\boxed 5`` (no braces) gives the next token, as some models write it.
    """
    best_at, best = -1, None
    for command in BOX_COMMANDS:
        at = text.rfind(command)
        while at >= 0:
            content = _braced(text, at + len(command))
            if content is not None:
                if at > best_at:
                    best_at, best = at, content
                break
            at = text.rfind(command, 0, at)
    return best


def _braced(text: str, i: int) -> str | None:
    rest = text[i:]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):  # "\boxed 5"
        token = rest.split()[0] if rest.split() else ""
        return token.rstrip(".$") or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for j, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:j]
    return None  # unbalanced: the completion was cut off


def normalise_gold(answer) -> str:
    """A dataset answer as a string without surrounding dollar signs."""
    text = str(answer).strip()
    while len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text[1:-1].strip()
    return text


def is_correct(completion: str, answer) -> bool:
    """Whether the completion's last boxed answer equals ``answer`` (math-verify: numbers,
    fractions, expressions and sets compared symbolically)."""
    from math_verify import parse, verify

    predicted = extract_boxed(completion)
    if predicted is None or not predicted.strip():
        return False
    gold = parse(f"\\boxed{{{normalise_gold(answer)}}}")
    target = parse(f"\\boxed{{{predicted}}}")
    if not gold or not target:
        return normalise_gold(answer) == predicted.strip()
    return bool(verify(gold, target))


def load_problems(path: str, limit: int | None = None) -> list[dict]:
    """``[{"question", "answer"}]`` from a JSONL file; a line without both is an error naming it."""
    problems = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            question = row.get("question", row.get("problem"))
            if question is None or "answer" not in row:
                raise ValueError(f"{path}:{number}: each line needs 'question' (or 'problem') and 'answer'")
            problems.append({"question": question, "answer": row["answer"]})
            if limit is not None and len(problems) >= limit:
                break
    if not problems:
        raise ValueError(f"{path} holds no problems")
    return problems


def pass_at_1(correct: list[list[bool]]) -> float:
    """Mean over problems of the share of correct samples."""
    return sum(sum(c) / len(c) for c in correct) / len(correct)


def run_math(model_dir: str, problems: list[dict], n: int, sampling: dict, modes: dict, engine: dict,
             log=print) -> dict:
    """Every mode ({name: CompressionConfig or None}) on every problem; the record of the run."""
    from zipage import LLM, SamplingParams

    runs = []
    for name, compression in modes.items():
        llm = LLM(model_dir, compression=compression, **engine)
        tokenizer = llm.tokenizer
        prompts, params = [], []
        for p in problems:
            chat = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": p["question"]}]
            ids = tokenizer.encode(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                                   add_special_tokens=False)
            for sample in range(n):
                prompts.append(ids)
                params.append(SamplingParams(seed=sample, **sampling))
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        correct = [[is_correct(outputs[i * n + s].outputs[0].text, p["answer"]) for s in range(n)]
                   for i, p in enumerate(problems)]
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        run = dict(mode=name, pass_at_1=pass_at_1(correct), seconds=round(elapsed, 1), generated_tokens=generated,
                   tokens_per_second=generated / elapsed,
                   mean_output_tokens=generated / len(outputs),
                   truncated=sum(o.outputs[0].finish_reason == "length" for o in outputs),
                   compressions=sum(o.metrics.num_compressions for o in outputs), correct=correct)
        runs.append(run)
        log(f"{name}: pass@1 {run['pass_at_1']:.3f}, {run['tokens_per_second']:.0f} output tokens/s "
            f"({generated} tokens in {elapsed:.0f} s)")
        del llm, outputs
        gc.collect()
    return dict(settings=dict(model=model_dir, problems=len(problems), n=n,
                              system_prompt=SYSTEM_PROMPT, sampling=sampling,
                              engine={k: v for k, v in engine.items()}),
                runs=runs)


def add_math_parser(kinds) -> None:
    from zipage.cli import add_trust_remote_code_arg

    m = kinds.add_parser("math", help="pass@1 and throughput on a JSONL of math problems")
    m.add_argument("--model", required=True, help="local HuggingFace checkpoint directory")
    m.add_argument("--data", required=True, help="JSONL with 'question' (or 'problem') and 'answer' per line")
    m.add_argument("--n", type=int, default=4, help="samples per problem")
    m.add_argument("--limit", type=int, default=None, help="first N problems only")
    m.add_argument("--max-tokens", type=int, default=32768)
    m.add_argument("--temperature", type=float, default=0.6)
    m.add_argument("--top-p", type=float, default=0.95)
    m.add_argument("--top-k", type=int, default=-1)
    m.add_argument("--modes", default="full,zipage", help="comma-separated: full, zipage, attention, ...")
    m.add_argument("--kv-budget-tokens", type=int, default=2048)
    m.add_argument("--keep-prompt", action="store_true", help="compression never evicts the prompt (up to half the budget)")
    m.add_argument("--device", default=None)
    m.add_argument("--dtype", default="auto")
    m.add_argument("--block-size", type=int, default=256)
    m.add_argument("--max-num-seqs", type=int, default=256)
    m.add_argument("--max-model-len", type=int, default=None)
    m.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    add_trust_remote_code_arg(m)
    m.add_argument("--out", default="results/quality")
    m.set_defaults(func=_run_math)


def _run_math(args: argparse.Namespace) -> int:
    from zipage.config import POLICIES, CompressionConfig

    modes = {}
    for name in [m for m in args.modes.split(",") if m]:
        if name != "full" and name not in POLICIES:
            raise ValueError(f"--modes takes 'full' and policies {POLICIES}, got {name!r}")
        modes[name] = None if name == "full" else CompressionConfig(kv_budget_tokens=args.kv_budget_tokens,
                                                                     policy=name, keep_prompt=args.keep_prompt)
    problems = load_problems(args.data, args.limit)
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens)
    engine = dict(device=args.device, dtype=args.dtype, block_size=args.block_size,
                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  gpu_memory_utilization=args.gpu_memory_utilization, trust_remote_code=args.trust_remote_code)
    record = run_math(args.model, problems, args.n, sampling, modes, engine)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "math.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print("\n| mode | pass@1 | output tokens/s | mean output tokens | truncated |\n| --- | --- | --- | --- | --- |")
    for run in record["runs"]:
        print(f"| {run['mode']} | {run['pass_at_1']:.3f} | {run['tokens_per_second']:.0f} | "
              f"{run['mean_output_tokens']:.0f} | {run['truncated']} |")
    print(f"\nwrote {path}")
    return 0
