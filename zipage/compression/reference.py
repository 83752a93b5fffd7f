"""Float64 reference of ``policy``: the spec's math written out with explicit loops.

Same signatures as ``zipage.compression.policy``; slow, for tests only. Every value is
computed in Python floats (float64) straight from the design page's definitions, one
request, layer, head, window query and token at a time. Outputs are float64 tensors
(indices int64).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

EPS = 1e-6


def _lists(x: Tensor | None):
    return None if x is None else x.detach().to("cpu", torch.float64).tolist()


def _ints(x: Tensor) -> list[int]:
    return [int(v) for v in x.detach().to("cpu").tolist()]


def _softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def attention_scores(queries: Tensor, keys: Tensor, lengths: Tensor, scale: float) -> Tensor:
    R, L, w, Hq, d = queries.shape
    H, n_max = keys.shape[2], keys.shape[3]
    G = Hq // H
    q, k, n_of = _lists(queries), _lists(keys), _ints(lengths)
    out = torch.zeros(R, L, H, n_max, dtype=torch.float64)
    for r in range(R):
        n = n_of[r]
        for l in range(L):
            for h in range(H):
                for i in range(w):
                    last = n - w + i  # window query i is token n - w + i; it sees j <= last
                    best = [0.0] * n_max
                    for g in range(G):
                        hq = h * G + g
                        assert hq // G == h
                        logits = [scale * sum(a * b for a, b in zip(q[r][l][i][hq], k[r][l][h][j]))
                                  for j in range(last + 1)]
                        for j, p in enumerate(_softmax(logits)):
                            best[j] = max(best[j], p)
                    for j in range(n):
                        out[r, l, h, j] += best[j] / w
    return out


def update_global_scores(attention: Tensor, previous: Tensor | None, num_previous: Tensor,
                         decay: float | None) -> Tensor:
    R, L, H, n_max = attention.shape
    a, prev, num = _lists(attention), _lists(previous), _ints(num_previous)
    out = torch.zeros(R, L, H, n_max, dtype=torch.float64)
    for r in range(R):
        for l in range(L):
            for h in range(H):
                for j in range(n_max):
                    value = a[r][l][h][j]
                    if decay is not None and prev is not None and j < num[r]:
                        value = max(value, decay * prev[r][l][h][j])
                    out[r, l, h, j] = value
    return out


def max_pool(scores: Tensor, lengths: Tensor, width: int) -> Tensor:
    R, L, H, n_max = scores.shape
    s, n_of = _lists(scores), _ints(lengths)
    half = width // 2
    out = torch.zeros(R, L, H, n_max, dtype=torch.float64)
    for r in range(R):
        n = n_of[r]
        for l in range(L):
            for h in range(H):
                for j in range(n):
                    out[r, l, h, j] = max(s[r][l][h][t] for t in range(j - half, j + half + 1) if 0 <= t < n)
    return out


def _cosine(x: list[float], y: list[float]) -> float:
    nx = max(math.sqrt(sum(v * v for v in x)), EPS)
    ny = max(math.sqrt(sum(v * v for v in y)), EPS)
    return sum(a * b for a, b in zip(x, y)) / (nx * ny)


def redundancy_sums(keys: Tensor, lengths: Tensor, threshold: float, block_size: int | None = None) -> Tensor:
    R, L, H, n_max, d = keys.shape
    k, n_of = _lists(keys), _ints(lengths)
    out = torch.zeros(R, L, H, n_max, dtype=torch.float64)
    for r in range(R):
        n = n_of[r]

        def partners(t: int) -> list[int]:
            if block_size is None:
                return [m for m in range(n) if m != t]
            return [m for m in range(n) if m != t and m // block_size == t // block_size]

        for l in range(L):
            for h in range(H):
                kk = k[r][l][h]
                s = [[_cosine(kk[a], kk[b]) for b in range(n)] for a in range(n)]
                latest = []  # m*(t)
                for t in range(n):
                    above = [m for m in partners(t) if s[t][m] > threshold]
                    latest.append(max(above) if above else None)
                for m in range(n):
                    total = sum(s[t][m] for t in partners(m))
                    total -= sum(s[t][m] for t in range(n) if latest[t] == m)
                    out[r, l, h, m] = total
    return out


def normalise_redundancy(rsum: Tensor, lengths: Tensor, temperature: float, divisor: float | None) -> Tensor:
    R, L, H, n_max = rsum.shape
    x, n_of = _lists(rsum), _ints(lengths)
    out = torch.zeros(R, L, H, n_max, dtype=torch.float64)
    for r in range(R):
        n = n_of[r]
        if n == 0:
            continue
        D = n if divisor is None else divisor
        for l in range(L):
            for h in range(H):
                for j, p in enumerate(_softmax([x[r][l][h][j] / (temperature * D) for j in range(n)])):
                    out[r, l, h, j] = p
    return out


def redundancy_scores(keys: Tensor, lengths: Tensor, threshold: float, temperature: float,
                      block_size: int | None = None) -> Tensor:
    rsum = redundancy_sums(keys, lengths, threshold, block_size)
    return normalise_redundancy(rsum, lengths, temperature, block_size)


def combine_scores(pooled: Tensor, redundancy: Tensor | None, attention_weight: float) -> Tensor:
    p, red = _lists(pooled), _lists(redundancy)
    R, L, H, n_max = pooled.shape
    out = torch.zeros(R, L, H, n_max, dtype=torch.float64)
    for r in range(R):
        for l in range(L):
            for h in range(H):
                for j in range(n_max):
                    value = p[r][l][h][j]
                    if red is not None:
                        value = attention_weight * value - (1 - attention_weight) * red[r][l][h][j]
                    out[r, l, h, j] = value
    return out


def protect(scores: Tensor, lengths: Tensor, window: int, sink) -> Tensor:
    """``sink``: one count for all requests, or a sequence of counts per request."""
    R, L, H, n_max = scores.shape
    s, n_of = _lists(scores), _ints(lengths)
    sink_of = [int(sink)] * R if isinstance(sink, int) else [int(x) for x in sink]
    lowest, highest = torch.finfo(torch.float32).min, torch.finfo(torch.float32).max
    out = torch.zeros(R, L, H, n_max, dtype=torch.float64)
    for r in range(R):
        n = n_of[r]
        for l in range(L):
            for h in range(H):
                for j in range(n_max):
                    if j >= n:
                        value = -math.inf
                    elif j >= n - window or j < min(sink_of[r], n):
                        value = math.inf
                    else:  # unprotected: clamped to the finite float32 range, NaN lowest
                        value = s[r][l][h][j]
                        value = lowest if math.isnan(value) else min(max(value, lowest), highest)
                    out[r, l, h, j] = value
    return out


def select_kept(scores: Tensor, keep: int) -> Tensor:
    R, L, H, n_max = scores.shape
    s = _lists(scores)
    out = torch.zeros(R, L, H, keep, dtype=torch.int64)
    for r in range(R):
        for l in range(L):
            for h in range(H):
                order = sorted(range(n_max), key=lambda j: (-s[r][l][h][j], j))
                out[r, l, h] = torch.tensor(sorted(order[:keep]), dtype=torch.int64)
    return out


def score_tokens(queries: Tensor, keys: Tensor, lengths: Tensor, previous: Tensor | None, num_previous: Tensor,
                 config, scale: float, keep: int, block_size: int, pool: bool, sinks=None) -> tuple[Tensor, Tensor]:
    indices, history, _ = score_tokens_with_scores(queries, keys, lengths, previous, num_previous, config, scale,
                                                   keep, block_size, pool, sinks)
    return indices, history


def position_scores(lengths: Tensor, num_layers: int, num_heads: int, n_max: int) -> Tensor:
    """Recency: token j scores j; padding 0."""
    out = torch.zeros(len(lengths), num_layers, num_heads, n_max, dtype=torch.float64)
    for r, n in enumerate(_ints(lengths)):
        for j in range(n):
            out[r, :, :, j] = float(j)
    return out


def score_tokens_with_scores(queries, keys, lengths, previous, num_previous, config, scale, keep, block_size, pool,
                             sinks=None):
    """``score_tokens`` plus the protected combined score S (float64), for tie-aware comparisons.

    ``config`` is a resolved ``CompressionConfig``; pooling applies when ``pool`` is true or the
    config pools at every compression. Policies: "zipage" and "attention" (whose resolved config
    has history and redundancy off) follow the pipeline; "recency" scores positions; "random" has
    no reference (its scores are random draws). ``sinks``: leading tokens kept per request
    (default ``config.attention_sink`` for all).
    """
    sink = config.attention_sink if sinks is None else sinks
    if config.policy == "random":
        raise ValueError("the random policy has no reference: its scores are random draws")
    if config.policy == "recency":
        R, L, H, n_max = keys.shape[:4]
        combined = protect(position_scores(lengths, L, H, n_max), lengths, config.window, sink)
        return select_kept(combined, keep), torch.zeros(R, L, H, n_max, dtype=torch.float64), combined
    attention = attention_scores(queries, keys, lengths, scale)
    history = update_global_scores(attention, previous, num_previous, config.global_score_decay)
    pooled = history
    if (pool or config.pool_every_compression) and config.pooling_width is not None:
        pooled = max_pool(history, lengths, config.pooling_width)
    redundancy = None
    if config.redundancy != "off":
        divisor = block_size if config.redundancy == "lightning" else None
        redundancy = redundancy_scores(keys, lengths, config.similarity_threshold, config.redundancy_temperature,
                                       divisor)
    combined = protect(combine_scores(pooled, redundancy, config.attention_weight), lengths, config.window, sink)
    return select_kept(combined, keep), history, combined
