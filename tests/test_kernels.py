"""Tests of the KV-cache and attention kernels against float64 references.

The Triton kernels run on CPU tensors under Triton's interpreter, which reads
TRITON_INTERPRET when the kernels are decorated, i.e. at import time.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # TRITON_INTERPRET=0: the compiled kernels (a GPU run of the cuda tests)

import itertools  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from zipage.kernels.paged_decode import paged_decode_attention, paged_decode_attention_torch  # noqa: E402
from zipage.kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_torch  # noqa: E402
from zipage.kernels.store_kv import store_kv, store_kv_torch  # noqa: E402
from tests.conftest import assert_close, relative_error, require_triton  # noqa: E402

HEAD_DIM = 32
NUM_KV_HEADS = 2
TWIN_TOLERANCE = 1e-5
TRITON_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3}




# ---------------------------------------------------------------- references


def gather_tokens(cache, block_table_row, length):
    """[length, kv_heads, head_dim] float64, one slot lookup per token."""
    block_size = cache.shape[1]
    tokens = [cache[int(block_table_row[t // block_size]), t % block_size] for t in range(length)]
    return torch.stack(tokens).double()


def attend(query, keys, values, scale):
    """Softmax attention of one query vector over [n, head_dim] keys / values."""
    scores = keys @ query * scale
    weights = torch.exp(scores - scores.max())
    return (weights / weights.sum()) @ values


def reference_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    batch, num_heads, head_dim = q.shape
    group_size = num_heads // k_cache.shape[2]
    out = torch.zeros(batch, num_heads, head_dim, dtype=torch.float64)
    for seq in range(batch):
        length = int(context_lens[seq])
        if length == 0:
            continue
        keys = gather_tokens(k_cache, block_tables[seq], length)
        values = gather_tokens(v_cache, block_tables[seq], length)
        for head in range(num_heads):
            kv_head = head // group_size
            out[seq, head] = attend(q[seq, head].double(), keys[:, kv_head], values[:, kv_head], scale)
    return out


def reference_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    total_q, num_heads, head_dim = q.shape
    group_size = num_heads // k_cache.shape[2]
    out = torch.zeros(total_q, num_heads, head_dim, dtype=torch.float64)
    for seq in range(len(context_lens)):
        q_begin, q_end = int(cu_seqlens_q[seq]), int(cu_seqlens_q[seq + 1])
        length = int(context_lens[seq])
        keys = gather_tokens(k_cache, block_tables[seq], length)
        values = gather_tokens(v_cache, block_tables[seq], length)
        for row in range(q_begin, q_end):
            position = length - (q_end - q_begin) + (row - q_begin)
            for head in range(num_heads):
                kv_head = head // group_size
                visible = slice(0, position + 1)
                out[row, head] = attend(
                    q[row, head].double(), keys[visible, kv_head], values[visible, kv_head], scale
                )
    return out


# ---------------------------------------------------------------- inputs


def make_paged_kv(context_lens, block_size, dtype, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM):
    """Random caches and a block table with permuted physical blocks.

    Slots no sequence owns (spare blocks, the tail of a partly filled page)
    hold NaN, and unused block-table entries hold garbage (-1, out-of-range
    and valid-looking ids), so reading anything outside a context shows up.
    The block table is a column slice of a wider buffer (row stride != width).
    """
    pages_per_seq = [math.ceil(length / block_size) for length in context_lens]
    num_blocks = sum(pages_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    columns = max(pages_per_seq) + 2
    buffer = torch.randint(-1, num_blocks + 100, (len(context_lens), columns + 3), dtype=torch.int32)
    block_tables = buffer[:, 1 : columns + 1]
    physical_blocks = torch.randperm(num_blocks).tolist()
    for seq, (length, num_pages) in enumerate(zip(context_lens, pages_per_seq)):
        pages = [physical_blocks.pop() for _ in range(num_pages)]
        block_tables[seq, :num_pages] = torch.tensor(pages, dtype=torch.int32)
        for cache in (k_cache, v_cache):
            cache[pages] = torch.randn(num_pages, block_size, num_kv_heads, head_dim).to(dtype)
            if length % block_size:
                cache[pages[-1], length % block_size :] = float("nan")
    return k_cache, v_cache, block_tables


def make_queries(num_rows, num_heads, dtype, head_dim=HEAD_DIM):
    """Queries as a strided view (head slice of a wider projection output)."""
    return torch.randn(num_rows, num_heads + 2, head_dim).to(dtype)[:, 1 : num_heads + 1]


def decode_lengths(block_size):
    """Single token, empty (padding row), partial last page, exact multiple, many pages."""
    return [1, block_size + 5, 0, 2 * block_size, 3 * block_size + 7]


def make_decode_inputs(group_size, block_size, dtype):
    context_lens = decode_lengths(block_size)
    k_cache, v_cache, block_tables = make_paged_kv(context_lens, block_size, dtype)
    q = make_queries(len(context_lens), NUM_KV_HEADS * group_size, dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32)


def prefill_shapes(block_size, with_prefix):
    """(q_len, context_len) per sequence; several span more than one query tile."""
    if with_prefix:
        return [(1, 2 * block_size + 1), (5, 3 * block_size), (10, 100), (block_size, 2 * block_size), (150, 160)]
    return [(1, 1), (block_size + 3, block_size + 3), (2 * block_size, 2 * block_size), (140, 140)]


def make_prefill_inputs(group_size, block_size, with_prefix, dtype):
    shapes = prefill_shapes(block_size, with_prefix)
    q_lens = [q_len for q_len, _ in shapes]
    context_lens = [length for _, length in shapes]
    k_cache, v_cache, block_tables = make_paged_kv(context_lens, block_size, dtype)
    q = make_queries(sum(q_lens), NUM_KV_HEADS * group_size, dtype)
    cu_seqlens_q = torch.tensor(list(itertools.accumulate(q_lens, initial=0)), dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, cu_seqlens_q, torch.tensor(context_lens, dtype=torch.int32), max(q_lens)


# ---------------------------------------------------------------- store_kv


def make_store_inputs(dtype, slot_dtype):
    num_tokens, num_heads, block_size = 7, 4, 16
    k_cache = torch.randn(5, block_size, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    v_cache = torch.randn(5, block_size, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    # key / value as slices of a fused qkv projection output.
    qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * HEAD_DIM).to(dtype)
    key_begin = num_heads * HEAD_DIM
    value_begin = key_begin + NUM_KV_HEADS * HEAD_DIM
    key = qkv[:, key_begin:value_begin].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, value_begin:].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.randperm(k_cache.shape[0] * block_size)[:num_tokens]
    slots[[2, 5]] = -1  # padding rows
    return key, value, k_cache, v_cache, slots.to(slot_dtype)


def expected_after_store(key, value, k_cache, v_cache, slots):
    block_size = k_cache.shape[1]
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expected[slot // block_size, slot % block_size] = key[token]
            v_expected[slot // block_size, slot % block_size] = value[token]
    return k_expected, v_expected


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv(use_triton, slot_dtype, dtype):
    if use_triton:
        require_triton()
    key, value, k_cache, v_cache, slots = make_store_inputs(dtype, slot_dtype)
    k_expected, v_expected = expected_after_store(key, value, k_cache, v_cache, slots)
    result = (store_kv if use_triton else store_kv_torch)(key, value, k_cache, v_cache, slots)
    assert result is None
    # Exact: written slots hold the new rows, every other slot is untouched.
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_with_queries(use_triton, dtype):
    """With compression the same launch writes each token's query heads to its window row
    (rows outside a window name the spare last row), padding rows' keys still skipped."""
    if use_triton:
        require_triton()
    num_heads, window, slots_count = 4, 3, 2
    key, value, k_cache, v_cache, slots = make_store_inputs(dtype, torch.int64)
    num_tokens = key.shape[0]
    qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * HEAD_DIM).to(dtype)
    query = qkv[:, :num_heads * HEAD_DIM].view(num_tokens, num_heads, HEAD_DIM)  # strided, like the model's
    query_cache = torch.randn(slots_count * window + 1, num_heads, HEAD_DIM).to(dtype)
    spare = slots_count * window
    rows = torch.tensor([4, spare, 0, 5, spare, 2, spare])
    k_expected, v_expected = expected_after_store(key, value, k_cache, v_cache, slots)
    q_expected = query_cache.clone()
    for token, row in enumerate(rows.tolist()):
        q_expected[row] = query[token]
    (store_kv if use_triton else store_kv_torch)(key, value, k_cache, v_cache, slots, query, query_cache, rows)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    # the spare row takes whichever of its tokens came last; every other row is exact
    assert torch.equal(query_cache[:spare], q_expected[:spare])
    assert any(torch.equal(query_cache[spare], query[t]) for t in range(num_tokens) if rows[t] == spare)


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_decode_torch_twin(group_size, block_size):
    q, k_cache, v_cache, block_tables, context_lens = make_decode_inputs(group_size, block_size, torch.float32)
    scale = HEAD_DIM**-0.5
    out = paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, reference_decode(q, k_cache, v_cache, block_tables, context_lens, scale), TWIN_TOLERANCE)
    assert torch.all(out[2] == 0)  # context_len 0


