"""Seeded synthetic reasoning workloads: prompt lengths and long-tailed output lengths.

Output lengths follow a log-normal law clipped to a cap, the shape of reasoning
traces (most answers are moderate, a few run to the limit). Prompts are random
token ids (the benchmarks measure speed, not quality).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# name -> (mean output tokens, cap)
WORKLOADS = {
    "reasoning-8k": (8192, 16384),  # like Qwen3-8B on AMC 23
    "reasoning-16k": (16384, 32768),  # like AIME
}
PROMPT_RANGE = (128, 1024)
SIGMA = 0.7  # spread of log(output length)


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


def output_lengths(name: str, count: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    mean, cap = WORKLOADS[name]
    mu = math.log(mean * scale) - SIGMA ** 2 / 2  # a log-normal with this mean before clipping
    lengths = rng.lognormal(mu, SIGMA, count)
    return np.clip(np.round(lengths), max(1, int(16 * scale)), int(cap * scale)).astype(int)


def make_workload(name: str, num_prompts: int, samples_per_prompt: int, vocab_size: int, seed: int,
                  scale: float = 1.0) -> list[Request]:
    """``num_prompts`` random prompts, each sampled ``samples_per_prompt`` times."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    rng = np.random.default_rng(seed)
    low, high = (max(1, int(x * scale)) for x in PROMPT_RANGE)
    requests = []
    for _ in range(num_prompts):
        prompt = rng.integers(0, vocab_size, int(rng.integers(low, high + 1))).tolist()
        for length in output_lengths(name, samples_per_prompt, rng, scale):
            requests.append(Request(prompt, int(length)))
    return requests


def mean_request_tokens(name: str, scale: float = 1.0) -> float:
    """Expected prompt + output tokens of one request (for sizing a run)."""
    rng = np.random.default_rng(0)
    return float(sum(x * scale for x in PROMPT_RANGE) / 2 + output_lengths(name, 100_000, rng, scale).mean())


def peak_kv_demand(requests: list[Request]) -> int:
    """The most KV tokens the requests would hold at once if all were admitted together and each
    freed its cache on finishing: max over t of the sum, over requests still running at decode
    step t, of prompt + t. Between two finishes the sum grows, so the peak is just before one."""
    outputs = np.array([r.max_tokens for r in requests])
    prompts = np.array([len(r.prompt) for r in requests])
    steps = np.unique(outputs) - 1
    alive = outputs[None, :] > steps[:, None]  # [steps, requests]
    demand = (alive * (prompts[None, :] + steps[:, None])).sum(axis=1)
    return int(demand.max())


def requests_for_demand(name: str, target_tokens: int, vocab_size: int, seed: int, scale: float = 1.0,
                        samples_per_prompt: int = 1) -> list[Request]:
    """The shortest seeded workload whose peak KV demand reaches ``target_tokens``."""
    count = max(1, math.ceil(target_tokens / mean_request_tokens(name, scale)))
    while True:
        requests = make_workload(name, math.ceil(count / samples_per_prompt), samples_per_prompt, vocab_size,
                                 seed, scale)
        if peak_kv_demand(requests) >= target_tokens:
            # Workloads are prefixes of longer ones (same seed), so trim to the first that reaches it.
            lo, hi = 1, len(requests)
            while lo < hi:
                mid = (lo + hi) // 2
                if peak_kv_demand(requests[:mid]) >= target_tokens:
                    hi = mid
                else:
                    lo = mid + 1
            return requests[:lo]
        count *= 2

