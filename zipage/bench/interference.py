"""``zipage bench serve --background N``: long prompts arriving while N streams decode.

The N streams (random prompts of ``--input-len`` tokens, ``--output-len`` tokens each)
are sent at once; ``--long-start`` seconds later, once they decode, the long prompts
(``--long-prompts`` lengths, ``--long-repeats`` of each, in a seeded random order) arrive
as a Poisson process of ``--long-rate`` a second. Without chunked prefill each long prompt
is prefilled in a step of its own, during which every stream waits; with it, the prompt
is cut into chunks of ``--max-num-batched-tokens`` that run beside the streams' decodes.

Reported, through the HTTP API of a server started here (or ``--url``):

- the streams' inter-token latency (ITL) in the *window* from the first long prompt's
  arrival to the last one's first token (the gaps that can meet a prefill), and over the
  whole run; p50, p99, p99.9 and the largest gap;
- the streams' median ITL before the first long prompt arrives: the median decode step,
  the yardstick of the ``p99 <= 3x`` target;
- the long prompts' time to first token (TTFT), p50 and p99, and the largest;
- output tokens per second of the whole run;
- with the server started here, the engine's steps in the window: each interval between two
  steps' ends (the gap the streams' tokens see) by the kind of step that made it, and the
  longest intervals with what their steps held (tokens, decodes, compressions, host time,
  time waiting for the device), so a tail can be traced to its cause.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections import deque

import numpy as np

from zipage.bench.common import print_table, write_json
from zipage.bench.serving import _ms, _ms_value, itl_values, send_all_sync, serving_target


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--long-prompts must be comma-separated integers, got {text!r}") from None
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"--long-prompts must be positive integers, got {text!r}")
    return lengths


def gap_stats(gaps: np.ndarray) -> dict:
    """Mean, p50, p99, p99.9 and largest of inter-token gaps (seconds); None where there are none."""
    if not gaps.size:
        return {k: None for k in ("count", "mean", "p50", "p99", "p999", "max")}
    return {"count": int(gaps.size), "mean": float(gaps.mean()), "p50": float(np.percentile(gaps, 50)),
            "p99": float(np.percentile(gaps, 99)), "p999": float(np.percentile(gaps, 99.9)),
            "max": float(gaps.max())}


def window_gaps(results: list[dict], start: float, end: float) -> np.ndarray:
    """The streams' inter-token gaps whose chunk arrived within [start, end] (seconds from the run's
    start), each once per token the chunk brought."""
    parts = []
    for r in results:
        times = np.asarray(r["times"])
        inside = (times >= start) & (times <= end)
        parts.append(np.repeat(np.asarray(r["gaps"])[inside], np.asarray(r["counts"])[inside].astype(int)))
    return np.concatenate(parts) if parts else np.zeros(0)


def summarize(streams: list[dict], long: list[dict], long_arrivals, duration: float) -> dict:
    """The report of one run from the clients' results (see the module's docstring)."""
    done_streams = [r for r in streams if r["error"] is None]
    done_long = [r for r in long if r["error"] is None]
    first_arrival = float(min(long_arrivals))
    last_first_token = max((r["sent"] + r["ttft"] for r in done_long if r["ttft"] is not None),
                           default=first_arrival)
    before = window_gaps(done_streams, 0.0, first_arrival)
    window = window_gaps(done_streams, first_arrival, last_first_token)
    median_step = float(np.median(before)) if before.size else None
    stats = gap_stats(window)
    ttfts = np.asarray([r["ttft"] for r in done_long if r["ttft"] is not None], dtype=float)
    output_tokens = sum(r["output_tokens"] for r in done_streams + done_long)
    return {
        "streams": len(streams), "long_prompts": len(long),
        "failed": len(streams) - len(done_streams) + len(long) - len(done_long),
        "errors": sorted({str(r["error"]) for r in streams + long if r["error"]})[:5],
        "window_s": [first_arrival, last_first_token],
        "median_decode_step_s": median_step,
        "itl_window_s": stats, "itl_all_s": gap_stats(itl_values(done_streams)),
        "p99_over_median_step": (stats["p99"] / median_step if median_step and stats["p99"] is not None else None),
        "ttft_long_s": {"p50": float(np.percentile(ttfts, 50)) if ttfts.size else None,
                        "p99": float(np.percentile(ttfts, 99)) if ttfts.size else None,
                        "max": float(ttfts.max()) if ttfts.size else None},
        "duration_s": duration, "output_tokens_per_s": output_tokens / duration,
        "long_ttft_s": [[r["prompt_tokens"], r["ttft"]] for r in done_long],
    }


def control_report(control: list[dict], streams: list[dict], report: dict) -> dict:
    """The control run's numbers. Each stream's tokens that arrived within the window of the main
    run (their positions in the output) are looked up in the control run's same stream: their
    median gap there is the decode step at the same context lengths without the long prompts, and
    the window's p99 is set over it."""
    start, end = report["window_s"]
    parts = []
    for main, alone in zip(streams, control):
        if main["error"] is not None or alone["error"] is not None:
            continue
        times, counts = np.asarray(main["times"]), np.asarray(main["counts"]).astype(int)
        inside = np.flatnonzero((times >= start) & (times <= end))
        if not inside.size:
            continue
        ends = np.cumsum(counts)  # the output position reached by each chunk
        first, last = ends[inside[0]] - counts[inside[0]], ends[inside[-1]]
        alone_counts = np.asarray(alone["counts"]).astype(int)
        alone_ends = np.cumsum(alone_counts)
        chosen = (alone_ends > first) & (alone_ends <= last)
        parts.append(np.repeat(np.asarray(alone["gaps"])[chosen], alone_counts[chosen]))
    gaps = np.concatenate(parts) if parts else np.zeros(0)
    step = float(np.median(gaps)) if gaps.size else None
    p99 = report["itl_window_s"]["p99"]
    return {"control_failed": sum(r["error"] is not None for r in control), "control_decode_step_s": step,
            "p99_over_control_step": p99 / step if step and p99 is not None else None}


