"""``zipage eval synthetic``: accuracy of compression policies against the KV budget.

Held-out problems of a synthetic task (``zipage.quality.tasks``: the ledger, or
register tracing with ``--task tracing``) are solved greedily by the engine with the
full KV cache and then, for every policy and budget, under compression. Two metrics
per run:

- accuracy: the share of problems whose answer line is exactly right;
- correct-prefix fraction: the share of the reference solution (its tokens and the
  closing end-of-turn token) reproduced token for token before the first divergence,
  averaged over problems. It tells how far a policy gets before it breaks.

Budgets are given as fractions of the mean sequence length (prompt plus reference
solution) and rounded to whole blocks. Runs also record decode throughput, the
peak KV memory per request and a breakdown by solution length (thirds of the
problem set), which shows whether the budget a policy needs grows with length.
Results go to ``synthetic.json``, ``synthetic.md`` (the table) and ``synthetic.png``.

``--kv-cache-dtype fp8`` and ``--quantization fp8`` run every configuration with an FP8 KV
cache and/or FP8 weights (docs/fp8.md). Each such run is then compared with the same
configuration (policy, budget) run unquantized (``--dtype``: bf16 on a GPU), by greedy-token
agreement with that reference run (not with the reference solution):

- ``agreement_prefix``: the share of the reference run's tokens reproduced before the first
  divergence (as the correct-prefix fraction, against the reference run's output);
- ``token_agreement``: the share of positions whose token equals the reference run's at the
  same position, over all positions (the longer output's length; positions past the shorter
  output's end disagree), so that divergences that later re-converge still count.

Both are averaged over problems. The reference runs are made in the same invocation, or read
from ``--reference DIR`` (the ``tokens.json`` an unquantized run writes with ``--save-tokens``).

``--settings`` compares named Zipage settings (``SETTINGS``) instead of policies: the
published defaults, the statement kept, pooling at every compression, a window of one
block, or all three ("tuned", the settings tuned on the ledger task). Each setting runs
at each budget, and the table and summary name the setting that wins each budget on
each metric (several on a tie).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import asdict, dataclass

from zipage.quality import tasks

DEFAULT_BUDGETS = (0.125, 0.25, 0.375, 0.5, 0.75, 0.875)
DEFAULT_POLICIES = ("zipage", "attention", "recency", "random")
RECENCY_SINK = 4  # StreamingLLM's attention-sink tokens
KEEP_SHARE = 0.95  # "keeps its accuracy": at least this share of full-KV accuracy
METRICS = ("accuracy", "prefix_fraction")
# Zipage settings for --settings, as changes to the published defaults (statement compressed,
# pooling at a request's first compression only, the window of --window); "block": the block size.
SETTINGS = {
    "defaults": {},
    "keep_prompt": dict(keep_prompt=True),
    "pool": dict(pool_every_compression=True),
    "block_window": dict(window="block"),
    "tuned": dict(keep_prompt=True, pool_every_compression=True, window="block"),
    # How a prompt meets the budget (with --max-num-batched-tokens below the prompts' length): cached
    # whole and compressed at the first decode step, or compressed between its prefill chunks.
    "prompt_whole": dict(prefill_compression="off"),
    "prefill": dict(prefill_compression="always"),
}


@dataclass
class Encoded:
    problem: tasks.Problem
    prompt_ids: list[int]
    reference_ids: list[int]  # the solution and the end-of-turn token

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.reference_ids)


def encode(tokenizer, problems: list[tasks.Problem]) -> list[Encoded]:
    """Prompts through the checkpoint's chat template; references as the model should write them."""
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    out = []
    for p in problems:
        text = tokenizer.apply_chat_template(tasks.messages(p), tokenize=False, add_generation_prompt=True)
        out.append(Encoded(p, tokenizer.encode(text, add_special_tokens=False),
                           tokenizer.encode(p.solution, add_special_tokens=False) + [eos]))
    return out


def correct_prefix(generated: list[int], reference: list[int]) -> int:
    """Leading tokens of ``reference`` that ``generated`` reproduces exactly."""
    n = 0
    for a, b in zip(generated, reference):
        if a != b:
            break
        n += 1
    return n


