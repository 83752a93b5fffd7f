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
