"""Which cached tokens a compression keeps: the scoring pipeline as pure tensor functions.

Every function takes batched, padded tensors (R requests, L layers of one layer group,
H KV heads, n_max token positions; positions ``j >= lengths[r]`` are padding), works
in float32 whatever the input dtype, and returns new tensors. Padding never influences
a valid position (even NaN garbage in padded keys or scores), and nothing produces NaN.
The semantics are those of the design page, section 3 (attention score, global score,
pooling, redundancy, combination, protection and top-k selection). The baselines of
``CompressionConfig.policy`` reuse them ("attention": the same pipeline with history and
redundancy off) or replace the score ("recency", "random": ``position_scores``,
``random_scores``).

These functions are the engine's CPU path and the reference the GPU kernels are tested
against. The big intermediates (attention logits, similarity matrices) are computed in
chunks of (request, layer, head) rows so that scratch memory stays bounded: one chunk's
main buffer holds at most ``SCRATCH_ELEMENTS`` float32 values (its masks and temporaries
add up to twice as much again). Small inputs fit in one chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

EPS = 1e-6  # floor of a key's norm in the cosine similarity
SCRATCH_ELEMENTS = 1 << 27  # float32 elements of one chunk's main scratch buffer (512 MiB)
_F32 = torch.float32
_LOWEST = torch.finfo(_F32).min
_HIGHEST = torch.finfo(_F32).max


def _chunks(num_rows: int, elements_per_row: int):
    """Row ranges ``(start, stop)`` whose scratch stays within ``SCRATCH_ELEMENTS``."""
    step = max(1, SCRATCH_ELEMENTS // max(1, elements_per_row))
    for start in range(0, num_rows, step):
        yield start, min(num_rows, start + step)


def _row_lengths(lengths: Tensor, num_requests: int, rows_per_request: int, device) -> Tensor:
    """Each request's length repeated for its (layer, head) rows: int64 [R * rows]."""
    lengths = lengths.to(device=device, dtype=torch.int64)
    return lengths[:, None].expand(num_requests, rows_per_request).reshape(-1)


def _valid(lengths: Tensor, n_max: int, device) -> Tensor:
    """bool [R, 1, 1, n_max]: True at the real (non-padding) token positions."""
    lengths = lengths.to(device=device, dtype=torch.int64)
    return (torch.arange(n_max, device=device) < lengths[:, None]).view(-1, 1, 1, n_max)


def _softmax_(x: Tensor) -> Tensor:
    """In-place softmax over the last axis where -inf marks excluded entries; all-excluded rows give 0."""
    top = x.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    x.sub_(top).exp_()
    # The largest entry contributes exp(0) = 1, so a row with any entry sums to >= 1.
    return x.div_(x.sum(-1, keepdim=True).clamp_min_(1.0))