def token_agreement(generated: list[int], reference: list[int]) -> tuple[float, float]:
    """(agreement_prefix, token_agreement) of ``generated`` against a reference run's tokens
    (see the module doc); (1, 1) when both are empty."""
    longest = max(len(generated), len(reference))
    if longest == 0:
        return 1.0, 1.0
    same = sum(a == b for a, b in zip(generated, reference))
    return correct_prefix(generated, reference) / max(1, len(reference)), same / longest


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """Mean agreement_prefix and token_agreement of a run's outputs against a reference run's."""
    if len(tokens) != len(reference):
        raise ValueError(f"the reference run has {len(reference)} outputs, this run {len(tokens)}")
    pairs = [token_agreement(g, r) for g, r in zip(tokens, reference)]
    n = max(1, len(pairs))
    return dict(agreement_prefix=sum(p for p, _ in pairs) / n, token_agreement=sum(t for _, t in pairs) / n)


def score(encoded: list[Encoded], outputs) -> dict:
    """Accuracy and mean correct-prefix fraction of one run, with per-problem values."""
    correct, prefix = [], []
    for item, out in zip(encoded, outputs):
        completion = out.outputs[0]
        correct.append(tasks.extract_answer(completion.text) == item.problem.answer)
        prefix.append(correct_prefix(list(completion.token_ids), item.reference_ids) / len(item.reference_ids))
    n = max(1, len(correct))
    return dict(accuracy=sum(correct) / n, prefix_fraction=sum(prefix) / n, correct=correct, prefix=prefix)


