"""The quality half of ``zipage demo``: the trained model solves held-out problems with
the full KV cache and under a fixed budget, and the runs are compared.

``compare(model_dir)`` runs full KV, Zipage with the published defaults and Zipage with
the settings tuned on this task (``TUNED``), each with a progress bar, prints a table
of accuracy, correct-prefix fraction and peak KV memory per request, and returns the
runs with, if asked, the check of a few full-KV outputs against ``transformers``'
``generate``; ``verdict`` says in one line what the runs show. ``zipage demo`` calls both.

The problems are the shortest of the trained range (36-38 steps, about 1,000 tokens
with the prompt) and few, so that the whole demo fits in two minutes on a 2-core CPU.
Output tokens/s are not reported: on a CPU a decode step of this small model costs about
the same whatever the KV size, and timings there vary with the machine's load; the GPU
throughput figures are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import gc
import os
import sys
import time

from zipage.quality import eval as qeval
from zipage.quality import tasks

DEMO_TASK = tasks.TaskSpec(min_steps=36, max_steps=38)
BLOCK_SIZE = 32
# Tuned on the ledger task only: on two other synthetic tasks these settings lose to the
# published defaults (docs/quality.md), so the demo shows both.
TUNED = dict(keep_prompt=True, pool_every_compression=True, window=BLOCK_SIZE)

TASK_LINES = (
    "Task: each problem gives five values, ten lookup rules and a step count; the model writes a chain of",
    "single-digit steps (each needs a rule from the statement and the results of the last three steps) and",
    "ends with a 3-digit answer. The model (13.8M parameters) was trained on this task only.",
)


def variants(budget_tokens: int) -> dict:
    """Run name -> ``CompressionConfig`` (None: full KV)."""
    from zipage import CompressionConfig
    return {
        "full KV": None,
        "Zipage, published defaults": CompressionConfig(kv_budget_tokens=budget_tokens),
        "Zipage, tuned for this task": CompressionConfig(kv_budget_tokens=budget_tokens, **TUNED),
    }


def demo_problems(model_dir: str, num_problems: int) -> list[qeval.Encoded]:
    from zipage.utils.loader import load_tokenizer
    return qeval.encode(load_tokenizer(model_dir), tasks.held_out_problems(num_problems, DEMO_TASK))


def compare(model_dir: str, num_problems: int = 4, budget_tokens: int = 448, device: str = "cpu",
            log=print, progress: bool = True, workers: int | None = None, check_problems: int = 0,
            check_tokens: int = 64) -> tuple[dict, tuple[int, int] | None]:
    """Every run of ``variants(budget_tokens)`` on the same problems: (name -> metrics, and
    (equal, compared) of the first ``check_tokens`` greedy tokens of the full-KV run against
    ``transformers_tokens`` on ``check_problems`` problems, or None).

    On the CPU the runs go to ``workers`` processes (default: two where the machine has two
    cores or more), each computing on one thread: a decode step of this small model costs
    about the same at any batch, so one thread per run and two runs side by side use two
    cores best."""
    encoded = demo_problems(model_dir, num_problems)
    mean_length = sum(e.length for e in encoded) / len(encoded)
    log(f"{num_problems} held-out problems of {DEMO_TASK.min_steps}-{DEMO_TASK.max_steps} steps, "
        f"{mean_length:,.0f} tokens on average (prompt and solution); KV budget {budget_tokens} tokens "
        f"per layer and KV head ({budget_tokens / mean_length:.0%} of that), blocks of {BLOCK_SIZE} tokens.")
    for line in TASK_LINES:
        log(line)
    log("")
    configs = variants(budget_tokens)
    check = encoded[:check_problems]
    if workers is None:
        workers = min(2, os.cpu_count() or 1) if device == "cpu" else 1
    if workers <= 1:
        runs = {name: run(model_dir, encoded, config, device, desc=name, progress=progress)
                for name, config in configs.items()}
        reference = transformers_tokens(model_dir, check, check_tokens, device) if check else None
    else:
        runs, reference = _run_in_processes(model_dir, encoded, configs, device, progress, workers,
                                            check, check_tokens)
    log("")
    log("| run | accuracy | correct prefix | peak KV per request |")
    log("| --- | ---: | ---: | ---: |")
    for name, r in runs.items():
        peak = r["peak_kv_bytes_mean"] / 2 ** 20
        log(f"| {name} | {r['accuracy']:.3f} | {r['prefix_fraction']:.3f} | {peak:.1f} MiB |")
    log("")
    log("accuracy: share of problems whose answer is exactly right. correct prefix: share of the reference")
    log("solution written token for token before the first wrong token (1.000: all of it). peak KV per request:")
    log(f"the most KV-cache memory one request held (float32); tuned: {_tuned_text()}.")
    if reference is None:
        return runs, None
    engine = [tokens[:check_tokens] for tokens in runs["full KV"]["token_ids"]]
    same = sum(ours == theirs[:len(ours)] for ours, theirs in zip(engine, reference))
    log(f"greedy tokens equal to transformers' generate: {same}/{len(reference)} "
        f"(first {check_tokens} tokens of {len(reference)} problems, full KV)")
    return runs, (same, len(reference))


def _run_in_processes(model_dir, encoded, configs: dict, device: str, progress: bool, workers: int,
                      check: list, check_tokens: int) -> tuple[dict, list | None]:
    """``run`` of every config, and ``transformers_tokens`` of ``check``, in ``workers`` spawned
    processes of one thread each, the bars kept apart by position and a shared lock. (Splitting a
    run's problems over the workers gains nothing: half the batch takes most of the time.)"""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    names = list(configs)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                             initargs=(context.RLock(),)) as pool:
        # bars at fixed rows on a terminal; elsewhere (a log) each bar writes its own lines
        row = (lambda k: k) if sys.stderr.isatty() else (lambda k: None)
        futures = [pool.submit(run, model_dir, encoded, configs[name], device, name, progress, row(k))
                   for k, name in enumerate(names)]
        # the short transformers check goes to whichever worker frees up first
        reference = pool.submit(transformers_tokens, model_dir, check, check_tokens, device) if check else None
        results = {name: future.result() for name, future in zip(names, futures)}
        reference = reference.result() if reference is not None else None
    if progress and sys.stderr.isatty():
        print("\n" * (len(names) - 1), end="", file=sys.stderr)  # below the bars
    return results, reference


def _init_worker(lock) -> None:
    import torch
    from tqdm.auto import tqdm

    torch.set_num_threads(1)
    tqdm.set_lock(lock)


def _tuned_text() -> str:
    return ", ".join(f"{k}={v}" for k, v in TUNED.items())


def run(model_dir: str, encoded: list[qeval.Encoded], compression, device: str = "cpu", desc: str = "",
        progress: bool = True, position: int | None = None) -> dict:
    """Greedy decoding of every problem in one engine with a progress bar of output tokens;
    the run's accuracy, correct-prefix fraction, peak KV bytes per request and seconds."""
    from tqdm.auto import tqdm

    from zipage import LLM, SamplingParams

    slack = 32  # tokens past the reference a wrong trace may write
    longest = max(e.length for e in encoded) + slack
    cache_bytes = (len(encoded) + 1) * (longest + BLOCK_SIZE) * qeval.kv_bytes_per_token(model_dir, device)
    llm = LLM(model_dir, device=device, dtype="auto", block_size=BLOCK_SIZE, compression=compression,
              max_num_seqs=len(encoded), kv_cache_memory_bytes=cache_bytes, max_model_len=longest + BLOCK_SIZE,
              seed=0)
    engine = llm.engine
    seqs = [engine.prepare_request(e.prompt_ids, SamplingParams(temperature=0.0,
                                                               max_tokens=len(e.reference_ids) + slack))
            for e in encoded]
    for seq in seqs:
        engine.add_sequence(seq)
    pending = {s.request_id for s in seqs}
    finished = {}
    bar = tqdm(total=sum(len(e.reference_ids) for e in encoded), desc=f"{desc:<28}", unit="tok",
               disable=not progress, dynamic_ncols=True, leave=True, position=position)
    start = time.perf_counter()
    try:
        while pending:
            outputs, stats = engine.step()
            for out in outputs:
                if out.request_id in pending:
                    pending.discard(out.request_id)
                    finished[out.request_id] = out
            if stats is not None and stats.num_decodes:
                bar.update(min(stats.num_decodes, bar.total - bar.n))
            elif stats is None and pending and not outputs:
                raise RuntimeError("the engine has unfinished requests but scheduled nothing")
    finally:
        for request_id in pending:
            engine.abort_request(request_id)
        bar.total = bar.n  # requests that stop early leave the bar short of the reference lengths
        bar.close()
    elapsed = time.perf_counter() - start
    outputs = [finished[s.request_id] for s in seqs]
    failed = [o for o in outputs if o.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0].error}")
    cache = engine.runner.kv_cache
    block_bytes = cache.block_bytes()
    peaks = [o.metrics.peak_blocks * block_bytes for o in outputs]
    result = qeval.score(encoded, outputs)
    result.update(seconds=elapsed, peak_kv_bytes_mean=sum(peaks) / len(peaks),
                  compressions=sum(o.metrics.num_compressions for o in outputs),
                  generated_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
                  token_ids=[list(o.outputs[0].token_ids) for o in outputs])
    del llm, engine, outputs, finished
    gc.collect()
    return result


