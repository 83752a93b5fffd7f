"""Compact the kept tokens of a KV-cache compression into their target blocks.

For every request r, layer l of a layer group and KV head h, the keep tokens chosen
by the scoring (kept[r, l, h, :], ascending indices into the request's current KV
order) move to destination positions 0..keep-1: position j lives in block
target_tables[r, j // b] at offset j % b. Keys, values and, when there is a score
cache, the tokens' scores move together.

Target blocks may be the request's own source blocks (in-place compaction), so a
token may be overwritten before it is read. Two ways to make that hazard-free:

* single pass, when every target block is either the request's own source block at
  the same index or a block that no request of the batch reads (what the engine's
  block manager gives whenever released blocks are not reused within the batch).
  Then destination position j is never after the position kept[j] it is read from
  (kept is ascending, so kept[j] >= j), and one program per (request, layer, head)
  walks the kept tokens in ascending tiles: a tile reads only positions that no
  earlier tile wrote, and a barrier between its loads and its stores orders the
  threads of the tile. Every kept byte is read once and written once.
* two phases, for any targets: phase 1 gathers every kept row into a dense scratch
  buffer, phase 2 scatters the scratch into the targets (the launch boundary is the
  global barrier). A token only ever moves within its own (layer, head) plane of
  the caches, so the scratch is bounded by running the two phases for a few
  (layer, head) pairs at a time, each time for all requests (one request's target
  block may be another request's released source block). Twice the traffic.

A float8 KV cache moves as bytes, and its scales (scale_group [2, L, num_blocks, b,
H] float32, one per token and KV head) move with them: in the single pass the same
program reads a tile's key and value scales with its bytes and writes them after the
same barrier; with two phases, a launch of their own on the scales seen as rows of one
element (their planes are apart from the keys', so the hazard argument holds for each).
"""

import torch

from zipage.kernels.common import is_fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: only the PyTorch twin is usable
    triton = None

# Two phases: tokens per program (one K and one V row of head_dim elements each) and
# warps; 32 tokens x 128 dims on 8 warps take ~115 registers a thread (64 tokens on 4
# warps spill). On an H200 it moves 3.95 TB/s (read, scratch write, scratch read, write).
COMPACT_TOKENS_PER_PROGRAM = 32
COMPACT_NUM_WARPS = 8
# Upper bound of the K/V scratch buffer (it holds at least one layer x head pair).
COMPACT_SCRATCH_BYTES = 256 << 20
# Single pass: tokens per tile and warps of the one program per (request, layer, head). Timed on an
# H200 (32 requests x 8 layers x 8 heads, keep 2,048 of 2,304, head_dim 128): 16 to 128 tokens on 4 or
# 8 warps all move 3.7-3.8 TB/s. Compiled for sm_90 (bf16, head_dim 128), 32 tokens on 8 warps take
# 128 registers a thread and no stack; 128 tokens on 8 warps (as the standard
# run once used) 255 registers and 656 bytes of spills, which leaves no room on the SM for decode kernels.
# A float8 cache (token-major values, scales in the same program; 64 requests x 36 layers x 8 heads, the
# rest as above, H200): 32-token tiles 8.5 ms, 64 9.4 ms, 128 8.6 ms (bf16 with 32: 9.9 ms).
SINGLE_PASS_TOKENS = 32
SINGLE_PASS_NUM_WARPS = 8