def kv_bytes_per_token(model_dir: str, device: str, dtype: str = "auto") -> int:
    """K and V of one token over all layers, in the dtype the engine runs (float32 on the CPU
    or when asked for, else two bytes: the checkpoints of this harness are bf16)."""
    import torch

    from zipage.config import DTYPES
    from zipage.utils.loader import load_config
    c = load_config(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    element = 4 if device == "cpu" or DTYPES.get(dtype) is torch.float32 else 2
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * element


def run_engine(model_dir: str, encoded: list[Encoded], compression=None, device: str | None = None,
               block_size: int = 32, dtype: str = "auto", max_num_seqs: int | None = None,
               kv_cache_memory_bytes: int | None = None, slack_tokens: int = 32, **engine_options) -> dict:
    """Greedy decoding of every problem in one engine; metrics of the run. ``engine_options`` go to
    ``LLM`` (e.g. ``enforce_eager``)."""
    import torch

    from zipage import LLM, SamplingParams
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    longest = max(e.length for e in encoded) + slack_tokens
    if kv_cache_memory_bytes is None:  # room for every request at full length, so the runs compare alike
        kv_cache_memory_bytes = ((len(encoded) + 1) * (longest + block_size)
                                 * kv_bytes_per_token(model_dir, device, dtype))
    llm = LLM(model_dir, device=device, dtype=dtype, block_size=block_size, compression=compression,
              max_num_seqs=max_num_seqs or len(encoded), kv_cache_memory_bytes=kv_cache_memory_bytes,
              max_model_len=min(longest + block_size, _model_limit(model_dir)), seed=0, **engine_options)
    params = [SamplingParams(temperature=0.0, max_tokens=len(e.reference_ids) + slack_tokens) for e in encoded]
    start = time.perf_counter()
    outputs = llm.generate([e.prompt_ids for e in encoded], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    cache = llm.engine.runner.kv_cache
    block_bytes = cache.block_bytes()
    peaks = [o.metrics.peak_blocks * block_bytes for o in outputs]
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = score(encoded, outputs)
    result["token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
    result.update(seconds=round(elapsed, 2), generated_tokens=generated, tokens_per_second=generated / elapsed,
                  peak_kv_bytes_mean=sum(peaks) / len(peaks), peak_kv_bytes_max=max(peaks),
                  compressions=sum(o.metrics.num_compressions for o in outputs))
    del llm, outputs
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def _model_limit(model_dir: str) -> int:
    from zipage.utils.loader import load_config
    return getattr(load_config(model_dir), "max_position_embeddings", None) or 4096


def evaluate_full_kv(model_dir: str, problems: list[tasks.Problem], device: str | None = None,
                     block_size: int = 32) -> dict:
    """Full-KV greedy accuracy and correct-prefix fraction on ``problems`` (no per-problem lists)."""
    from zipage.utils.loader import load_tokenizer
    encoded = encode(load_tokenizer(model_dir), problems)
    result = run_engine(model_dir, encoded, device=device, block_size=block_size)
    return {k: v for k, v in result.items() if k not in ("correct", "prefix", "token_ids")}


def budget_tokens(fraction: float, mean_length: float, block_size: int, window: int) -> int:
    """``fraction`` of the mean length, rounded to whole blocks, at least one block and the window."""
    blocks = max(1, round(fraction * mean_length / block_size))
    while blocks * block_size < window + RECENCY_SINK:
        blocks += 1
    return blocks * block_size


def by_length(encoded: list[Encoded], values: list[float], parts: int = 3) -> list[dict]:
    """Mean of ``values`` over thirds of the problems ordered by length."""
    order = sorted(range(len(encoded)), key=lambda i: encoded[i].length)
    out = []
    for k in range(parts):
        chosen = order[k * len(order) // parts:(k + 1) * len(order) // parts]
        if chosen:
            out.append(dict(min_tokens=encoded[chosen[0]].length, max_tokens=encoded[chosen[-1]].length,
                            mean=sum(values[i] for i in chosen) / len(chosen)))
    return out


def setting_options(name: str, window: int, block_size: int) -> dict:
    """The ``CompressionConfig`` fields that setting ``name`` of ``SETTINGS`` fixes."""
    if name not in SETTINGS:
        raise ValueError(f"unknown setting {name!r}; choose from {sorted(SETTINGS)}")
    options = {**dict(keep_prompt=False, pool_every_compression=False, window=window), **SETTINGS[name]}
    if options["window"] == "block":
        options["window"] = block_size
    return options


def run_synthetic(model_dir: str, num_problems: int = 200, budgets=DEFAULT_BUDGETS, policies=None,
                  task: str | tasks.AnySpec = "standard", start: int = 0, device: str | None = None,
                  block_size: int = 32, window: int = 16, dtype: str = "auto", max_num_seqs: int | None = None,
                  kv_cache_memory_bytes: int | None = None, log=print, keep_prompt: bool = False,
                  pool_every_compression: bool = False, on_run=None, settings=None, kv_cache_dtype: str = "auto",
                  quantization: str | None = None, reference: dict | None = None,
                  keep_tokens: bool = False, max_num_batched_tokens: int | None = None) -> dict:
    """Full KV, then every (policy, budget); returns the record written to ``synthetic.json``.
    ``policies`` defaults to ``DEFAULT_POLICIES``.
    ``keep_prompt``: every policy keeps the problem statement (``CompressionConfig.keep_prompt``);
    ``pool_every_compression``: Zipage max-pools its scores at every compression, not only the first.
    ``settings`` (names of ``SETTINGS``): compare these Zipage settings instead of policies, every
    (setting, budget); each setting fixes keep_prompt, pooling and window itself, so it excludes
    ``policies``, ``keep_prompt`` and ``pool_every_compression``.
    ``on_run(record)`` is called with the partial record after every run (to save progress).
    ``kv_cache_dtype`` / ``quantization``: run with an FP8 KV cache and/or FP8 weights, and score
    each run's greedy-token agreement with the unquantized run of the same configuration, taken
    from ``reference`` ({run key: token ids per problem}, ``tokens.json``) or run here.
    ``keep_tokens``: the record's ``tokens`` holds every run's token ids by run key.
    ``max_num_batched_tokens``: the engines' token budget per step, so the prompt chunk (chunked prefill)."""
    from zipage import CompressionConfig
    from zipage.utils.loader import load_tokenizer

    if settings is not None and (policies is not None or keep_prompt or pool_every_compression):
        raise ValueError("settings fix the policy (zipage), keep_prompt and pooling: give settings alone, "
                         f"got settings={settings}, policies={policies}, keep_prompt={keep_prompt}, "
                         f"pool_every_compression={pool_every_compression}")
    if settings is None:  # one variant per policy, under the shared flags
        variants = {name: (dict(policy=name), dict(window=window, keep_prompt=keep_prompt, policy=name,
                                                   attention_sink=RECENCY_SINK if name == "recency" else 0,
                                                   pool_every_compression=pool_every_compression))
                    for name in (policies or DEFAULT_POLICIES)}
        # (attention-only pools at every compression anyway; recency and random do not pool)
    else:
        variants = {name: (dict(policy="zipage", setting=name), setting_options(name, window, block_size))
                    for name in settings}
    widest = max(options["window"] for _, options in variants.values())

    encoded = encode(load_tokenizer(model_dir), tasks.held_out_problems(num_problems, task, start))
    mean_length = sum(e.length for e in encoded) / len(encoded)
    common = dict(device=device, block_size=block_size, dtype=dtype, max_num_seqs=max_num_seqs,
                  kv_cache_memory_bytes=kv_cache_memory_bytes)
    if max_num_batched_tokens is not None:
        common["max_num_batched_tokens"] = max_num_batched_tokens
    quantized = kv_cache_dtype != "auto" or quantization is not None
    run_tokens: dict[str, list[list[int]]] = {}  # run key -> token ids per problem

    def run(key: str, compression=None) -> dict:
        """One run at this invocation's precision; with FP8, its agreement with the unquantized run."""
        result = run_engine(model_dir, encoded, compression=compression, kv_cache_dtype=kv_cache_dtype,
                            quantization=quantization, **common)
        run_tokens[key] = result["token_ids"]
        if quantized:
            ref = (reference or {}).get(key)
            if ref is None:
                ref = run_engine(model_dir, encoded, compression=compression, **common)["token_ids"]
            result.update(agreement(result["token_ids"], ref))
        return result

    full = run("full")
    log(f"full KV: accuracy {full['accuracy']:.3f}, correct prefix {full['prefix_fraction']:.3f} "
        f"({full['tokens_per_second']:.0f} tokens/s)" + _agreement_text(full))
    runs = [dict(policy="full", budget_tokens=None, budget_fraction=1.0, **_summary(full, encoded))]
    record_settings = dict(model=model_dir, num_problems=num_problems,
                           task=task if isinstance(task, str) else asdict(task), family=tasks.family(task),
                           start=start, held_out_seed=tasks.HELD_OUT_SEED, block_size=block_size, window=window,
                           recency_sink=RECENCY_SINK, keep_prompt=keep_prompt,
                           pool_every_compression=pool_every_compression, mean_length=mean_length,
                           min_length=min(e.length for e in encoded), max_length=max(e.length for e in encoded),
                           device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                           max_num_batched_tokens=max_num_batched_tokens)
    if settings is not None:
        record_settings["compared"] = {name: options for name, (_, options) in variants.items()}
    for fraction in budgets:
        tokens = budget_tokens(fraction, mean_length, block_size, widest)
        for name, (fields, options) in variants.items():
            config = CompressionConfig(kv_budget_tokens=tokens, **options)
            result = run(run_key(name, tokens), config)
            runs.append(dict(fields, budget_tokens=tokens, budget_fraction=tokens / mean_length,
                             requested_fraction=fraction, **_summary(result, encoded)))
            log(f"{name:>12} budget {tokens:>5} ({tokens / mean_length:.3f}): accuracy {result['accuracy']:.3f}, "
                f"correct prefix {result['prefix_fraction']:.3f}" + _agreement_text(result))
            if on_run is not None:
                on_run(dict(settings=record_settings, runs=runs, summary=summarise(runs)))
    record = dict(settings=record_settings, runs=runs, summary=summarise(runs))
    if keep_tokens:
        record["tokens"] = run_tokens
    return record


def run_key(name: str, budget_tokens: int | None) -> str:
    """A run's key in ``tokens.json``: "full", or the policy (setting) and its budget in tokens."""
    return "full" if budget_tokens is None else f"{name}@{budget_tokens}"


def _agreement_text(result: dict) -> str:
    if "token_agreement" not in result:
        return ""
    return (f", agreement with unquantized: prefix {result['agreement_prefix']:.3f}, "
            f"tokens {result['token_agreement']:.3f}")


def _summary(result: dict, encoded: list[Encoded]) -> dict:
    keys = ("accuracy", "prefix_fraction", "tokens_per_second", "peak_kv_bytes_mean", "peak_kv_bytes_max",
            "compressions", "seconds", "generated_tokens")
    out = {k: result[k] for k in keys}
    out.update({k: result[k] for k in ("agreement_prefix", "token_agreement") if k in result})
    out["accuracy_by_length"] = by_length(encoded, [float(c) for c in result["correct"]])
    out["prefix_by_length"] = by_length(encoded, result["prefix"])
    out["correct"] = result["correct"]
    return out


def summarise(runs: list[dict]) -> dict:
    """Smallest budget from which on Zipage keeps 95% of full-KV accuracy; whether it beats every
    baseline at each budget, on each metric. For a comparison of settings: ``summarise_settings``."""
    if any("setting" in r for r in runs):
        return summarise_settings(runs)
    full = next(r for r in runs if r["policy"] == "full")
    zipage = sorted((r for r in runs if r["policy"] == "zipage"), key=lambda r: r["budget_fraction"])
    keeps = []  # the budgets from which on (this one and every larger one) Zipage keeps its accuracy
    for r in reversed(zipage):
        if not r["accuracy"] >= KEEP_SHARE * full["accuracy"] > 0:  # nothing to keep if full KV fails
            break
        keeps.insert(0, r)
    beats = {}
    for r in zipage:
        rivals = [o for o in runs
                  if o["budget_tokens"] == r["budget_tokens"] and o["policy"] not in ("zipage", "full")]
        beats[str(r["budget_tokens"])] = {
            metric: all(r[metric] > o[metric] for o in rivals) for metric in ("accuracy", "prefix_fraction")}
    return dict(full_accuracy=full["accuracy"], full_prefix_fraction=full["prefix_fraction"],
                zipage_keeps_95_from_fraction=keeps[0]["budget_fraction"] if keeps else None,
                zipage_keeps_95_from_tokens=keeps[0]["budget_tokens"] if keeps else None,
                zipage_beats_baselines=beats)


def summarise_settings(runs: list[dict]) -> dict:
    """For each budget and metric, the settings that score highest (several on a tie), and how
    often each setting is among them."""
    full = next(r for r in runs if r["policy"] == "full")
    best, wins = {}, {}
    for tokens in sorted({r["budget_tokens"] for r in runs if "setting" in r}):
        row = [r for r in runs if r["budget_tokens"] == tokens]
        best[str(tokens)] = {metric: [r["setting"] for r in row if r[metric] == max(o[metric] for o in row)]
                             for metric in METRICS}
        for metric in METRICS:
            for name in best[str(tokens)][metric]:
                wins.setdefault(name, dict.fromkeys(METRICS, 0))[metric] += 1
    return dict(full_accuracy=full["accuracy"], full_prefix_fraction=full["prefix_fraction"],
                best_settings=best, wins=wins)


def table(record: dict) -> str:
    """Markdown: one row per budget, accuracy and correct-prefix fraction per policy (or per setting)."""
    if "compared" in record["settings"]:
        return settings_table(record)
    runs = record["runs"]
    policies = [p for p in DEFAULT_POLICIES if any(r["policy"] == p for r in runs)]
    policies += sorted({r["policy"] for r in runs} - set(policies) - {"full"})
    full = next(r for r in runs if r["policy"] == "full")
    head = "| budget (tokens) | fraction | " + " | ".join(f"{p} acc / prefix" for p in policies) + " |"
    lines = [head, "|" + " --- |" * (2 + len(policies))]
    for tokens in sorted({r["budget_tokens"] for r in runs if r["budget_tokens"] is not None}):
        row = {r["policy"]: r for r in runs if r["budget_tokens"] == tokens}
        fraction = next(iter(row.values()))["budget_fraction"]
        cells = [_cell(row[p]) if p in row else "-" for p in policies]
        lines.append(f"| {tokens} | {fraction:.3f} | " + " | ".join(cells) + " |")
    lines.append("| full KV | 1 | " + " | ".join([_cell(full)] * len(policies)) + " |")
    s = record["summary"]
    keep = s["zipage_keeps_95_from_fraction"]
    if "token_agreement" in full:
        settings = record["settings"]
        lines[0] = lines[0].replace("acc / prefix |", "acc / prefix / agreement |")
        lines += ["", f"Agreement: greedy-token agreement with the unquantized run of the same configuration (share "
                      f"of positions), kv_cache_dtype={settings.get('kv_cache_dtype')}, "
                      f"quantization={settings.get('quantization')}."]
    lines.append("")
    lines.append("Smallest budget at which Zipage keeps 95% of full-KV accuracy: "
                 + (f"{s['zipage_keeps_95_from_tokens']} tokens ({keep:.3f} of the mean sequence)."
                    if keep is not None else "none of the budgets tried."))
    return "\n".join(lines)


def _cell(run: dict) -> str:
    cell = f"{run['accuracy']:.3f} / {run['prefix_fraction']:.3f}"
    return cell + (f" / {run['token_agreement']:.3f}" if "token_agreement" in run else "")


def settings_table(record: dict) -> str:
    """Markdown for a comparison of settings: one row per budget, accuracy and correct-prefix
    fraction per setting and the winners of each metric; then what each setting is."""
    runs, compared = record["runs"], record["settings"]["compared"]
    full = next(r for r in runs if r["policy"] == "full")
    best = record["summary"]["best_settings"]
    head = ("| budget (tokens) | fraction | " + " | ".join(f"{name} acc / prefix" for name in compared)
            + " | best accuracy | best prefix |")
    lines = [head, "|" + " --- |" * (4 + len(compared))]
    for tokens in sorted({r["budget_tokens"] for r in runs if r["budget_tokens"] is not None}):
        row = {r["setting"]: r for r in runs if r["budget_tokens"] == tokens}
        fraction = next(iter(row.values()))["budget_fraction"]
        cells = [f"{row[n]['accuracy']:.3f} / {row[n]['prefix_fraction']:.3f}" if n in row else "-" for n in compared]
        winners = [", ".join(best[str(tokens)][metric]) for metric in METRICS]
        lines.append(f"| {tokens} | {fraction:.3f} | " + " | ".join(cells + winners) + " |")
    full_cell = f"{full['accuracy']:.3f} / {full['prefix_fraction']:.3f}"
    lines.append("| full KV | 1 | " + " | ".join([full_cell] * len(compared)) + " | | |")
    lines.append("")
    for name, options in compared.items():
        lines.append(f"- {name}: window {options['window']}, statement "
                     + ("kept" if options["keep_prompt"] else "compressed") + ", pooling "
                     + ("at every compression" if options["pool_every_compression"] else "at the first compression"))
    won = {name: record["summary"]["wins"].get(name, dict.fromkeys(METRICS, 0)) for name in compared}
    lines.append("")
    lines.append("Budgets won, ties counting for each: " + "; ".join(
        f"{name} {w['accuracy']} on accuracy, {w['prefix_fraction']} on correct prefix"
        for name, w in won.items()) + ".")
    return "\n".join(lines)


def _label(run: dict) -> str:
    return f"zipage, {run['setting']}" if "setting" in run else run["policy"]


def plot(record: dict, path: str) -> bool:
    """Accuracy and correct-prefix fraction against budget fraction, one line per policy."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = record["runs"]
    full = next(r for r in runs if r["policy"] == "full")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, label in zip(axes, ("accuracy", "prefix_fraction"), ("exact-answer accuracy",
                                                                       "correct-prefix fraction")):
        for name in sorted({_label(r) for r in runs} - {"full"}, key=lambda p: (p != "zipage", p)):
            points = sorted((r["budget_fraction"], r[metric]) for r in runs if _label(r) == name)
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name,
                    linewidth=2.5 if name == "zipage" else 1.5)
        ax.axhline(full[metric], color="black", linestyle="--", linewidth=1, label="full KV")
        ax.set_xlabel("KV budget / mean sequence length")
        ax.set_ylabel(label)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    settings = record["settings"]
    fig.suptitle(f"{settings['num_problems']} held-out {settings.get('family', 'ledger')} problems, "
                 f"mean {settings['mean_length']:.0f} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(record: dict, out_dir: str, plot_too: bool = True) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "synthetic.json"), "w") as f:
        json.dump({k: v for k, v in record.items() if k != "tokens"}, f, indent=1)
    with open(os.path.join(out_dir, "synthetic.md"), "w") as f:
        f.write(table(record) + "\n")
    if "tokens" in record:
        with open(os.path.join(out_dir, "tokens.json"), "w") as f:
            json.dump(record["tokens"], f)
    if plot_too:
        plot(record, os.path.join(out_dir, "synthetic.png"))


# -- command line -----------------------------------------------------------------
def add_eval_parser(sub) -> None:
    from zipage.quality import math_eval

    p = sub.add_parser("eval", help="quality evaluation: synthetic (trained model) or math (real checkpoints)")
    kinds = p.add_subparsers(dest="eval_kind", required=True)
    s = kinds.add_parser("synthetic", help="accuracy of eviction policies against the KV budget")
    s.add_argument("--model", required=True, help="checkpoint trained on the synthetic task")
    s.add_argument("--num-problems", type=int, default=200)
    s.add_argument("--budgets", default=",".join(str(b) for b in DEFAULT_BUDGETS),
                   help="fractions of the mean sequence length, comma-separated")
    s.add_argument("--policies", default=None,
                   help=f"comma-separated, from {','.join(DEFAULT_POLICIES)} (default: all)")
    s.add_argument("--settings", default=None,
                   help=f"compare Zipage settings instead of policies: comma-separated, from {','.join(SETTINGS)} "
                        "(tuned: the statement kept, pooling at every compression, a window of one block)")
    s.add_argument("--task", default="standard", choices=sorted(tasks.SPECS),
                   help="task variant: the ledger (standard, short, tiny) or register tracing (tracing, ...)")
    s.add_argument("--start", type=int, default=0, help="first held-out problem index")
    s.add_argument("--block-size", type=int, default=32)
    s.add_argument("--window", type=int, default=16)
    s.add_argument("--device", default=None)
    s.add_argument("--dtype", default="auto")
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step, so the prompts' chunk size (with --settings prompt_whole,prefill: "
                        "below the prompts' length, so that prompts are prefilled in several chunks)")
    s.add_argument("--keep-prompt", action="store_true",
                   help="every policy keeps the problem statement (the prompt, up to half the budget)")
    s.add_argument("--pool-every-compression", action="store_true",
                   help="Zipage max-pools its scores at every compression (published: only at the first)")
    s.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: keys and values in float8 (docs/fp8.md); runs are compared with unquantized ones")
    s.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: float8 weights (docs/fp8.md); runs are compared with unquantized ones")
    s.add_argument("--save-tokens", action="store_true",
                   help="write every run's greedy tokens to tokens.json (the reference of a later FP8 run)")
    s.add_argument("--reference", default=None,
                   help="directory of an unquantized run made with --save-tokens and the same problems, budgets and "
                        "policies: its tokens.json is the reference of --kv-cache-dtype / --quantization runs "
                        "(default: run the reference here, which doubles the runs)")
    s.add_argument("--out", default="results/quality")
    s.set_defaults(func=_run_synthetic)
    math_eval.add_math_parser(kinds)


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [name for name in text.split(",") if name]


def _run_synthetic(args: argparse.Namespace) -> int:
    budgets = [float(b) for b in args.budgets.split(",") if b]
    policies, settings = _names(args.policies), _names(args.settings)
    from zipage.config import POLICIES
    unknown = [p for p in policies or () if p not in POLICIES]
    if unknown or policies == [] or not budgets or any(not 0 < b <= 1 for b in budgets):
        raise ValueError(f"--policies must be among {POLICIES} (got {unknown}) and --budgets fractions in (0, 1]")
    unknown = [name for name in settings or () if name not in SETTINGS]
    if unknown or settings == []:
        raise ValueError(f"--settings must be among {list(SETTINGS)}, got {args.settings!r}")
    if settings is not None and (policies is not None or args.keep_prompt or args.pool_every_compression):
        raise ValueError("--settings runs Zipage with each setting's own statement and pooling choices: "
                         "leave out --policies, --keep-prompt and --pool-every-compression")
    reference = None
    if args.reference is not None:
        with open(os.path.join(args.reference, "tokens.json")) as f:
            reference = json.load(f)
    record = run_synthetic(args.model, args.num_problems, budgets, policies, args.task, args.start, args.device,
                           args.block_size, args.window, args.dtype, args.max_num_seqs, args.kv_cache_memory_bytes,
                           keep_prompt=args.keep_prompt, pool_every_compression=args.pool_every_compression,
                           settings=settings, on_run=lambda partial: write(partial, args.out, plot_too=False),
                           kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, reference=reference,
                           keep_tokens=args.save_tokens, max_num_batched_tokens=args.max_num_batched_tokens)
    write(record, args.out)
    print("\n" + table(record))
    print(f"\nwrote synthetic.json, synthetic.md and synthetic.png{' and tokens.json' if args.save_tokens else ''} "
          f"to {args.out}")
    return 0