# (num_splits, min_split_tokens): the defaults; every tile its own split (the merge for
# each sequence of several tiles); and a mix where, with 128-token tiles, the longest
# sequence merges two splits while the others write their output directly.
@pytest.mark.parametrize("splits", [(None, None), (2, 1), (5, 1), (5, 256)],
                         ids=["auto-splits", "2-splits", "5-splits", "5-splits-min-256"])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_decode_triton(group_size, block_size, splits):
    require_triton()
    q, k_cache, v_cache, block_tables, context_lens = make_decode_inputs(group_size, block_size, torch.float32)
    scale = HEAD_DIM**-0.5
    out = torch.full_like(q, float("nan"))
    num_splits, min_split_tokens = splits
    result = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out=out,
                                    num_splits=num_splits, min_split_tokens=min_split_tokens)
    assert result is out
    ref = reference_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    assert_close(out, ref, TRITON_TOLERANCE[torch.float32])
    assert torch.all(out[2] == 0)  # context_len 0


@pytest.mark.parametrize("num_splits", [1, 3], ids=["1-split", "3-splits"])
def test_decode_triton_float16(num_splits):
    require_triton()
    q, k_cache, v_cache, block_tables, context_lens = make_decode_inputs(4, 16, torch.float16)
    scale = HEAD_DIM**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=num_splits,
                                 min_split_tokens=1)
    assert out.dtype == torch.float16
    ref = reference_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    assert_close(out, ref, TRITON_TOLERANCE[torch.float16])
    assert torch.all(out[2] == 0)