def verdict(runs: dict) -> str:
    """One line: what the budget saved and what each run solved."""
    full = runs["full KV"]
    n = len(full["correct"])
    compressed = {name: r for name, r in runs.items() if r is not full}
    savings = sorted({round(100 * (1 - r["peak_kv_bytes_mean"] / full["peak_kv_bytes_mean"]))
                      for r in compressed.values()})
    saving = f"{savings[0]}%" if len(savings) == 1 else f"{savings[0]}-{savings[-1]}%"
    solved = ", ".join(f"{sum(r['correct'])}/{n} with the {name.removeprefix('Zipage, ')}"
                       .replace("with the tuned for this task", "tuned for this task")
                       for name, r in compressed.items())
    return (f"Verdict: with {saving} less KV memory per request, Zipage solved {solved} "
            f"(full KV: {sum(full['correct'])}/{n}); the tuned settings lose on other tasks (docs/quality.md).")


def transformers_tokens(model_dir: str, encoded: list[qeval.Encoded], max_tokens: int,
                        device: str = "cpu") -> list[list[int]]:
    """The first ``max_tokens`` greedy tokens of ``transformers``' own ``generate`` (float32,
    end of sequence ignored) for each problem, to compare with the engine's full-KV run."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    out = []
    for item in encoded:
        x = torch.tensor([item.prompt_ids], device=device)
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_tokens,
                               min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
        out.append(y[0, x.shape[1]:].tolist())
    return out