if triton is not None:

    @triton.jit(do_not_specialize=["block_table_stride", "active_stride", "kept_stride_req"])
    def _gather_kept_kernel(
        kv_ptr,
        v_ptr,
        score_ptr,
        kept_ptr,
        block_tables_ptr,
        kv_scratch_ptr,
        score_scratch_ptr,
        layer_head_begin,
        plane,
        num_layers,
        num_kv_heads,
        keep,
        kv_stride_layer,
        kv_stride_block,
        kv_stride_slot,
        kv_stride_head,
        v_stride_layer,
        v_stride_block,
        v_stride_slot,
        v_stride_head,
        v_stride_dim,
        score_stride_layer,
        score_stride_block,
        score_stride_slot,
        score_stride_head,
        kept_stride_req,
        kept_stride_layer,
        kept_stride_head,
        kept_stride_token,
        block_table_stride,
        active_ptr,
        active_stride,
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_T: tl.constexpr,
        GATHER_SCORES: tl.constexpr,
        HAS_ACTIVE: tl.constexpr,
    ):
        """Phase 1, one program per (token tile, layer x head of the chunk, request): kept
        rows -> scratch [2, R, chunk's layer x heads, keep, HEAD_DIM] (K and V planes
        `plane` elements apart), their scores -> score scratch [R, L, H, keep]."""
        tile = tl.program_id(0)
        local = tl.program_id(1)
        req = tl.program_id(2)
        if HAS_ACTIVE:
            if tl.load(active_ptr + req * active_stride) == 0:
                return
        layer_head = layer_head_begin + local
        layer = layer_head // num_kv_heads
        kv_head = layer_head % num_kv_heads

        tokens = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        token_mask = tokens < keep
        kept = tl.load(
            kept_ptr
            + req.to(tl.int64) * kept_stride_req
            + layer * kept_stride_layer
            + kv_head * kept_stride_head
            + tokens * kept_stride_token,
            mask=token_mask,
            other=0,
        )
        pages = tl.load(block_tables_ptr + req.to(tl.int64) * block_table_stride + kept // PAGE_SIZE, mask=token_mask)
        slots = kept % PAGE_SIZE
        src = (
            layer.to(tl.int64) * kv_stride_layer
            + pages.to(tl.int64) * kv_stride_block
            + slots * kv_stride_slot
            + kv_head * kv_stride_head
        )
        dims = tl.arange(0, HEAD_DIM)
        src_offsets = src[:, None] + dims[None, :]
        keys = tl.load(kv_ptr + src_offsets, mask=token_mask[:, None])
        v_src = (layer.to(tl.int64) * v_stride_layer + pages.to(tl.int64) * v_stride_block + slots * v_stride_slot
                 + kv_head * v_stride_head)
        values = tl.load(v_ptr + v_src[:, None] + dims[None, :] * v_stride_dim, mask=token_mask[:, None])

        row = (req.to(tl.int64) * tl.num_programs(1) + local) * keep + tokens
        dst_offsets = row[:, None] * HEAD_DIM + dims[None, :]
        tl.store(kv_scratch_ptr + dst_offsets, keys, mask=token_mask[:, None])
        tl.store(kv_scratch_ptr + plane + dst_offsets, values, mask=token_mask[:, None])
        if GATHER_SCORES:
            score_src = (
                layer.to(tl.int64) * score_stride_layer
                + pages.to(tl.int64) * score_stride_block
                + slots * score_stride_slot
                + kv_head * score_stride_head
            )
            scores = tl.load(score_ptr + score_src, mask=token_mask)
            score_row = ((req.to(tl.int64) * num_layers + layer) * num_kv_heads + kv_head) * keep + tokens
            tl.store(score_scratch_ptr + score_row, scores, mask=token_mask)

    @triton.jit(do_not_specialize=["target_table_stride", "active_stride", "new_scores_stride_req"])
    def _scatter_kept_kernel(
        kv_ptr,
        v_ptr,
        score_ptr,
        new_scores_ptr,
        target_tables_ptr,
        kv_scratch_ptr,
        layer_head_begin,
        plane,
        num_kv_heads,
        keep,
        kv_stride_layer,
        kv_stride_block,
        kv_stride_slot,
        kv_stride_head,
        v_stride_layer,
        v_stride_block,
        v_stride_slot,
        v_stride_head,
        v_stride_dim,
        score_stride_layer,
        score_stride_block,
        score_stride_slot,
        score_stride_head,
        new_scores_stride_req,
        new_scores_stride_layer,
        new_scores_stride_head,
        new_scores_stride_token,
        target_table_stride,
        active_ptr,
        active_stride,
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_T: tl.constexpr,
        WRITE_SCORES: tl.constexpr,
        HAS_ACTIVE: tl.constexpr,
    ):
        """Phase 2, one program per (token tile, layer x head of the chunk, request): scratch -> targets."""
        tile = tl.program_id(0)
        local = tl.program_id(1)
        req = tl.program_id(2)
        if HAS_ACTIVE:
            if tl.load(active_ptr + req * active_stride) == 0:
                return
        layer_head = layer_head_begin + local
        layer = layer_head // num_kv_heads
        kv_head = layer_head % num_kv_heads

        tokens = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        token_mask = tokens < keep
        dims = tl.arange(0, HEAD_DIM)
        row = (req.to(tl.int64) * tl.num_programs(1) + local) * keep + tokens
        src_offsets = row[:, None] * HEAD_DIM + dims[None, :]
        keys = tl.load(kv_scratch_ptr + src_offsets, mask=token_mask[:, None])
        values = tl.load(kv_scratch_ptr + plane + src_offsets, mask=token_mask[:, None])

        pages = tl.load(
            target_tables_ptr + req.to(tl.int64) * target_table_stride + tokens // PAGE_SIZE, mask=token_mask
        )
        slots = tokens % PAGE_SIZE
        dst = (
            layer.to(tl.int64) * kv_stride_layer
            + pages.to(tl.int64) * kv_stride_block
            + slots * kv_stride_slot
            + kv_head * kv_stride_head
        )
        dst_offsets = dst[:, None] + dims[None, :]
        tl.store(kv_ptr + dst_offsets, keys, mask=token_mask[:, None])
        v_dst = (layer.to(tl.int64) * v_stride_layer + pages.to(tl.int64) * v_stride_block + slots * v_stride_slot
                 + kv_head * v_stride_head)
        tl.store(v_ptr + v_dst[:, None] + dims[None, :] * v_stride_dim, values, mask=token_mask[:, None])
        if WRITE_SCORES:
            # new_scores is either the caller's tensor or phase 1's score scratch.
            scores = tl.load(
                new_scores_ptr
                + req.to(tl.int64) * new_scores_stride_req
                + layer * new_scores_stride_layer
                + kv_head * new_scores_stride_head
                + tokens * new_scores_stride_token,
                mask=token_mask,
            )
            score_dst = (
                layer.to(tl.int64) * score_stride_layer
                + pages.to(tl.int64) * score_stride_block
                + slots * score_stride_slot
                + kv_head * score_stride_head
            )
            tl.store(score_ptr + score_dst, scores, mask=token_mask)


if triton is not None:

    @triton.jit(do_not_specialize=[
        "block_table_stride", "target_table_stride", "active_stride", "kept_stride_req", "new_scores_stride_req"])
    def _compact_single_pass_kernel(
        kv_ptr,
        v_ptr,
        score_ptr,
        new_scores_ptr,
        kept_ptr,
        block_tables_ptr,
        target_tables_ptr,
        active_ptr,
        active_stride,
        num_kv_heads,
        keep,
        kv_stride_layer,
        kv_stride_block,
        kv_stride_slot,
        kv_stride_head,
        v_stride_layer,
        v_stride_block,
        v_stride_slot,
        v_stride_head,
        v_stride_dim,
        score_stride_layer,
        score_stride_block,
        score_stride_slot,
        score_stride_head,
        new_scores_stride_req,
        new_scores_stride_layer,
        new_scores_stride_head,
        new_scores_stride_token,
        kept_stride_req,
        kept_stride_layer,
        kept_stride_head,
        kept_stride_token,
        block_table_stride,
        target_table_stride,
        kv_scale_ptr,
        kv_scale_plane,
        kv_scale_stride_layer,
        kv_scale_stride_block,
        kv_scale_stride_slot,
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_T: tl.constexpr,
        SCORES: tl.constexpr,  # 0: none, 1: move the cached scores, 2: write new_scores
        HAS_ACTIVE: tl.constexpr,
        KV_SCALES: tl.constexpr,  # a float8 cache: its key and value scales move with the tokens
    ):
        """One program per (layer x head, request): the kept tokens, BLOCK_T at a time in
        ascending order, read then (after a barrier) written to their destinations."""
        layer_head = tl.program_id(0)
        req = tl.program_id(1)
        if HAS_ACTIVE:
            if tl.load(active_ptr + req * active_stride) == 0:
                return
        layer = layer_head // num_kv_heads
        kv_head = layer_head % num_kv_heads
        kept_row = (kept_ptr + req.to(tl.int64) * kept_stride_req + layer * kept_stride_layer
                    + kv_head * kept_stride_head)
        sources = block_tables_ptr + req.to(tl.int64) * block_table_stride
        targets = target_tables_ptr + req.to(tl.int64) * target_table_stride
        plane = layer.to(tl.int64) * kv_stride_layer + kv_head * kv_stride_head
        v_plane = layer.to(tl.int64) * v_stride_layer + kv_head * v_stride_head
        score_plane = layer.to(tl.int64) * score_stride_layer + kv_head * score_stride_head
        kv_scale_head = layer.to(tl.int64) * kv_scale_stride_layer + kv_head
        new_score_row = (new_scores_ptr + req.to(tl.int64) * new_scores_stride_req
                         + layer * new_scores_stride_layer + kv_head * new_scores_stride_head)
        dims = tl.arange(0, HEAD_DIM)
        for first in range(0, keep, BLOCK_T):
            tokens = first + tl.arange(0, BLOCK_T)
            token_mask = tokens < keep
            kept = tl.load(kept_row + tokens * kept_stride_token, mask=token_mask, other=0)
            pages = tl.load(sources + kept // PAGE_SIZE, mask=token_mask)
            slots = kept % PAGE_SIZE
            src = plane + pages.to(tl.int64) * kv_stride_block + slots * kv_stride_slot
            keys = tl.load(kv_ptr + src[:, None] + dims[None, :], mask=token_mask[:, None])
            v_src = v_plane + pages.to(tl.int64) * v_stride_block + slots * v_stride_slot
            values = tl.load(v_ptr + v_src[:, None] + dims[None, :] * v_stride_dim, mask=token_mask[:, None])
            if SCORES == 1:
                score_src = score_plane + pages.to(tl.int64) * score_stride_block + slots * score_stride_slot
                scores = tl.load(score_ptr + score_src, mask=token_mask)
            elif SCORES == 2:
                scores = tl.load(new_score_row + tokens * new_scores_stride_token, mask=token_mask)
            if KV_SCALES:
                scale_src = kv_scale_head + pages.to(tl.int64) * kv_scale_stride_block + slots * kv_scale_stride_slot
                key_scales = tl.load(kv_scale_ptr + scale_src, mask=token_mask)
                value_scales = tl.load(kv_scale_ptr + kv_scale_plane + scale_src, mask=token_mask)
            # Every thread's reads of this tile before any thread's writes: a destination
            # of this tile may be a source of the same tile (never of a later one).
            tl.debug_barrier()
            if BLOCK_T <= PAGE_SIZE:  # consecutive slots of one target block: stores of whole words
                dst_pages = tl.load(targets + first // PAGE_SIZE)
                dst_slots = first % PAGE_SIZE + tl.arange(0, BLOCK_T)
            else:
                dst_pages = tl.load(targets + tokens // PAGE_SIZE, mask=token_mask)
                dst_slots = tokens % PAGE_SIZE
            dst = plane + dst_pages.to(tl.int64) * kv_stride_block + dst_slots * kv_stride_slot
            tl.store(kv_ptr + dst[:, None] + dims[None, :], keys, mask=token_mask[:, None])
            v_dst = v_plane + dst_pages.to(tl.int64) * v_stride_block + dst_slots * v_stride_slot
            tl.store(v_ptr + v_dst[:, None] + dims[None, :] * v_stride_dim, values, mask=token_mask[:, None])
            if SCORES != 0:
                score_dst = score_plane + dst_pages.to(tl.int64) * score_stride_block + dst_slots * score_stride_slot
                tl.store(score_ptr + score_dst, scores, mask=token_mask)
            if KV_SCALES:
                scale_dst = (kv_scale_head + dst_pages.to(tl.int64) * kv_scale_stride_block
                             + dst_slots * kv_scale_stride_slot)
                tl.store(kv_scale_ptr + scale_dst, key_scales, mask=token_mask)
                tl.store(kv_scale_ptr + kv_scale_plane + scale_dst, value_scales, mask=token_mask)


def _planes(kv_group):
    """(keys, values) of a layer group: a [2, L, ...] tensor or a pair (``runner.kv_cache.KVCache``)."""
    return kv_group[0], kv_group[1]


def _check_args(kv_group, score_group, kept, new_scores, block_tables, target_tables, scale_group=None):
    keys, values = _planes(kv_group)
    assert keys.dim() == 5 and values.shape == keys.shape, "kv_group: keys and values, each [L, num_blocks, b, H, d]"
    num_layers, num_blocks, block_size, num_kv_heads, _ = keys.shape
    assert (scale_group is None) == (not is_fp8(keys.dtype)), "a float8 cache goes with its scales, and only it"
    if scale_group is not None:
        assert scale_group.shape == (2, *keys.shape[:4]) and scale_group.dtype == torch.float32
        assert scale_group.stride(4) == 1
    assert kept.dim() == 4 and kept.shape[1:3] == (num_layers, num_kv_heads)
    num_requests, _, _, keep = kept.shape
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_requests
    assert target_tables.dim() == 2 and target_tables.shape[0] == num_requests
    assert target_tables.shape[1] * block_size >= keep, "target_tables too narrow for keep tokens"
    if score_group is not None:
        assert score_group.shape == (num_layers, num_blocks, block_size, num_kv_heads)
    if new_scores is not None:
        assert score_group is not None, "new_scores without a score cache"
        assert new_scores.shape == kept.shape


def compact_kv(kv_group, score_group, kept, new_scores, block_tables, target_tables, *, single_pass=False,
               active=None, scale_group=None):
    """Move the kept tokens of every (request, layer, KV head) to their target slots.

    kv_group: the keys and values of a layer group, each [L, num_blocks, b, H, d]: a
    [2, L, num_blocks, b, H, d] tensor or a pair of tensors (the keys with a
    contiguous last dimension, the values with any strides: a float8 cache stores
    them token-major); score_group: [L, num_blocks, b, H]
    float32 score cache or None; kept: int64 [R, L, H, keep], ascending indices
    into each request's current KV order (< its length); new_scores: float32
    [R, L, H, keep], the scores stored with the kept tokens, or None to move the
    tokens' current scores (when there is a score cache); block_tables: int32
    [R, >= pages in use] (sources); target_tables: int32 [R, T], T * b >= keep.
    Token kept[r, l, h, j] goes to position j: block target_tables[r, j // b],
    offset j % b. Targets may overlap the sources; slots past keep in the last
    target block are left untouched.

    single_pass: the caller guarantees that every target block is the request's
    own source block at the same index or a block no request of the batch reads
    (see the module docstring); half the memory traffic. active: [R] flags (any
    integer or bool dtype, any stride), requests with 0 are skipped (the padding
    rows of a captured batch), or None for all. scale_group: [2, L, num_blocks, b, H]
    float32 scales of a float8 kv_group (required with one, moved with its tokens).
    """
    _check_args(kv_group, score_group, kept, new_scores, block_tables, target_tables, scale_group)
    if scale_group is not None and not single_pass:  # two phases: the scales in a launch of their own
        compact_kv(scale_group[..., None], None, kept, None, block_tables, target_tables, active=active)
    keys, values = _planes(kv_group)
    if scale_group is not None:  # moved as bytes
        keys, values = keys.view(torch.uint8), values.view(torch.uint8)
    num_layers, _, block_size, num_kv_heads, head_dim = keys.shape
    num_requests, _, _, keep = kept.shape
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert keys.stride(4) == 1 and block_tables.stride(1) == 1 and target_tables.stride(1) == 1
    assert active is None or active.shape == (num_requests,)
    if num_requests == 0 or keep == 0:
        return

    device = keys.device
    kv_strides = (*keys.stride()[:4], *values.stride())
    score_args = score_group if score_group is not None else keys  # unused without scores
    score_strides = score_group.stride() if score_group is not None else (0, 0, 0, 0)
    active_args = (active, active.stride(0)) if active is not None else (kept, 0)  # unused without flags
    num_layer_heads = num_layers * num_kv_heads

    if single_pass:
        scores_mode = 0 if score_group is None else (1 if new_scores is None else 2)
        new_score_args = new_scores if new_scores is not None else kept  # unused unless mode 2
        new_score_strides = new_scores.stride() if new_scores is not None else (0, 0, 0, 0)
        block_t = min(SINGLE_PASS_TOKENS, max(16, triton.next_power_of_2(keep)))
        scale_args = (scale_group, scale_group.stride(0), *scale_group.stride()[1:4]) if scale_group is not None \
            else (kept, 0, 0, 0, 0)  # unused without scales
        _compact_single_pass_kernel[(num_layer_heads, num_requests)](
            keys, values, score_args, new_score_args, kept, block_tables, target_tables, *active_args,
            num_kv_heads, keep, *kv_strides, *score_strides, *new_score_strides, *kept.stride(),
            block_tables.stride(0), target_tables.stride(0), *scale_args,
            PAGE_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_T=block_t, SCORES=scores_mode,
            HAS_ACTIVE=active is not None, KV_SCALES=scale_group is not None, num_warps=SINGLE_PASS_NUM_WARPS,
            num_stages=1,
        )  # fmt: skip
        return

    # Hazards only exist within one (layer, head) plane of the caches, so the work
    # is split into chunks of layer x head pairs whose scratch stays within
    # COMPACT_SCRATCH_BYTES; within a chunk all requests go together (a request's
    # target block may be another request's source block).
    bytes_per_layer_head = 2 * num_requests * keep * head_dim * keys.element_size()
    chunk = max(1, min(num_layer_heads, COMPACT_SCRATCH_BYTES // bytes_per_layer_head))
    kv_scratch = torch.empty(2, num_requests, chunk, keep, head_dim, dtype=keys.dtype, device=device)
    move_scores = score_group is not None and new_scores is None
    if move_scores:
        score_scratch = torch.empty(num_requests, num_layers, num_kv_heads, keep, dtype=score_group.dtype,
                                    device=device)
        new_scores = score_scratch
    else:
        score_scratch = kv_scratch  # unused
    new_score_strides = new_scores.stride() if new_scores is not None else (0, 0, 0, 0)
    new_score_args = new_scores if new_scores is not None else kv_scratch  # unused without scores

    block_t = min(COMPACT_TOKENS_PER_PROGRAM, max(16, triton.next_power_of_2(keep)))
    for begin in range(0, num_layer_heads, chunk):
        grid = (triton.cdiv(keep, block_t), min(chunk, num_layer_heads - begin), num_requests)
        _gather_kept_kernel[grid](
            keys, values, score_args, kept, block_tables, kv_scratch, score_scratch,
            begin, kv_scratch.stride(0), num_layers, num_kv_heads, keep,
            *kv_strides, *score_strides, *kept.stride(), block_tables.stride(0), *active_args,
            PAGE_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_T=block_t, GATHER_SCORES=move_scores,
            HAS_ACTIVE=active is not None, num_warps=COMPACT_NUM_WARPS,
        )  # fmt: skip
        _scatter_kept_kernel[grid](
            keys, values, score_args, new_score_args, target_tables, kv_scratch,
            begin, kv_scratch.stride(0), num_kv_heads, keep,
            *kv_strides, *score_strides, *new_score_strides, target_tables.stride(0), *active_args,
            PAGE_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_T=block_t, WRITE_SCORES=score_group is not None,
            HAS_ACTIVE=active is not None, num_warps=COMPACT_NUM_WARPS,
        )  # fmt: skip


def compact_kv_torch(kv_group, score_group, kept, new_scores, block_tables, target_tables, *, single_pass=False,
                     active=None, scale_group=None):
    """PyTorch twin of compact_kv (same arguments and semantics), always gather-then-write."""
    _check_args(kv_group, score_group, kept, new_scores, block_tables, target_tables, scale_group)
    if scale_group is not None:
        compact_kv_torch(scale_group[..., None], None, kept, None, block_tables, target_tables, active=active)
    keys, values = _planes(kv_group)
    if scale_group is not None:  # moved as bytes
        keys, values = keys.view(torch.uint8), values.view(torch.uint8)
    if active is not None:
        rows = active.to(device=kept.device, dtype=torch.bool).nonzero().flatten()
        kept, block_tables, target_tables = kept[rows], block_tables[rows], target_tables[rows]
        new_scores = new_scores[rows] if new_scores is not None else None
    num_layers, _, block_size, num_kv_heads, _ = keys.shape
    num_requests, _, _, keep = kept.shape
    if num_requests == 0 or keep == 0:
        return
    device = keys.device
    req = torch.arange(num_requests, device=device).view(-1, 1, 1, 1)
    layer = torch.arange(num_layers, device=device).view(1, -1, 1, 1)
    head = torch.arange(num_kv_heads, device=device).view(1, 1, -1, 1)
    kept = kept.to(device=device, dtype=torch.int64)
    src_blocks = block_tables.to(device=device, dtype=torch.int64)[req, kept // block_size]  # [R, L, H, keep]
    src_slots = kept % block_size
    positions = torch.arange(keep, device=device)
    dst_blocks = target_tables.to(device=device, dtype=torch.int64)[:, positions // block_size].view(
        num_requests, 1, 1, keep
    )
    dst_slots = positions % block_size

    # Phase 1: gather (advanced indexing copies), phase 2: write through the views.
    rows = [plane[layer, src_blocks, src_slots, head] for plane in (keys, values)]  # [R, L, H, keep, d] each
    if score_group is not None:
        scores = score_group[layer, src_blocks, src_slots, head] if new_scores is None else new_scores
        score_group[layer, dst_blocks, dst_slots, head] = scores.to(score_group.dtype)
    for plane, plane_rows in zip((keys, values), rows):
        plane[layer, dst_blocks, dst_slots, head] = plane_rows