# ---------------------------------------------------------------- prefill


@pytest.mark.parametrize("with_prefix", [False, True], ids=["no-prefix", "prefix"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_prefill_torch_twin(group_size, block_size, with_prefix):
    inputs = make_prefill_inputs(group_size, block_size, with_prefix, torch.float32)
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q = inputs
    scale = HEAD_DIM**-0.5
    out = paged_prefill_attention_torch(*inputs, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    ref = reference_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
    assert_close(out, ref, TWIN_TOLERANCE)


@pytest.mark.parametrize("with_prefix", [False, True], ids=["no-prefix", "prefix"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_prefill_triton(group_size, block_size, with_prefix):
    require_triton()
    inputs = make_prefill_inputs(group_size, block_size, with_prefix, torch.float32)
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q = inputs
    scale = HEAD_DIM**-0.5
    out = paged_prefill_attention(*inputs, scale)
    ref = reference_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
    assert_close(out, ref, TRITON_TOLERANCE[torch.float32])


def test_prefill_triton_float16():
    require_triton()
    inputs = make_prefill_inputs(2, 16, True, torch.float16)
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q = inputs
    scale = HEAD_DIM**-0.5
    out = paged_prefill_attention(*inputs, scale)
    assert out.dtype == torch.float16
    ref = reference_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
    assert_close(out, ref, TRITON_TOLERANCE[torch.float16])


def test_dense_causal_attention_matches_per_head_softmax():
    """The memory-profiling attention (packed sequences, grouped KV heads) against an explicit softmax."""
    from zipage.attention.backend import dense_causal_attention

    gen = torch.Generator().manual_seed(3)
    lens, heads, kv_heads, dim, scale = [5, 9], 4, 2, 8, 0.3
    q = torch.randn(sum(lens), heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(lens), kv_heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(lens), kv_heads, dim, generator=gen, dtype=torch.float64)
    out = dense_causal_attention(q, k, v, [0, 5, 14], scale)
    start = 0
    for n in lens:
        for h in range(heads):
            qs, ks, vs = q[start:start + n, h], k[start:start + n, h // 2], v[start:start + n, h // 2]
            scores = (qs @ ks.T * scale).masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
            torch.testing.assert_close(out[start:start + n, h], scores.softmax(-1) @ vs)
        start += n


@pytest.mark.parametrize("block_size,heads,kv_heads", [(16, 4, 2), (8, 6, 1), (32, 4, 4)])
def test_cpu_decode_attention_matches_the_float64_twin(block_size, heads, kv_heads):
    """The CPU backend's SDPA decode path against the reference twin in float64."""
    from zipage.attention.torch_backend import paged_decode_attention_sdpa

    gen = torch.Generator().manual_seed(block_size + heads)
    batch, dim, num_blocks = 5, 16, 40
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    block_tables = torch.randperm(num_blocks, generator=gen)[:batch * 6].view(batch, 6).int()
    context_lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 2, 6 * block_size]).int()
    q = torch.randn(batch, heads, dim, generator=gen)
    got = paged_decode_attention_sdpa(q, k_cache, v_cache, block_tables, context_lens, 0.3)
    want = paged_decode_attention_torch(q.double(), k_cache.double(), v_cache.double(), block_tables,
                                        context_lens, 0.3)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