# steps the engine logs during a run (a step of 128 streams takes about 8 ms on an H200: 10 minutes)
STEP_LOG_STEPS = 100_000
LONGEST_STEPS = 12  # intervals listed in the report


def interval_kind(step, previous, async_scheduling: bool) -> str:
    """What made the interval ending with ``step``: a compression launched in it (its synchronous
    part over a millisecond), else prompt tokens. With asynchronous scheduling a call launches its
    step, then collects the one before: "chunk launched" (the host launching a step with a prompt
    chunk, eagerly, while the step before waits to be collected) or "chunk collected" (the device
    finishing it); without, "chunk". Otherwise "decode"."""
    if step.compression_s > 1e-3:
        return "compression"
    if not async_scheduling:
        return "chunk" if step.is_prefill else "decode"
    if step.is_prefill:
        return "chunk launched"
    return "chunk collected" if previous is not None and previous.is_prefill else "decode"


def step_report(steps: list, t0: float, window: tuple[float, float], median_step: float | None,
                async_scheduling: bool) -> dict:
    """The engine's steps whose ends fall in ``window`` (seconds from the clients' start ``t0``,
    on the same monotonic clock): intervals between consecutive ends by kind, and the longest."""
    start, end = t0 + window[0], t0 + window[1]
    rows, previous = [], None
    for step in steps:
        if previous is not None and start <= step.end <= end:
            rows.append({"at_s": step.end - t0, "interval_ms": 1000 * (step.end - previous.end),
                         "kind": interval_kind(step, previous, async_scheduling),
                         "tokens": step.num_tokens, "decodes": step.num_decodes,
                         "previous_tokens": previous.num_tokens, "compressed": step.num_compressed,
                         "compression_ms": 1000 * step.compression_s, "host_ms": 1000 * step.host_s,
                         "waited_ms": 1000 * step.waited_s, "call_ms": 1000 * (step.end - step.start),
                         "preempted": step.num_preempted})
        previous = step
    slow = 3 * median_step * 1000 if median_step else None
    kinds = {}
    for kind in sorted({r["kind"] for r in rows}):
        values = np.array([r["interval_ms"] for r in rows if r["kind"] == kind])
        kinds[kind] = {"steps": int(values.size), "p50_ms": float(np.percentile(values, 50)),
                       "p99_ms": float(np.percentile(values, 99)), "max_ms": float(values.max()),
                       "over_3x_step": int((values > slow).sum()) if slow else None}
    longest = sorted(rows, key=lambda r: -r["interval_ms"])[:LONGEST_STEPS]
    return {"steps": len(rows), "by_kind": kinds, "longest": sorted(longest, key=lambda r: r["at_s"]),
            "all": rows}


