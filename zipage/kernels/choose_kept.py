"""From token scores to the kept tokens of a compression, one kernel per layer group.

The steps of the scoring pipeline after the attention score and the redundancy sums
(design page, section 3), for every (request r, layer l of the group, KV head h) row
of n_r cached tokens:

1. history: G = max(A, decay * previous) for the tokens that carry a history score
   from the last compression (read from the score cache through the block table),
   else G = A;
2. pooling: P = max of G over a window of ``pooling_width`` tokens, for the requests
   that pool this time (else P = G);
3. redundancy: R = softmax over the valid tokens of rsum / (temperature * D);
4. combination S = lambda * P - (1 - lambda) * R, protection (+inf for the window and
   the sink, -inf at padding) and selection of the ``keep`` largest, ties going to the
   older token; the kept indices come out ascending, with G at each kept token (the
   history score stored with it).

Done op by op in PyTorch (``choose_kept_torch``, the engine's CPU path and the twin)
this is about 45 small kernels per layer group, whose launch and latency dominate a
compression of one or two requests, the common case while decoding. The Triton
version is one program per row: the row stays in registers; pooling re-reads the
history row, stored once, at shifted offsets; the selection finds the keep-th largest
score by bisection on its float32 bit pattern (32 counting passes over the row), then
keeps every larger score and the oldest of the equal ones (prefix sums), and writes
the kept indices to their ranks.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: only the PyTorch twin is usable
    triton = None

CHOOSE_MAX_TOKENS = 8192  # longest row one program holds (a long prompt's first compression is longer)
CHOOSE_ELEMENTS_PER_WARP = 512


if triton is not None:

    @triton.jit(do_not_specialize=[
        "n_max", "block_table_stride", "lengths_stride", "num_previous_stride", "pool_stride", "sinks_stride"])
    def _choose_kept_kernel(
        attention_ptr,
        rsum_ptr,
        lengths_ptr,
        lengths_stride,
        num_previous_ptr,
        num_previous_stride,
        pool_ptr,
        pool_stride,
        sinks_ptr,
        sinks_stride,
        score_cache_ptr,
        block_tables_ptr,
        history_ptr,
        kept_ptr,
        kept_scores_ptr,
        n_max,
        keep,
        window,
        num_kv_heads,
        decay,
        attention_weight,
        redundancy_weight,
        redundancy_scale,
        score_stride_layer,
        score_stride_block,
        score_stride_slot,
        score_stride_head,
        block_table_stride,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        USE_HISTORY: tl.constexpr,
        POOL_HALF: tl.constexpr,  # pooling_width // 2; 0: no pooling
        HAS_REDUNDANCY: tl.constexpr,
        WRITE_SCORES: tl.constexpr,
    ):
        """One program per (layer x head, request): kept indices (ascending) and their history."""
        layer_head = tl.program_id(0)
        req = tl.program_id(1)
        layer = layer_head // num_kv_heads
        kv_head = layer_head % num_kv_heads
        row = req.to(tl.int64) * tl.num_programs(0) + layer_head
        j = tl.arange(0, BLOCK_N)
        length = tl.load(lengths_ptr + req * lengths_stride).to(tl.int32)
        valid = j < length

        # 1. History.
        attention = tl.load(attention_ptr + row * n_max + j, mask=valid, other=0.0)
        history = attention
        if USE_HISTORY:
            num_previous = tl.load(num_previous_ptr + req * num_previous_stride).to(tl.int32)
            survived = j < num_previous
            pages = tl.load(block_tables_ptr + req.to(tl.int64) * block_table_stride + j // PAGE_SIZE,
                            mask=survived, other=0)
            previous = tl.load(score_cache_ptr + layer.to(tl.int64) * score_stride_layer
                               + pages.to(tl.int64) * score_stride_block + (j % PAGE_SIZE) * score_stride_slot
                               + kv_head * score_stride_head, mask=survived, other=0.0)
            history = tl.where(survived, tl.maximum(attention, previous * decay), attention)

        # 2. Pooling, over the stored history row at shifted offsets (other tokens' values).
        pooled = history
        if POOL_HALF > 0:
            pool = tl.load(pool_ptr + req * pool_stride)
            if pool != 0:
                tl.store(history_ptr + row * BLOCK_N + j, history)
                tl.debug_barrier()  # every thread's history stored before any thread reads its neighbours'
                pooled = tl.full([BLOCK_N], float("-inf"), tl.float32)
                for shift in tl.static_range(-POOL_HALF, POOL_HALF + 1):
                    near = j + shift
                    inside = valid & (near >= 0) & (near < length)
                    pooled = tl.maximum(pooled, tl.load(history_ptr + row * BLOCK_N + near, mask=inside,
                                                        other=float("-inf")))
                pooled = tl.where(valid, pooled, 0.0)

        # 3-4. Redundancy, combination, protection.
        score = pooled
        if HAS_REDUNDANCY:
            x = tl.load(rsum_ptr + row * n_max + j, mask=valid, other=0.0) / redundancy_scale
            x = tl.where(valid, x, float("-inf"))
            top = tl.max(x, 0)
            top = tl.where(top == float("-inf"), 0.0, top)
            e = tl.exp(x - top)
            redundancy = e / tl.maximum(tl.sum(e, 0), 1.0)
            score = attention_weight * pooled - redundancy_weight * redundancy
        # As policy.protect: NaN to the lowest float32, infinities clamped to the finite range.
        score = tl.where(score != score, -3.4028234663852886e38, score)
        score = tl.minimum(tl.maximum(score, -3.4028234663852886e38), 3.4028234663852886e38)
        sink = tl.load(sinks_ptr + req * sinks_stride).to(tl.int32)
        score = tl.where((j >= length - window) | (j < sink), float("inf"), score)
        score = tl.where(valid, score, float("-inf")) + 0.0  # + 0.0: -0.0 ties with 0.0, as in a sort

        # 5. Selection. Signed integers that order like the floats they come from.
        bits = score.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        low = tl.full([], -2147483648, tl.int64)  # the keep-th largest key lies in [low, high]
        high = tl.full([], 2147483647, tl.int64)
        for _ in range(32):
            middle = (low + high + 1) // 2
            enough = tl.sum((key >= middle).to(tl.int32), 0) >= keep
            low = tl.where(enough, middle, low)
            high = tl.where(enough, high, middle - 1)
        above = key > low
        equal = key == low
        wanted = keep - tl.sum(above.to(tl.int32), 0)  # equal keys kept, oldest first
        chosen = above | (equal & (tl.cumsum(equal.to(tl.int32), 0) <= wanted))
        rank = tl.cumsum(chosen.to(tl.int32), 0) - 1
        tl.store(kept_ptr + row * keep + rank, j.to(tl.int64), mask=chosen)
        if WRITE_SCORES:
            tl.store(kept_scores_ptr + row * keep + rank, history, mask=chosen)


def _pooling_half(config, pool) -> int:
    width = config.pooling_width
    if width is None or width <= 1 or pool is False:
        return 0
    return width // 2


def choose_kept(attention, rsum, lengths, num_previous, pool, sinks, score_group, block_tables, config, keep,
                block_size, write_scores=True, divide_by_length=False):
    """Kept indices int64 [R, L, H, keep] (ascending) and the history score of each (float32, same
    shape; None without ``write_scores``), for the lightning redundancy or none.

    attention, rsum: float32 [R, L, H, n_max] contiguous (rsum None: redundancy off); lengths,
    num_previous, sinks: integer [R], any stride; pool: bool, or integer / bool [R] (requests that
    pool this time); score_group: the layer group's score cache [L, num_blocks, b, H] with the
    previous compression's history for each request's first num_previous tokens (None: history
    off), read through block_tables (int32 [R, >= pages]). config: a resolved CompressionConfig
    (window, pooling_width, global_score_decay, attention_weight, redundancy_temperature); the
    redundancy divisor is block_size (``divide_by_length``, the "raw" redundancy's divisor, is for
    the twin only). n_max <= CHOOSE_MAX_TOKENS and keep <= every length.
    """
    assert not divide_by_length, "the raw redundancy's normalisation: use choose_kept_torch"
    num_requests, num_layers, num_kv_heads, n_max = attention.shape
    assert n_max <= CHOOSE_MAX_TOKENS, f"rows longer than {CHOOSE_MAX_TOKENS} tokens: use choose_kept_torch"
    assert attention.is_contiguous() and attention.dtype == torch.float32
    assert rsum is None or (rsum.shape == attention.shape and rsum.is_contiguous())
    device = attention.device
    kept = torch.empty(num_requests, num_layers, num_kv_heads, keep, dtype=torch.int64, device=device)
    kept_scores = torch.empty(kept.shape, dtype=torch.float32, device=device) if write_scores else None
    if kept.numel() == 0:
        return kept, kept_scores
    block_n = triton.next_power_of_2(n_max)
    pool_half = _pooling_half(config, pool)
    if not pool_half:
        pool = lengths  # unread
    elif not isinstance(pool, torch.Tensor):  # True: every request pools
        pool = torch.ones(num_requests, dtype=torch.int64, device=device)
    history = torch.empty(num_requests * num_layers * num_kv_heads * block_n if pool_half else 1,
                          dtype=torch.float32, device=device)  # pooling's copy of each history row
    use_history = score_group is not None and config.global_score_decay is not None
    score_args = score_group if use_history else attention  # unused without history
    score_strides = score_group.stride() if use_history else (0, 0, 0, 0)
    _choose_kept_kernel[(num_layers * num_kv_heads, num_requests)](
        attention, rsum if rsum is not None else attention, lengths, lengths.stride(0),
        num_previous, num_previous.stride(0), pool, pool.stride(0), sinks, sinks.stride(0),
        score_args, block_tables, history, kept, kept_scores if write_scores else kept,
        n_max, keep, config.window, num_kv_heads,
        float(config.global_score_decay or 0.0), float(config.attention_weight), 1.0 - float(config.attention_weight),
        float(config.redundancy_temperature) * float(block_size),
        *score_strides, block_tables.stride(0),
        PAGE_SIZE=block_size, BLOCK_N=block_n, USE_HISTORY=use_history, POOL_HALF=pool_half,
        HAS_REDUNDANCY=rsum is not None, WRITE_SCORES=write_scores,
        num_warps=min(16, max(4, block_n // CHOOSE_ELEMENTS_PER_WARP)),
    )  # fmt: skip
    return kept, kept_scores


def choose_kept_torch(attention, rsum, lengths, num_previous, pool, sinks, score_group, block_tables, config, keep,
                      block_size, write_scores=True, divide_by_length=False):
    """PyTorch twin of choose_kept (same arguments and results): the functions of ``policy.py``.
    With ``divide_by_length`` (the "raw" redundancy, PyTorch only) rsum is divided by each
    request's length instead of the block size."""
    from zipage.compression import policy
    from zipage.kernels.compress_scores import gather_keys

    n_max = attention.shape[-1]
    redundancy = None
    if rsum is not None:
        redundancy = policy.normalise_redundancy(rsum, lengths, config.redundancy_temperature,
                                                 None if divide_by_length else block_size)
    previous = None
    if score_group is not None and config.global_score_decay is not None:
        previous = gather_keys(score_group.unsqueeze(-1), block_tables, num_previous, n_max).squeeze(-1)
    kept, history = policy.choose_tokens(attention, redundancy, lengths, previous, num_previous, config, keep, pool,
                                         sinks)
    return kept, history.gather(-1, kept) if write_scores else None
