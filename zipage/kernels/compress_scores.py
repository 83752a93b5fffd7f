"""Scores of cached tokens for KV-cache compression, read straight from the paged cache.

Two quantities of the scoring pipeline (design page, section 3) are computed here
per (request r, layer l of a layer group, KV head h), over the request's n_r cached
tokens (token j lives in block block_tables[r, j // b] at offset j % b):

* paged_attention_scores: A, the attention the observation window pays to every
  token (mean over the w window queries of the max over the G query heads of the
  KV head of the causal softmax). Two passes over the keys: pass 1 computes the
  log-sum-exp of every (window row, query head) softmax, optionally split along the
  keys; pass 2 recomputes the logits one key tile per program, turns them into
  probabilities with the (merged) log-sum-exp, and reduces them to A.
* paged_redundancy_sums: the "lightning" redundancy sums rsum (cosine similarities
  of the keys within each cache block, minus those pointing at a key's most recent
  copy). One program per block.

Each has a PyTorch twin that gathers the keys into a dense tensor (gather_keys) and
calls the pure functions of zipage.compression.policy.

With a float8 KV cache the keys come with their float32 scales k_scale [L, num_blocks,
b, H] (one per token and KV head): logits are multiplied by the key's scale, and the
redundancy's cosine similarities use the dequantized norms.
"""


import torch

from zipage.kernels.common import dot_precision, is_fp8, multiprocessor_count

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: only the PyTorch twins are usable
    triton = None

# Tuning knobs: first guesses from register / shared-memory budgets, compiled for
# sm_90 but not yet timed on a GPU.
# Attention scores: at most this many (window row, query head) rows per program,
# float32 logits per tile (rows x keys), and bytes of one key tile.
# (bf16, head_dim 128, G = 4, w = 16: 64 rows x 128 keys, ~170 registers, no spills.)
SCORE_MAX_ROWS = 128
SCORE_TILE_ELEMENTS = 8192
SCORE_KEY_TILE_BYTES = 32768
SCORE_NUM_WARPS = 4
SCORE_NUM_STAGES = 2
# Pass 1 splits the keys of one (request, layer, head) across programs until there
# are about this many programs per SM.
SCORE_PROGRAMS_PER_SM = 8
SCORE_MAX_SPLITS = 32
# Redundancy: query rows per step are chosen so that rows x block_size float32
# similarities stay within this many elements, with a warp per this many of them
# (4 to 16 warps). Timed on an H200 (block 256, head_dim 128, bf16, 32 requests x 8
# layers x 8 heads x 9 blocks): 32 rows on 4 warps 2.53 ms, 64 rows on 16 warps (the
# first guess) 3.05 ms, every other shape from 16 to 128 rows and 4 to 16 warps in
# between or slower; 256 rows does not compile (registers). It is bound by the
# elementwise work on the similarities (about 120 TFLOP/s of tensor-core work). Every
# shape but 64 rows on 8 or 16 warps spills (32 on 4: 255 registers and 2.5 KB of
# stack a thread), yet 32 on 4 was also the cheapest beside decode steps (1.9 / 3.3
# against 2.0 / 3.4 ms for a compression of 1 / 4 requests).
REDUNDANCY_TILE_ELEMENTS = 8192
REDUNDANCY_ELEMENTS_PER_WARP = 2048
REDUNDANCY_MAX_BLOCK = 256  # the whole block's keys sit in shared memory
EPS = 1e-6  # floor of a key's norm in the cosine similarity

_LOG2_E = 1.4426950408889634