def _print_step_report(report: dict) -> None:
    print(f"engine steps in the window: {report['steps']}; intervals between their ends, by what made them:")
    print_table([{"kind": k, **{n: round(v, 2) if isinstance(v, float) else v for n, v in row.items()}}
                 for k, row in report["by_kind"].items()],
                ["kind", "steps", "p50_ms", "p99_ms", "max_ms", "over_3x_step"])
    print("the longest intervals:")
    columns = ["at_s", "interval_ms", "kind", "tokens", "decodes", "previous_tokens", "compressed",
               "compression_ms", "host_ms", "waited_ms", "call_ms", "preempted"]
    print_table([{k: f"{r[k]:.3f}" if k == "at_s" else round(r[k], 1) if isinstance(r[k], float) else r[k]
                  for k in columns} for r in report["longest"]], columns)


def _print_profile(profile: dict) -> None:
    if "error" in profile:
        print(f"the engine's kernels could not be recorded: {profile['error']}")
        return
    print(f"the engine's kernels over {profile['seconds']:.2f} s of the window ({profile['steps']} steps), per step:")
    if profile["kinds"]:
        print_table(profile["kinds"], list(profile["kinds"][0]))


def start_step_log(engine, maxlen: int) -> None:
    """Have the engine log its next ``maxlen`` steps' ``StepStats`` (run where the engine runs)."""
    engine.step_log = deque(maxlen=maxlen)


def take_step_log(engine) -> tuple[list, bool]:
    """The steps logged, and whether the engine schedules asynchronously; the log stops."""
    steps, engine.step_log = list(engine.step_log or ()), None
    return steps, engine.async_scheduling


def start_profile(engine) -> None:
    """Record the engine's kernels (``bench/profile.py``) from now on (run where the engine runs)."""
    import torch

    from zipage.bench.profile import StepProfiler

    profiler = StepProfiler(torch.device(engine.config.device))
    profiler.start()  # (its first start takes a while): the steps and time count from after it
    engine.bench_profile = (profiler, engine.stats.num_steps, time.perf_counter())


def stop_profile(engine) -> dict:
    """Stop ``start_profile``'s recording: the steps it spanned and their kernels by kind, per step."""
    from zipage.bench.profile import breakdown

    profiler, steps, start = engine.bench_profile
    wall, steps = time.perf_counter() - start, engine.stats.num_steps - steps  # before the events are read
    kernels = profiler.stop()
    del engine.bench_profile
    return {"seconds": wall, "steps": steps,
            "kinds": breakdown(kernels, steps, wall / steps) if steps else []}


def _profile_window(call_engine, at: float, seconds: float, result: dict) -> None:
    """Profile the engine for ``seconds`` from ``at`` (``time.perf_counter``), into ``result``."""
    time.sleep(max(0.0, at - time.perf_counter()))
    try:
        call_engine(start_profile)
        time.sleep(seconds)
        result.update(call_engine(stop_profile, timeout=120.0))
    except Exception as error:  # noqa: BLE001 - the run's own report stands without it
        result["error"] = str(error)