def attention_scores(queries: Tensor, keys: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """Attention of the observation window on every cached token.

    queries [R, L, w, Hq, d]: row i is the query of token ``lengths[r] - w + i``.
    keys [R, L, H, n_max, d]. Returns float32 [R, L, H, n_max]: per KV head, the mean over
    the w window queries of the max over the head's G = Hq / H query heads (query head
    ``h * G + g``) of the causal softmax ``p_j`` (row i sees ``j <= lengths[r] - w + i``).
    Padding: 0.
    """
    R, L, w, Hq, d = queries.shape
    H, n = keys.shape[2], keys.shape[3]
    G = Hq // H
    rows = R * L * H
    device = keys.device
    out = torch.empty(rows, n, dtype=_F32, device=device)
    if rows == 0 or n == 0:
        return out.view(R, L, H, n)
    q = queries.reshape(R, L, w, H, G, d).permute(0, 1, 3, 2, 4, 5).reshape(rows, w * G, d)
    k = keys.reshape(rows, n, d)
    row_len = _row_lengths(lengths, R, L * H, device)
    j = torch.arange(n, device=device)
    i = torch.arange(w, device=device)
    for start, stop in _chunks(rows, w * G * n):
        logits = torch.bmm(q[start:stop].to(_F32), k[start:stop].to(_F32).transpose(1, 2))
        logits = logits.mul_(scale).view(stop - start, w, G, n)
        last_seen = row_len[start:stop, None] - w + i  # [c, w]
        hidden = j > last_seen[..., None]  # [c, w, n]: later window tokens and padding
        logits.masked_fill_(hidden[:, :, None, :], float("-inf"))
        out[start:stop] = _softmax_(logits).amax(2).mean(1)
    return out.view(R, L, H, n)


def update_global_scores(attention: Tensor, previous: Tensor | None, num_previous: Tensor,
                         decay: float | None) -> Tensor:
    """History score: ``max(A, decay * previous)`` for ``j < num_previous[r]``, else A.

    ``decay`` None (history off) or ``previous`` None (no request compressed before) gives
    A. Values of ``previous`` at ``j >= num_previous[r]`` are never read.
    """
    a = attention.to(_F32)
    if decay is None or previous is None:
        return a.clone()
    R, L, H, n = a.shape
    survived = _valid(num_previous, n, a.device)
    return torch.where(survived, torch.maximum(a, previous.to(_F32) * decay), a)


def max_pool(scores: Tensor, lengths: Tensor, width: int) -> Tensor:
    """Max-pool along the tokens: odd ``width``, stride 1, "same" size; positions outside
    ``[0, lengths[r])`` never win. Padding: 0."""
    R, L, H, n = scores.shape
    valid = _valid(lengths, n, scores.device)
    x = scores.to(_F32).masked_fill(~valid, float("-inf"))
    if width > 1 and n > 0:  # max_pool1d pads with -inf
        x = F.max_pool1d(x.view(-1, 1, n), width, stride=1, padding=width // 2).view(R, L, H, n)
    return x.masked_fill_(~valid, 0.0)


def redundancy_sums(keys: Tensor, lengths: Tensor, threshold: float, block_size: int | None = None) -> Tensor:
    """rsum [R, L, H, n_max] float32 from the keys' cosine similarities (R-KV).

    Partners of a token: every other valid token (``block_size`` None, "raw") or the other
    valid tokens of its block ``[t*b, (t+1)*b)`` ("lightning"). For every token n, m*(n) is
    its most recent partner with similarity > ``threshold``; rsum(m) is the sum over m's
    partners n of s(n, m), leaving out s(n, m) for each n with m*(n) == m. Padding: 0.
    """
    R, L, H, n, d = keys.shape
    rows = R * L * H
    device = keys.device
    out = torch.zeros(rows, n, dtype=_F32, device=device)
    if rows == 0 or n == 0:
        return out.view(R, L, H, n)
    b = n if block_size is None else int(block_size)
    num_blocks = -(-n // b)
    padded = num_blocks * b
    k = keys.reshape(rows, n, d)
    row_len = _row_lengths(lengths, R, L * H, device)
    position = torch.arange(padded, device=device).view(num_blocks, b)
    index = torch.arange(b, device=device, dtype=torch.int16 if b < 32767 else torch.int32)
    not_self = ~torch.eye(b, dtype=torch.bool, device=device)
    for start, stop in _chunks(rows, padded * b):
        c = stop - start
        unit = F.normalize(k[start:stop].to(_F32), dim=-1, eps=EPS)  # k / max(||k||, eps)
        if padded > n:
            unit = F.pad(unit, (0, 0, 0, padded - n))
        unit = unit.view(c, num_blocks, b, d)
        sim = unit @ unit.transpose(-1, -2)  # [c, nb, b(n), b(m)]
        valid = position < row_len[start:stop, None, None]  # [c, nb, b]
        considered = valid[..., :, None] & valid[..., None, :] & not_self
        # m*(n): the largest partner index above the threshold, -1 when there is none.
        latest = ((considered & (sim > threshold)) * (index + 1)).amax(-1) - 1  # [c, nb, b(n)]
        dropped = ~considered | (index == latest[..., None])
        rsum = sim.masked_fill_(dropped, 0.0).sum(-2)  # column m: sum over n
        out[start:stop] = rsum.view(c, padded)[:, :n]
    return out.view(R, L, H, n)


def normalise_redundancy(rsum: Tensor, lengths: Tensor, temperature: float, divisor: float | None) -> Tensor:
    """Softmax over the valid tokens of ``rsum / (temperature * D)``; D = ``divisor`` (lightning:
    the block size) or, when None, each request's length (raw). Padding: 0."""
    R, L, H, n = rsum.shape
    device = rsum.device
    valid = _valid(lengths, n, device)
    if divisor is None:
        scale = lengths.to(device=device, dtype=_F32).clamp_min(1.0).view(R, 1, 1, 1) * temperature
    else:
        scale = float(temperature) * float(divisor)
    x = (rsum.to(_F32) / scale).masked_fill_(~valid, float("-inf"))
    return _softmax_(x)


def redundancy_scores(keys: Tensor, lengths: Tensor, threshold: float, temperature: float,
                      block_size: int | None = None) -> Tensor:
    """Redundancy R [R, L, H, n_max]: softmax of rsum / (temperature * D), D = block_size
    (lightning) or the request's length (raw, ``block_size`` None). Padding: 0."""
    rsum = redundancy_sums(keys, lengths, threshold, block_size)
    return normalise_redundancy(rsum, lengths, temperature, block_size)


def combine_scores(pooled: Tensor, redundancy: Tensor | None, attention_weight: float) -> Tensor:
    """S = lambda * P - (1 - lambda) * R; with redundancy off (None), S = P."""
    if redundancy is None:
        return pooled.to(_F32, copy=True)
    return attention_weight * pooled.to(_F32) - (1.0 - attention_weight) * redundancy.to(_F32)


def protect(scores: Tensor, lengths: Tensor, window: int, sink: int | Tensor) -> Tensor:
    """+inf for the last ``window`` tokens and the first ``sink`` tokens, -inf at padding.

    ``sink`` is one count for every request or an int64 tensor [R] of counts per request
    (``CompressionConfig.keep_prompt`` protects each request's own prompt).

    Other valid scores are clamped to the finite float32 range (NaN to the lowest), so a
    protected token always outranks an unprotected one and padding never outranks either.
    """
    R, L, H, n = scores.shape
    device = scores.device
    lengths = lengths.to(device=device, dtype=torch.int64).view(R, 1, 1, 1)
    j = torch.arange(n, device=device)
    out = torch.nan_to_num(scores.to(_F32), nan=_LOWEST, posinf=_HIGHEST, neginf=_LOWEST)
    if isinstance(sink, Tensor):
        sink = sink.to(device=device, dtype=torch.int64).view(R, 1, 1, 1)
    out.masked_fill_((j >= lengths - window) | (j < sink), float("inf"))
    return out.masked_fill_(j >= lengths, float("-inf"))


def select_kept(scores: Tensor, keep: int) -> Tensor:
    """Indices of the ``keep`` largest scores per (request, layer, head), ascending: int64 [R, L, H, keep].

    Ties go to the older token (a stable sort), so the choice is reproducible on any
    device; pooling makes exact ties common.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :keep]
    return order.sort(dim=-1).values


def choose_tokens(attention: Tensor, redundancy: Tensor | None, lengths: Tensor, previous: Tensor | None,
                  num_previous: Tensor, config, keep: int, pool, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Steps 2, 3, 5, 6 and 7 of the pipeline, from the attention and redundancy scores.

    Returns (kept indices int64 [R, L, H, keep], ascending; global score G float32
    [R, L, H, n_max]). G is the history score before pooling, the value stored with each
    token. ``pool`` is a bool, or a bool tensor [R] to pool some requests only (a
    tensor is used as it is, without reading it back from the device). ``sinks`` (int64 [R]):
    leading tokens kept per request; default ``config.attention_sink`` for all.
    """
    history = update_global_scores(attention, previous, num_previous, config.global_score_decay)
    pooled = history
    if config.pooling_width is not None and config.pooling_width > 1 and pool is not False:
        pooled = max_pool(history, lengths, config.pooling_width)
        if isinstance(pool, Tensor):
            pooled = torch.where(pool[:, None, None, None], pooled, history)
    combined = protect(combine_scores(pooled, redundancy, config.attention_weight), lengths, config.window,
                       config.attention_sink if sinks is None else sinks)
    return select_kept(combined, keep), history


# -- baselines that need no attention (CompressionConfig.policy "recency" and "random") --------
def position_scores(lengths: Tensor, num_layers: int, num_heads: int, n_max: int) -> Tensor:
    """Recency (StreamingLLM-like): token j scores j, so the newest tokens are kept.
    float32 [R, L, H, n_max]; padding 0. Every layer and head keeps the same tokens."""
    device = lengths.device
    j = torch.arange(n_max, device=device, dtype=_F32)
    scores = torch.where(j[None, :] < lengths[:, None].to(device=device, dtype=_F32), j[None, :], 0.0)
    return scores[:, None, None, :].expand(len(lengths), num_layers, num_heads, n_max).contiguous()


def random_scores(lengths: Tensor, num_layers: int, num_heads: int, n_max: int,
                  generator: torch.Generator | None = None) -> Tensor:
    """Random eviction: uniform [0, 1) scores, drawn independently per layer, head and token
    from ``generator``. float32 [R, L, H, n_max]; padding 0."""
    device = lengths.device
    scores = torch.rand(len(lengths), num_layers, num_heads, n_max, generator=generator, device=device,
                        dtype=_F32)
    return scores.masked_fill_(~_valid(lengths, n_max, device), 0.0)


def choose_by_scores(scores: Tensor, lengths: Tensor, config, keep: int, sinks: Tensor | None = None) -> Tensor:
    """Protect the window and the sink (``sinks`` per request, default ``config.attention_sink``),
    then keep the top ``keep``: int64 [R, L, H, keep], ascending."""
    sink = config.attention_sink if sinks is None else sinks
    return select_kept(protect(scores, lengths, config.window, sink), keep)


def score_tokens(queries: Tensor, keys: Tensor, lengths: Tensor, previous: Tensor | None, num_previous: Tensor,
                 config, scale: float, keep: int, block_size: int, pool: bool,
                 generator: torch.Generator | None = None, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The whole pipeline for one layer group, from window queries and dense keys.

    ``config`` is a resolved ``CompressionConfig``; ``block_size`` is the cache's block size
    (the lightning block); ``pool`` says whether pooling applies this time (it always does
    when the config pools at every compression). Returns what ``choose_tokens`` returns;
    for "recency" and "random" (``generator`` draws the random scores) the history score is 0.
    """
    if config.policy in ("recency", "random"):
        R, L, H, n = keys.shape[:4]
        if config.policy == "recency":
            scores = position_scores(lengths.to(keys.device), L, H, n)
        else:
            scores = random_scores(lengths.to(keys.device), L, H, n, generator)
        return choose_by_scores(scores, lengths, config, keep, sinks), torch.zeros_like(scores)
    attention = attention_scores(queries, keys, lengths, scale)
    redundancy = None
    if config.redundancy != "off":
        divisor = block_size if config.redundancy == "lightning" else None
        redundancy = redundancy_scores(keys, lengths, config.similarity_threshold, config.redundancy_temperature,
                                       divisor)
    return choose_tokens(attention, redundancy, lengths, previous, num_previous, config, keep,
                         pool or config.pool_every_compression, sinks)