if triton is not None:
    # Finite stand-in for -inf as the running maximum, so that rows or splits that
    # see no key yet never produce inf - inf.
    _NO_MAX = tl.constexpr(-1.0e30)
    _NORM_FLOOR = tl.constexpr(EPS)

    @triton.jit
    def _load_window_queries(
        q_ptr,
        req,
        layer,
        kv_head,
        chunk,
        window,
        q_stride_req,
        q_stride_layer,
        q_stride_row,
        q_stride_head,
        GROUP_SIZE: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        WINDOW_CHUNK: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        """Query rows of one chunk of window rows: row m is (window row chunk *
        WINDOW_CHUNK + m // GROUP_PAD, query head kv_head * GROUP_SIZE + m % GROUP_PAD).
        Returns (q [WINDOW_CHUNK * GROUP_PAD, HEAD_DIM] zero on padding rows, the
        window row of every row, the validity of every row)."""
        rows = tl.arange(0, WINDOW_CHUNK * GROUP_PAD)
        window_row = chunk * WINDOW_CHUNK + rows // GROUP_PAD
        group_row = rows % GROUP_PAD
        row_valid = (window_row < window) & (group_row < GROUP_SIZE)
        dims = tl.arange(0, HEAD_DIM)
        offsets = (
            req.to(tl.int64) * q_stride_req
            + layer * q_stride_layer
            + window_row * q_stride_row
            + (kv_head * GROUP_SIZE + group_row) * q_stride_head
        )
        q = tl.load(q_ptr + offsets[:, None] + dims[None, :], mask=row_valid[:, None], other=0.0)
        return q, window_row, row_valid

    @triton.jit
    def _load_key_tile(
        k_ptr,
        block_table_row,
        key_begin,
        length,
        head_offset,
        k_stride_block,
        k_stride_slot,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Keys key_begin:key_begin+BLOCK_N of a request ([BLOCK_N, HEAD_DIM], 0 past length)."""
        positions = key_begin + tl.arange(0, BLOCK_N)
        in_context = positions < length
        # A tile may span several pages (BLOCK_N > PAGE_SIZE): one lookup per token.
        pages = tl.load(block_table_row + positions // PAGE_SIZE, mask=in_context, other=0)
        offsets = pages.to(tl.int64) * k_stride_block + (positions % PAGE_SIZE) * k_stride_slot + head_offset
        dims = tl.arange(0, HEAD_DIM)
        # Masked loads: slots past the context may hold NaN.
        k = tl.load(k_ptr + offsets[:, None] + dims[None, :], mask=in_context[:, None], other=0.0)
        return k, positions, in_context

    @triton.jit
    def _load_key_scales(
        k_scale_ptr,
        block_table_row,
        key_begin,
        length,
        scale_head_offset,
        s_stride_block,
        s_stride_slot,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Scales of the keys of _load_key_tile's tile (float8 cache; 0 past length)."""
        positions = key_begin + tl.arange(0, BLOCK_N)
        in_context = positions < length
        pages = tl.load(block_table_row + positions // PAGE_SIZE, mask=in_context, other=0)
        offsets = pages.to(tl.int64) * s_stride_block + (positions % PAGE_SIZE) * s_stride_slot + scale_head_offset
        return tl.load(k_scale_ptr + offsets, mask=in_context, other=0.0)

    @triton.jit(do_not_specialize=["num_splits", "block_table_stride", "lengths_stride", "q_stride_req"])
    def _window_lse_kernel(
        q_ptr,
        k_ptr,
        block_tables_ptr,
        lengths_ptr,
        lengths_stride,
        partial_max_ptr,
        partial_sum_ptr,
        scale_log2,
        window,
        num_kv_heads,
        num_splits,
        num_chunks,
        q_stride_req,
        q_stride_layer,
        q_stride_row,
        q_stride_head,
        k_stride_layer,
        k_stride_block,
        k_stride_slot,
        k_stride_head,
        block_table_stride,
        k_scale_ptr,
        s_stride_layer,
        s_stride_block,
        s_stride_slot,
        GROUP_SIZE: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        WINDOW_CHUNK: tl.constexpr,
        ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        FP8: tl.constexpr,
    ):
        """Pass 1, one program per (split x chunk, layer x head, request): running
        maximum and sum (log2 domain) of every row's softmax over a share of the keys."""
        split_chunk = tl.program_id(0)
        layer_head = tl.program_id(1)
        req = tl.program_id(2)
        split = split_chunk // num_chunks
        chunk = split_chunk % num_chunks
        layer = layer_head // num_kv_heads
        kv_head = layer_head % num_kv_heads

        q, window_row, row_valid = _load_window_queries(
            q_ptr, req, layer, kv_head, chunk, window,
            q_stride_req, q_stride_layer, q_stride_row, q_stride_head,
            GROUP_SIZE, GROUP_PAD, WINDOW_CHUNK, HEAD_DIM,
        )  # fmt: skip
        length = tl.load(lengths_ptr + req * lengths_stride).to(tl.int32)
        # Window row i is token length - w + i and sees the keys up to itself
        # (padding rows i >= w see every key, harmlessly).
        last_visible = length - window + window_row

        num_tiles = tl.cdiv(length, BLOCK_N)
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        tile_begin = split * tiles_per_split
        tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

        block_table_row = block_tables_ptr + req.to(tl.int64) * block_table_stride
        head_offset = layer.to(tl.int64) * k_stride_layer + kv_head * k_stride_head
        scale_head_offset = layer.to(tl.int64) * s_stride_layer + kv_head
        row_max = tl.full([ROWS], _NO_MAX, tl.float32)
        row_sum = tl.zeros([ROWS], tl.float32)
        for tile in range(tile_begin, tile_end):
            k, positions, in_context = _load_key_tile(
                k_ptr, block_table_row, tile * BLOCK_N, length, head_offset,
                k_stride_block, k_stride_slot, HEAD_DIM, PAGE_SIZE, BLOCK_N,
            )  # fmt: skip
            if FP8:  # float8 -> q's dtype is exact; the key's scale multiplies its logit
                k_scale = _load_key_scales(
                    k_scale_ptr, block_table_row, tile * BLOCK_N, length, scale_head_offset,
                    s_stride_block, s_stride_slot, PAGE_SIZE, BLOCK_N,
                )  # fmt: skip
                logits = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
                logits = logits * (k_scale * scale_log2)[None, :]
            else:
                logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            visible = (positions[None, :] <= last_visible[:, None]) & in_context[None, :]
            logits = tl.where(visible, logits, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(logits, 1))
            row_sum = row_sum * tl.exp2(row_max - new_max) + tl.sum(tl.exp2(logits - new_max[:, None]), 1)
            row_max = new_max

        # Splits without keys store (_NO_MAX, 0), which the merge ignores.
        rows = tl.arange(0, ROWS)
        partial = ((req.to(tl.int64) * tl.num_programs(1) + layer_head) * num_chunks + chunk) * num_splits + split
        tl.store(partial_max_ptr + partial * ROWS + rows, row_max)
        tl.store(partial_sum_ptr + partial * ROWS + rows, row_sum)

    @triton.jit(do_not_specialize=["n_max", "num_splits", "block_table_stride", "lengths_stride", "q_stride_req"])
    def _window_attention_kernel(
        q_ptr,
        k_ptr,
        block_tables_ptr,
        lengths_ptr,
        lengths_stride,
        partial_max_ptr,
        partial_sum_ptr,
        out_ptr,
        scale_log2,
        window,
        n_max,
        num_kv_heads,
        num_splits,
        num_chunks,
        q_stride_req,
        q_stride_layer,
        q_stride_row,
        q_stride_head,
        k_stride_layer,
        k_stride_block,
        k_stride_slot,
        k_stride_head,
        block_table_stride,
        k_scale_ptr,
        s_stride_layer,
        s_stride_block,
        s_stride_slot,
        GROUP_SIZE: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        WINDOW_CHUNK: tl.constexpr,
        ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        FP8: tl.constexpr,
    ):
        """Pass 2, one program per (key tile, layer x head, request): A for BLOCK_N tokens."""
        tile = tl.program_id(0)
        layer_head = tl.program_id(1)
        req = tl.program_id(2)
        layer = layer_head // num_kv_heads
        kv_head = layer_head % num_kv_heads

        length = tl.load(lengths_ptr + req * lengths_stride).to(tl.int32)
        key_begin = tile * BLOCK_N
        out_positions = key_begin + tl.arange(0, BLOCK_N)
        out_offsets = (req.to(tl.int64) * tl.num_programs(1) + layer_head) * n_max + out_positions
        if key_begin >= length:  # padding only
            tl.store(out_ptr + out_offsets, tl.zeros([BLOCK_N], tl.float32), mask=out_positions < n_max)
            return

        block_table_row = block_tables_ptr + req.to(tl.int64) * block_table_stride
        head_offset = layer.to(tl.int64) * k_stride_layer + kv_head * k_stride_head
        scale_head_offset = layer.to(tl.int64) * s_stride_layer + kv_head
        k, positions, in_context = _load_key_tile(
            k_ptr, block_table_row, key_begin, length, head_offset,
            k_stride_block, k_stride_slot, HEAD_DIM, PAGE_SIZE, BLOCK_N,
        )  # fmt: skip
        if FP8:  # float8 -> q's dtype is exact; the key's scale multiplies its logit
            k_scale_log2 = scale_log2 * _load_key_scales(
                k_scale_ptr, block_table_row, key_begin, length, scale_head_offset,
                s_stride_block, s_stride_slot, PAGE_SIZE, BLOCK_N,
            )  # fmt: skip

        rows = tl.arange(0, ROWS)
        total = tl.zeros([BLOCK_N], tl.float32)
        for chunk in range(num_chunks):
            q, window_row, row_valid = _load_window_queries(
                q_ptr, req, layer, kv_head, chunk, window,
                q_stride_req, q_stride_layer, q_stride_row, q_stride_head,
                GROUP_SIZE, GROUP_PAD, WINDOW_CHUNK, HEAD_DIM,
            )  # fmt: skip
            # Merge the splits' partial softmax sums into each row's log-sum-exp.
            partial = ((req.to(tl.int64) * tl.num_programs(1) + layer_head) * num_chunks + chunk) * num_splits
            row_max = tl.full([ROWS], _NO_MAX, tl.float32)
            row_sum = tl.zeros([ROWS], tl.float32)
            for split in range(num_splits):
                split_max = tl.load(partial_max_ptr + (partial + split) * ROWS + rows)
                split_sum = tl.load(partial_sum_ptr + (partial + split) * ROWS + rows)
                new_max = tl.maximum(row_max, split_max)
                row_sum = row_sum * tl.exp2(row_max - new_max) + split_sum * tl.exp2(split_max - new_max)
                row_max = new_max
            # Every real row sees key 0, so row_sum >= 1 there; the guard is for padding rows.
            lse = row_max + tl.log2(tl.maximum(row_sum, 1e-30))

            if FP8:
                logits = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * k_scale_log2[None, :]
            else:
                logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            last_visible = length - window + window_row
            visible = (positions[None, :] <= last_visible[:, None]) & in_context[None, :] & row_valid[:, None]
            probs = tl.where(visible, tl.exp2(logits - lse[:, None]), 0.0)
            # Max over the query heads of the group, then sum over the window rows.
            head_max = tl.max(tl.reshape(probs, [WINDOW_CHUNK, GROUP_PAD, BLOCK_N]), 1)
            total += tl.sum(head_max, 0)

        tl.store(out_ptr + out_offsets, total / window, mask=out_positions < n_max)

    @triton.jit(do_not_specialize=["n_max", "block_table_stride", "lengths_stride"])
    def _redundancy_kernel(
        k_ptr,
        block_tables_ptr,
        lengths_ptr,
        lengths_stride,
        out_ptr,
        threshold,
        n_max,
        num_kv_heads,
        k_stride_layer,
        k_stride_block,
        k_stride_slot,
        k_stride_head,
        block_table_stride,
        k_scale_ptr,
        s_stride_layer,
        s_stride_block,
        s_stride_slot,
        PAGE_SIZE: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        FP8: tl.constexpr,
    ):
        """One program per (cache block, layer x head, request): rsum of the block's tokens.

        The block's keys K stay in registers / shared memory as the columns m; rows n
        are taken BLOCK_ROWS at a time. For each row chunk: S = cosine similarities
        [rows, b], m*(n) = the largest column with S > threshold, and the column sums
        of S without the diagonal, the invalid tokens and each row's m*(n) entry.
        """
        block = tl.program_id(0)
        layer_head = tl.program_id(1)
        req = tl.program_id(2)
        layer = layer_head // num_kv_heads
        kv_head = layer_head % num_kv_heads

        length = tl.load(lengths_ptr + req * lengths_stride).to(tl.int32)
        num_valid = tl.minimum(length - block * PAGE_SIZE, PAGE_SIZE)
        cols = tl.arange(0, BLOCK_B)
        out_positions = block * PAGE_SIZE + cols
        out_mask = (cols < PAGE_SIZE) & (out_positions < n_max)
        out_offsets = (req.to(tl.int64) * tl.num_programs(1) + layer_head) * n_max + out_positions
        if num_valid <= 0:  # padding only
            tl.store(out_ptr + out_offsets, tl.zeros([BLOCK_B], tl.float32), mask=out_mask)
            return

        page = tl.load(block_tables_ptr + req.to(tl.int64) * block_table_stride + block)
        base = (
            k_ptr + layer.to(tl.int64) * k_stride_layer + page.to(tl.int64) * k_stride_block + kv_head * k_stride_head
        )
        dims = tl.arange(0, HEAD_DIM)
        col_valid = cols < num_valid
        k_cols = tl.load(base + cols[:, None] * k_stride_slot + dims[None, :], mask=col_valid[:, None], other=0.0)
        k_cols_f32 = k_cols.to(tl.float32)
        if FP8:
            # Dot products of the float8 values (exact in float16), times both keys' scales
            # over their dequantized norms: the cosine similarity of the dequantized keys.
            scale_base = (k_scale_ptr + layer.to(tl.int64) * s_stride_layer + page.to(tl.int64) * s_stride_block
                          + kv_head)
            col_key_scale = tl.load(scale_base + cols * s_stride_slot, mask=col_valid, other=0.0)
            col_norm = tl.sqrt(tl.sum(k_cols_f32 * k_cols_f32, 1)) * col_key_scale
            col_scale = col_key_scale / tl.maximum(col_norm, _NORM_FLOOR)
            k_cols = k_cols.to(tl.float16)
        else:
            col_scale = 1.0 / tl.maximum(tl.sqrt(tl.sum(k_cols_f32 * k_cols_f32, 1)), _NORM_FLOOR)

        col_sums = tl.zeros([BLOCK_B], tl.float32)
        for row_begin in range(0, num_valid, BLOCK_ROWS):
            rows = row_begin + tl.arange(0, BLOCK_ROWS)
            row_valid = rows < num_valid
            k_rows = tl.load(base + rows[:, None] * k_stride_slot + dims[None, :], mask=row_valid[:, None], other=0.0)
            k_rows_f32 = k_rows.to(tl.float32)
            if FP8:
                row_key_scale = tl.load(scale_base + rows * s_stride_slot, mask=row_valid, other=0.0)
                row_norm = tl.sqrt(tl.sum(k_rows_f32 * k_rows_f32, 1)) * row_key_scale
                row_scale = row_key_scale / tl.maximum(row_norm, _NORM_FLOOR)
                k_rows = k_rows.to(tl.float16)
            else:
                row_scale = 1.0 / tl.maximum(tl.sqrt(tl.sum(k_rows_f32 * k_rows_f32, 1)), _NORM_FLOOR)
            # Raw dot products (exact products for 16-bit keys, float32 sums), then
            # divided by the norms: more accurate than a dot of rounded unit vectors.
            sim = tl.dot(k_rows, tl.trans(k_cols), input_precision=DOT_PRECISION)
            sim = sim * row_scale[:, None] * col_scale[None, :]
            partner = row_valid[:, None] & col_valid[None, :] & (rows[:, None] != cols[None, :])
            latest = tl.max(tl.where(partner & (sim > threshold), cols[None, :], -1), 1)
            kept = partner & (cols[None, :] != latest[:, None])
            col_sums += tl.sum(tl.where(kept, sim, 0.0), 0)

        tl.store(out_ptr + out_offsets, tl.where(col_valid, col_sums, 0.0), mask=out_mask)


def _next_power_of_2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def _check_paged(k_cache, block_tables, lengths, k_scale=None):
    assert k_cache.dim() == 5, "k_cache: [layers, blocks, block_size, kv_heads, head_dim]"
    assert block_tables.dim() == 2 and lengths.dim() == 1 and block_tables.shape[0] == lengths.shape[0]
    assert (k_scale is None) == (not is_fp8(k_cache.dtype)), "a float8 cache goes with its k_scale, and only it"
    if k_scale is not None:
        assert k_scale.shape == k_cache.shape[:4] and k_scale.dtype == torch.float32 and k_scale.stride(3) == 1


def _scale_args(k_scale, placeholder):
    """Kernel arguments of the key scales: pointer and layer, block, slot strides."""
    if k_scale is None:
        return placeholder, 0, 0, 0
    return k_scale, k_scale.stride(0), k_scale.stride(1), k_scale.stride(2)


def gather_keys(k_cache, block_tables, lengths, n_max, *, k_scale=None, dtype=torch.float32):
    """Dense copy [R, L, H, n_max, d] of each request's first lengths[r] cached tokens.

    k_cache: [L, num_blocks, b, H, d] (any strides, e.g. a layer-group view); token j
    of request r is read from block block_tables[r, j // b], offset j % b. Positions
    j >= lengths[r] are 0 (never read: their block-table entries may be garbage).
    Keeps k_cache's dtype; a float8 cache is dequantized with its scales k_scale [L,
    num_blocks, b, H] into ``dtype``.
    """
    _check_paged(k_cache, block_tables, lengths, k_scale)
    num_layers, _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_requests = block_tables.shape[0]
    device = k_cache.device
    positions = torch.arange(n_max, device=device)
    valid = positions[None, :] < lengths.to(device=device, dtype=torch.int64)[:, None]  # [R, n_max]
    pages = (positions // block_size).clamp_max(max(block_tables.shape[1] - 1, 0))
    if block_tables.shape[1] == 0:
        blocks = torch.zeros(num_requests, n_max, dtype=torch.int64, device=device)
    else:
        blocks = torch.where(valid, block_tables.to(device=device, dtype=torch.int64)[:, pages], 0)
    keys = k_cache[:, blocks, positions % block_size]  # [L, R, n_max, H, d]
    if k_scale is not None:
        keys = (keys.to(torch.float32) * k_scale[:, blocks, positions % block_size][..., None]).to(dtype)
    keys = keys.permute(1, 0, 3, 2, 4)
    return keys.masked_fill(~valid[:, None, None, :, None], 0).contiguous()


def _score_tiles(rows, head_dim, element_size):
    """Keys per tile for `rows` logit rows: bounded by the logits' and the key tile's size."""
    by_logits = SCORE_TILE_ELEMENTS // rows
    by_keys = SCORE_KEY_TILE_BYTES // (head_dim * element_size)
    return max(16, min(128, _next_power_of_2(min(by_logits, by_keys) + 1) // 2))


def paged_attention_scores(
    queries, k_cache, block_tables, lengths, scale, n_max, out=None, *, num_splits=None, window_chunk=None,
    k_scale=None,
):
    """Attention score A [R, L, H, n_max] float32 of the window queries on the paged keys.

    queries: [R, L, w, Hq, d] (row i is the query of token lengths[r] - w + i; last
    dimension contiguous); k_cache: the layer group's keys [L, num_blocks, b, H, d]
    (strided view); block_tables: int32 [R, >= ceil(lengths[r] / b)]; lengths: int32 or
    int64 [R], any stride (the engine passes a column of its packed numbers),
    w <= lengths[r] <= n_max. A[r, l, h, j] = mean over i of the max over
    the G = Hq / H query heads h*G + g of the causal softmax weight of key j (row i
    sees j <= lengths[r] - w + i). Padding j >= lengths[r]: 0. Written into `out`
    when given. num_splits (pass-1 key splits) and window_chunk (window rows per
    program, a power of two) override the tuning, for tests. A float8 cache comes with its
    float32 scales k_scale [L, num_blocks, b, H].
    """
    _check_paged(k_cache, block_tables, lengths, k_scale)
    num_requests, num_layers, window, num_heads, head_dim = queries.shape
    _, _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert k_cache.shape[0] == num_layers and cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert head_dim in (16, 32, 64, 128, 256), "head_dim must be a power of two in [16, 256]"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    fp8 = k_scale is not None
    assert fp8 or queries.dtype == k_cache.dtype
    assert queries.stride(4) == 1 and k_cache.stride(4) == 1 and block_tables.stride(1) == 1
    if out is None:
        out = torch.empty(num_requests, num_layers, num_kv_heads, n_max, dtype=torch.float32, device=k_cache.device)
    assert out.shape == (num_requests, num_layers, num_kv_heads, n_max) and out.dtype == torch.float32
    assert out.is_contiguous()
    if out.numel() == 0:
        return out

    group_size = num_heads // num_kv_heads
    group_pad = _next_power_of_2(group_size)
    if window_chunk is None:
        window_chunk = min(_next_power_of_2(window), max(SCORE_MAX_ROWS // group_pad, 1))
    assert window_chunk >= 1 and window_chunk & (window_chunk - 1) == 0, "window_chunk must be a power of two"
    window_chunk = max(window_chunk, 16 // min(group_pad, 16))  # tl.dot needs >= 16 rows
    rows = window_chunk * group_pad
    num_chunks = triton.cdiv(window, window_chunk)
    block_n = _score_tiles(rows, head_dim, (queries if fp8 else k_cache).element_size())
    max_tiles = triton.cdiv(n_max, block_n)
    layer_heads = num_layers * num_kv_heads
    if num_splits is None:
        target = SCORE_PROGRAMS_PER_SM * multiprocessor_count(k_cache.device)
        num_splits = target // (num_requests * layer_heads * num_chunks)
    num_splits = max(1, min(num_splits, max_tiles, SCORE_MAX_SPLITS))

    partial_shape = (num_requests, layer_heads, num_chunks, num_splits, rows)
    partial_max = torch.empty(partial_shape, dtype=torch.float32, device=k_cache.device)
    partial_sum = torch.empty(partial_shape, dtype=torch.float32, device=k_cache.device)
    common = dict(
        GROUP_SIZE=group_size,
        GROUP_PAD=group_pad,
        WINDOW_CHUNK=window_chunk,
        ROWS=rows,
        HEAD_DIM=head_dim,
        PAGE_SIZE=block_size,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(queries.dtype),
        FP8=fp8,
        num_warps=SCORE_NUM_WARPS,
        num_stages=SCORE_NUM_STAGES,
    )
    strides = (
        queries.stride(0),
        queries.stride(1),
        queries.stride(2),
        queries.stride(3),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        block_tables.stride(0),
        *_scale_args(k_scale, lengths),
    )
    scale_log2 = scale * _LOG2_E
    _window_lse_kernel[(num_splits * num_chunks, layer_heads, num_requests)](
        queries, k_cache, block_tables, lengths, lengths.stride(0), partial_max, partial_sum,
        scale_log2, window, num_kv_heads, num_splits, num_chunks, *strides, **common,
    )  # fmt: skip
    _window_attention_kernel[(max_tiles, layer_heads, num_requests)](
        queries, k_cache, block_tables, lengths, lengths.stride(0), partial_max, partial_sum, out,
        scale_log2, window, n_max, num_kv_heads, num_splits, num_chunks, *strides, **common,
    )  # fmt: skip
    return out


def paged_attention_scores_torch(queries, k_cache, block_tables, lengths, scale, n_max, out=None, *, k_scale=None):
    """PyTorch twin of paged_attention_scores: gather_keys + policy.attention_scores."""
    from zipage.compression import policy

    keys = gather_keys(k_cache, block_tables, lengths, n_max, k_scale=k_scale, dtype=queries.dtype)
    result = policy.attention_scores(queries, keys, lengths, scale)
    if out is None:
        return result
    out.copy_(result)
    return out


def paged_redundancy_sums(k_cache, block_tables, lengths, threshold, n_max, out=None, *, block_rows=None,
                          num_warps=None, k_scale=None):
    """Lightning redundancy sums rsum [R, L, H, n_max] float32 from the paged keys.

    Partners of token n are the other valid tokens of its cache block (tokens
    [t*b, min((t+1)*b, lengths[r])) for block t); s is the cosine similarity with
    key norms floored at 1e-6; m*(n) is n's largest partner with s > threshold;
    rsum(m) = sum over partners n of s(n, m), minus s(n, m) for each n with
    m*(n) == m. Padding: 0. k_cache, block_tables, lengths as for
    paged_attention_scores; b <= 256. Written into `out` when given. block_rows
    (similarity rows per step, a power of two >= 16) and num_warps override the
    tuning. A float8 cache comes with its float32 scales k_scale [L, num_blocks, b, H]
    (similarities of the dequantized keys).
    """
    _check_paged(k_cache, block_tables, lengths, k_scale)
    num_layers, _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_requests = block_tables.shape[0]
    assert head_dim in (16, 32, 64, 128, 256), "head_dim must be a power of two in [16, 256]"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert block_size <= REDUNDANCY_MAX_BLOCK, f"block_size > {REDUNDANCY_MAX_BLOCK}: use the PyTorch twin"
    assert k_cache.stride(4) == 1 and block_tables.stride(1) == 1
    if out is None:
        out = torch.empty(num_requests, num_layers, num_kv_heads, n_max, dtype=torch.float32, device=k_cache.device)
    assert out.shape == (num_requests, num_layers, num_kv_heads, n_max) and out.dtype == torch.float32
    assert out.is_contiguous()
    if out.numel() == 0:
        return out

    block_b = max(16, block_size)  # tl.dot needs >= 16 rows and columns
    if block_rows is None:
        block_rows = max(16, min(block_b, REDUNDANCY_TILE_ELEMENTS // block_b))
    assert block_rows >= 16 and block_rows & (block_rows - 1) == 0, "block_rows must be a power of two >= 16"
    if num_warps is None:
        num_warps = min(16, max(4, block_b * block_rows // REDUNDANCY_ELEMENTS_PER_WARP))
    num_blocks = triton.cdiv(n_max, block_size)
    _redundancy_kernel[(num_blocks, num_layers * num_kv_heads, num_requests)](
        k_cache,
        block_tables,
        lengths,
        lengths.stride(0),
        out,
        float(threshold),
        n_max,
        num_kv_heads,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        block_tables.stride(0),
        *_scale_args(k_scale, lengths),
        PAGE_SIZE=block_size,
        BLOCK_B=block_b,
        BLOCK_ROWS=block_rows,
        HEAD_DIM=head_dim,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        FP8=k_scale is not None,
        num_warps=num_warps,
        num_stages=1,
    )
    return out


def paged_redundancy_sums_torch(k_cache, block_tables, lengths, threshold, n_max, out=None, *, k_scale=None):
    """PyTorch twin of paged_redundancy_sums: gather_keys + policy.redundancy_sums (lightning)."""
    from zipage.compression import policy

    keys = gather_keys(k_cache, block_tables, lengths, n_max, k_scale=k_scale)
    result = policy.redundancy_sums(keys, lengths, threshold, block_size=k_cache.shape[2])
    if out is None:
        return result
    out.copy_(result)
    return out