def run_interference_bench(args: argparse.Namespace) -> int:
    lengths = _lengths(args.long_prompts)
    for name in ("background", "long_repeats", "input_len", "output_len", "long_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("long_start", "long_rate"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if not args.profile_window >= 0:
        raise ValueError(f"--profile-window must be >= 0, got {args.profile_window}")
    if args.profile_window and args.url:
        raise ValueError("--profile-window is for a server started here, not --url")
    if args.url and args.switch_interval is not None:
        raise ValueError("--switch-interval is for a server started here, not --url")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = np.random.default_rng(args.workload_seed)
    settings = {k: getattr(args, k) for k in ("background", "input_len", "output_len", "long_prompts",
                                              "long_repeats", "long_start", "long_rate", "long_output_len",
                                              "workload_seed")}
    with serving_target(args, headers, settings) as (base_url, vocab_size, model, clients, server):
        def body(prompt, max_tokens):
            return dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                        stream=True, stream_options={"continuous_usage_stats": True})

        streams = [body(rng.integers(0, vocab_size, args.input_len).tolist(), args.output_len)
                   for _ in range(args.background)]
        long_lengths = rng.permutation(np.repeat(lengths, args.long_repeats)).tolist()
        long = [body(rng.integers(0, vocab_size, n).tolist(), args.long_output_len) for n in long_lengths]
        gaps = rng.exponential(1.0 / args.long_rate, len(long))
        long_at = args.long_start + np.cumsum(gaps) - gaps[0]
        arrivals = [0.0] * len(streams) + long_at.tolist()
        print(f"{len(streams)} streams of {args.input_len}+{args.output_len} tokens; long prompts of "
              f"{', '.join(map(str, long_lengths))} tokens from {args.long_start:g} s at {args.long_rate:g}/s",
              flush=True)
        profile, profiling = {}, None
        if server is not None:
            server.call_engine(start_step_log, STEP_LOG_STEPS)
        sent = clients.submit(send_all_sync, base_url, streams + long, arrivals, args.timeout, headers)
        if server is not None and args.profile_window:
            # From the first long prompt's arrival (as this process sees the clients' start).
            profiling = threading.Thread(target=_profile_window, daemon=True, args=(
                server.call_engine, time.perf_counter() + args.long_start, args.profile_window, profile))
            profiling.start()
        results, duration, _, t0 = sent.result()
        if profiling is not None:
            profiling.join()
        steps, async_scheduling = server.call_engine(take_step_log) if server is not None else (None, None)
        control = None
        if args.control:  # the same streams again, with no long prompt: their decode steps in the window
            print("the control run: the same streams without long prompts", flush=True)
            control = clients.submit(send_all_sync, base_url, streams, [0.0] * len(streams), args.timeout,
                                     headers).result()[0]
    report = summarize(results[:len(streams)], results[len(streams):], long_at, duration)
    if control is not None:
        report.update(control_report(control, results[:len(streams)], report))
    if steps is not None:
        report["engine_steps"] = step_report(steps, t0, report["window_s"], report["median_decode_step_s"],
                                             async_scheduling)
    w, t = report["itl_window_s"], report["ttft_long_s"]
    print_table([{"median step ms": _ms_value(report["median_decode_step_s"]), "ITL p50 ms": _ms_value(w["p50"]),
                  "ITL p99 ms": _ms_value(w["p99"]), "ITL p99.9 ms": _ms_value(w["p999"]),
                  "ITL max ms": _ms_value(w["max"]), "p99 / step": report["p99_over_median_step"],
                  "TTFT p50 ms": _ms_value(t["p50"]), "TTFT p99 ms": _ms_value(t["p99"]),
                  "tok/s": report["output_tokens_per_s"], "failed": report["failed"]}],
                ["median step ms", "ITL p50 ms", "ITL p99 ms", "ITL p99.9 ms", "ITL max ms", "p99 / step",
                 "TTFT p50 ms", "TTFT p99 ms", "tok/s", "failed"])
    print(f"streams' ITL over the whole run: p50 {_ms(report['itl_all_s']['p50'])}, "
          f"p99 {_ms(report['itl_all_s']['p99'])}, max {_ms(report['itl_all_s']['max'])}")
    if "control_decode_step_s" in report:
        ratio = report["p99_over_control_step"]
        print(f"control run (no long prompts): the streams' median step in the window "
              f"(the same output positions) {_ms(report['control_decode_step_s'])}; the window's p99 over it "
              f"{'-' if ratio is None else f'{ratio:.2f}'}")
    if steps is not None:
        _print_step_report(report["engine_steps"])
    if profile:
        report["profile"] = profile
        _print_profile(profile)
    result = {"benchmark": "serving-interference", "model": model, "settings": settings, **report}
    if args.out:
        write_json(os.path.join(args.out, "serving.json"), result)
    return 0 if report["failed"] == 0 and not report.get("control_failed") else 1
