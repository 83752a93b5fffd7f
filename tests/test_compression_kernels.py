"""Tests of the KV-compression kernels (scores, redundancy sums, compaction).

Each Triton kernel is checked against its PyTorch twin and against a float64
reference written here straight from the scoring specification (one request,
layer, head, window row and token at a time); each twin against the reference
too. The Triton kernels run on CPU tensors under Triton's interpreter, which reads
TRITON_INTERPRET when the kernels are decorated, i.e. at import time.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # TRITON_INTERPRET=0: the compiled kernels (a GPU run of the cuda tests)

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import zipage.kernels.compact_kv as compact_kv_module  # noqa: E402
from tests.conftest import assert_close, relative_error, require_triton  # noqa: E402
import zipage.kernels.compress_scores as compress_scores_module  # noqa: E402
from zipage.kernels.choose_kept import choose_kept  # noqa: E402
from zipage.kernels.compact_kv import compact_kv, compact_kv_torch  # noqa: E402
from zipage.kernels.compress_scores import (  # noqa: E402
    gather_keys,
    paged_attention_scores,
    paged_attention_scores_torch,
    paged_redundancy_sums,
    paged_redundancy_sums_torch,
)

HEAD_DIM = 32
NUM_LAYERS = 2  # layers of the group; the cache holds one more (layer 0) outside it
NUM_KV_HEADS = 2
WINDOW = 8
EPS = 1e-6
TWIN_TOLERANCE = 1e-5
TRITON_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-3}
RSUM_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-3}  # max abs error of rsum
THRESHOLD_MARGIN = 2e-4  # no considered similarity lies closer than this to the threshold




def assert_padding_zero(out, lengths):
    for r, length in enumerate(lengths.tolist()):
        assert torch.all(out[r, :, :, length:] == 0), f"request {r}: padding is not exactly 0"


# ---------------------------------------------------------------- inputs


def make_group_cache(lengths, block_size, dtype, head_dim=HEAD_DIM, spare_blocks=4, seed=0):
    """A KV cache [2, NUM_LAYERS + 1, blocks, b, H, d] whose layers 1.. are the group.

    Requests own permuted physical blocks; every slot no request owns (spare
    blocks, the tail of a partial last block) holds NaN, and unused block-table
    columns hold garbage (-1, out-of-range and valid-looking ids). The block table
    is a column slice of a wider buffer (row stride != width).
    Returns (kv_group view, block_tables, lengths int64 (a strided column), spare block ids).
    """
    generator = torch.Generator().manual_seed(seed)
    pages_per_req = [math.ceil(length / block_size) for length in lengths]
    num_blocks = sum(pages_per_req) + spare_blocks
    shape = (2, NUM_LAYERS + 1, num_blocks, block_size, NUM_KV_HEADS, head_dim)
    kv = torch.full(shape, float("nan"), dtype=dtype)
    columns = max(pages_per_req) + 2
    buffer = torch.randint(-1, num_blocks + 100, (len(lengths), columns + 3), dtype=torch.int32, generator=generator)
    block_tables = buffer[:, 1 : columns + 1]
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    for r, (length, num_pages) in enumerate(zip(lengths, pages_per_req)):
        pages = [physical.pop() for _ in range(num_pages)]
        block_tables[r, :num_pages] = torch.tensor(pages, dtype=torch.int32)
        data = torch.randn(2, NUM_LAYERS + 1, num_pages, block_size, NUM_KV_HEADS, head_dim, generator=generator)
        kv[:, :, pages] = data.to(dtype)
        if length % block_size:
            kv[:, :, pages[-1], length % block_size :] = float("nan")
    # Lengths as the engine passes them: one int64 column of a wider packed array, whose other
    # columns hold values a kernel that ignored the stride would read instead.
    packed = torch.full((len(lengths), 5), 10**6, dtype=torch.int64)
    packed[:, 2] = torch.tensor(lengths)
    return kv[:, 1:], block_tables, packed[:, 2], physical


def token_slot(block_tables, r, j, block_size):
    return int(block_tables[r, j // block_size]), j % block_size


def add_duplicate_keys(k_cache, block_tables, lengths, seed=1):
    """Exact and near copies of keys inside blocks (and one across blocks), so that
    m*(n) picks the most recent copy and the exclusion of s(n, m*(n)) matters."""
    generator = torch.Generator().manual_seed(seed)
    num_layers, _, block_size, num_kv_heads, _ = k_cache.shape
    for r, length in enumerate(lengths.tolist()):
        for begin in range(0, length, block_size):
            count = min(block_size, length - begin)
            if count < 4:
                continue
            for layer in range(num_layers):
                for head in range(num_kv_heads):
                    a, c1, c2, e = (begin + int(x) for x in torch.randperm(count, generator=generator)[:4])
                    a, c1, c2 = sorted((a, c1, c2))

                    def key(j):
                        block, slot = token_slot(block_tables, r, j, block_size)
                        return k_cache[layer, block, slot, head]

                    key(c1).copy_(key(a))  # exact copy
                    key(c2).copy_(key(a) * 2)  # scaled copy: cosine 1
                    noise = torch.randn(key(e).shape, generator=generator).to(k_cache.dtype)
                    key(e).copy_(key(a) + 0.05 * noise)  # near copy
        if length > block_size + 1:  # a copy in the next block is no partner
            for layer in range(num_layers):
                block0, slot0 = token_slot(block_tables, r, 0, block_size)
                block1, slot1 = token_slot(block_tables, r, block_size + 1, block_size)
                k_cache[layer, block1, slot1] = k_cache[layer, block0, slot0]


def make_queries(num_requests, group_size, window, dtype, seed=2):
    generator = torch.Generator().manual_seed(seed)
    shape = (num_requests, NUM_LAYERS, window, NUM_KV_HEADS * group_size, HEAD_DIM)
    return torch.randn(shape, generator=generator).to(dtype)


def score_lengths(block_size, window):
    """n_r == w, one block + 1, an exact multiple of b, a partial last block."""
    return [window, block_size + 1, 2 * block_size, 3 * block_size + 5 if block_size < 32 else 2 * block_size + 7]


# ---------------------------------------------------------------- references


def reference_keys(k_cache, block_tables, r, layer, head, length):
    """[length, d] float64: token j read from block block_tables[r, j // b], offset j % b."""
    block_size = k_cache.shape[2]
    rows = []
    for j in range(length):
        block, slot = token_slot(block_tables, r, j, block_size)
        rows.append(k_cache[layer, block, slot, head].double())
    return torch.stack(rows)


def reference_attention(queries, k_cache, block_tables, lengths, scale, n_max):
    """A of the spec, step 1, in float64."""
    num_requests, num_layers, window, num_heads, _ = queries.shape
    num_kv_heads = k_cache.shape[3]
    group_size = num_heads // num_kv_heads
    out = torch.zeros(num_requests, num_layers, num_kv_heads, n_max, dtype=torch.float64)
    for r, length in enumerate(lengths.tolist()):
        for layer in range(num_layers):
            for h in range(num_kv_heads):
                keys = reference_keys(k_cache, block_tables, r, layer, h, length)
                for i in range(window):
                    last = length - window + i  # window row i is token n - w + i
                    best = torch.zeros(length, dtype=torch.float64)
                    for g in range(group_size):
                        q = queries[r, layer, i, h * group_size + g].double()
                        probs = torch.softmax(keys[: last + 1] @ q * scale, dim=0)
                        best[: last + 1] = torch.maximum(best[: last + 1], probs)
                    out[r, layer, h, :length] += best / window
    return out


def reference_similarities(k_cache, block_tables, lengths):
    """{(r, layer, head, block begin): float64 cosine similarities of the block's valid keys}."""
    num_layers, _, block_size, num_kv_heads, _ = k_cache.shape
    sims = {}
    for r, length in enumerate(lengths.tolist()):
        for layer in range(num_layers):
            for h in range(num_kv_heads):
                keys = reference_keys(k_cache, block_tables, r, layer, h, length)
                for begin in range(0, length, block_size):
                    block_keys = keys[begin : begin + block_size]
                    unit = block_keys / block_keys.norm(dim=1, keepdim=True).clamp_min(EPS)
                    sims[r, layer, h, begin] = unit @ unit.T
    return sims


def reference_rsum(sims, threshold, shape):
    """Lightning rsum of the spec, step 4, in float64; also the smallest |s - threshold|."""
    out = torch.zeros(shape, dtype=torch.float64)
    margin = math.inf
    for (r, layer, h, begin), s in sims.items():
        count = s.shape[0]
        latest = []  # m*(n), block-local
        for n in range(count):
            above = [m for m in range(count) if m != n and s[n, m] > threshold]
            latest.append(max(above) if above else None)
            for m in range(count):
                if m != n:
                    margin = min(margin, abs(float(s[n, m]) - threshold))
        for m in range(count):
            total = sum(float(s[n, m]) for n in range(count) if n != m)
            total -= sum(float(s[n, m]) for n in range(count) if latest[n] == m)
            out[r, layer, h, begin + m] = total
    return out, margin


def pick_threshold(sims, low, high):
    """The threshold in [low, high] farthest from every considered similarity."""
    values = torch.cat([s[~torch.eye(s.shape[0], dtype=torch.bool)] for s in sims.values()])
    candidates = torch.linspace(low, high, 201, dtype=torch.float64)
    distance = (values[None, :] - candidates[:, None]).abs().amin(1)
    return float(candidates[distance.argmax()])


# ---------------------------------------------------------------- gather_keys


def test_gather_keys():
    kv_group, block_tables, lengths, _ = make_group_cache([5, 16, 37], 16, torch.float32)
    k_cache = kv_group[0]
    n_max = 40
    keys = gather_keys(k_cache, block_tables, lengths, n_max)
    assert keys.shape == (3, NUM_LAYERS, NUM_KV_HEADS, n_max, HEAD_DIM) and keys.dtype == k_cache.dtype
    for r, length in enumerate(lengths.tolist()):
        for layer in range(NUM_LAYERS):
            for h in range(NUM_KV_HEADS):
                ref = reference_keys(k_cache, block_tables, r, layer, h, length)
                assert torch.equal(keys[r, layer, h, :length].double(), ref)
        assert torch.all(keys[r, :, :, length:] == 0)
    # A score cache [L, blocks, b, H] gathers as head_dim 1.
    scores = k_cache[..., 0].contiguous()
    gathered = gather_keys(scores.unsqueeze(-1), block_tables, lengths, n_max).squeeze(-1)
    assert torch.equal(gathered, keys[..., 0])


# ---------------------------------------------------------------- attention scores


def attention_inputs(group_size, block_size, dtype, window=WINDOW, extra_padding=0):
    lengths = score_lengths(block_size, window)
    kv_group, block_tables, lengths, _ = make_group_cache(lengths, block_size, dtype)
    queries = make_queries(len(lengths), group_size, window, dtype)
    n_max = int(lengths.max()) + extra_padding
    return queries, kv_group[0], block_tables, lengths, HEAD_DIM**-0.5, n_max


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_attention_scores_torch_twin(group_size, block_size):
    inputs = attention_inputs(group_size, block_size, torch.float32)
    out = paged_attention_scores_torch(*inputs)
    assert out.dtype == torch.float32 and out.shape == (4, NUM_LAYERS, NUM_KV_HEADS, inputs[-1])
    assert_close(out, reference_attention(*inputs), TWIN_TOLERANCE)
    assert_padding_zero(out, inputs[3])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group_size", [1, 2, 3, 4])
def test_attention_scores_triton(group_size, block_size):
    require_triton()
    inputs = attention_inputs(group_size, block_size, torch.float32, extra_padding=block_size + 3)
    out = torch.full((4, NUM_LAYERS, NUM_KV_HEADS, inputs[-1]), float("nan"))
    result = paged_attention_scores(*inputs, out=out)
    assert result is out
    assert_close(out, reference_attention(*inputs), TRITON_TOLERANCE[torch.float32])
    assert_close(out, paged_attention_scores_torch(*inputs).double(), TRITON_TOLERANCE[torch.float32])
    assert_padding_zero(out, inputs[3])


@pytest.mark.parametrize(
    "window, group_size, num_splits, window_chunk, block_size",
    [(5, 2, 3, None, 16), (WINDOW, 4, 2, 2, 16), (5, 1, 1, 16, 16), (WINDOW, 2, 4, None, 32)],
    ids=["w5-3-splits", "2-splits-2-row-chunks", "w5-chunk16", "small-tiles-4-splits"],
)
def test_attention_scores_triton_splits(window, group_size, num_splits, window_chunk, block_size, monkeypatch):
    """Pass 1 split along the keys, the window rows spread over several chunks, and
    (b = 32) key tiles of 16 tokens, smaller than a block."""
    require_triton()
    if block_size == 32:
        monkeypatch.setattr(compress_scores_module, "SCORE_TILE_ELEMENTS", 16 * 16)
    inputs = attention_inputs(group_size, block_size, torch.float32, window=window, extra_padding=1)
    out = paged_attention_scores(*inputs, num_splits=num_splits, window_chunk=window_chunk)
    assert_close(out, reference_attention(*inputs), TRITON_TOLERANCE[torch.float32])
    assert_padding_zero(out, inputs[3])


def test_attention_scores_triton_float16():
    require_triton()
    inputs = attention_inputs(4, 16, torch.float16)
    out = paged_attention_scores(*inputs)
    assert out.dtype == torch.float32
    assert_close(out, reference_attention(*inputs), TRITON_TOLERANCE[torch.float16])
    assert_padding_zero(out, inputs[3])


# ---------------------------------------------------------------- redundancy sums


def redundancy_inputs(block_size, dtype, threshold, extra_padding=0):
    """Keys with duplicates and a threshold with no similarity near it."""
    lengths = score_lengths(block_size, WINDOW if block_size >= WINDOW else block_size)
    kv_group, block_tables, lengths, _ = make_group_cache(lengths, block_size, dtype)
    k_cache = kv_group[0]
    add_duplicate_keys(k_cache, block_tables, lengths)
    sims = reference_similarities(k_cache, block_tables, lengths)
    if threshold == "random":  # between random keys' similarities
        threshold = pick_threshold(sims, 0.2, 0.45)
    n_max = int(lengths.max()) + extra_padding
    ref, margin = reference_rsum(sims, threshold, (len(lengths), NUM_LAYERS, NUM_KV_HEADS, n_max))
    assert margin > THRESHOLD_MARGIN, f"a similarity lies {margin:.2g} from the threshold"
    return (k_cache, block_tables, lengths, threshold, n_max), ref


def assert_rsum_close(out, ref, tolerance):
    assert torch.isfinite(out).all(), "output has non-finite (unwritten or NaN) elements"
    error = (out.double() - ref).abs().max().item()
    assert error < tolerance, f"max abs error {error:.3g} >= {tolerance:.3g}"


@pytest.mark.parametrize("threshold", [0.9, "random", -1.0], ids=["copies", "random-pairs", "all-above"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_redundancy_sums_torch_twin(block_size, threshold):
    inputs, ref = redundancy_inputs(block_size, torch.float32, threshold)
    out = paged_redundancy_sums_torch(*inputs)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert_rsum_close(out, ref, RSUM_TOLERANCE[torch.float32])
    assert_padding_zero(out, inputs[2])


@pytest.mark.parametrize("threshold", [0.9, "random", -1.0], ids=["copies", "random-pairs", "all-above"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_redundancy_sums_triton(block_size, threshold):
    require_triton()
    inputs, ref = redundancy_inputs(block_size, torch.float32, threshold, extra_padding=block_size + 2)
    out = torch.full(ref.shape, float("nan"))
    result = paged_redundancy_sums(*inputs, out=out)
    assert result is out
    assert_rsum_close(out, ref, RSUM_TOLERANCE[torch.float32])
    assert_rsum_close(out, paged_redundancy_sums_torch(*inputs).double(), RSUM_TOLERANCE[torch.float32])
    assert_padding_zero(out, inputs[2])


@pytest.mark.parametrize("threshold", [0.9, -1.0], ids=["copies", "all-above"])
def test_redundancy_sums_triton_row_chunks(threshold, monkeypatch):
    """Blocks of 32 keys taken 16 rows at a time."""
    require_triton()
    monkeypatch.setattr(compress_scores_module, "REDUNDANCY_TILE_ELEMENTS", 16 * 16)
    inputs, ref = redundancy_inputs(32, torch.float32, threshold)
    out = paged_redundancy_sums(*inputs)
    assert_rsum_close(out, ref, RSUM_TOLERANCE[torch.float32])
    assert_padding_zero(out, inputs[2])


def test_redundancy_sums_exclusion_matters():
    """The copies make m*(n) exclusions change rsum (else the tests above prove little)."""
    inputs, ref = redundancy_inputs(16, torch.float32, 0.9)
    sims = reference_similarities(*inputs[:3])
    without_exclusion, _ = reference_rsum(sims, 2.0, ref.shape)  # threshold above every similarity
    assert (ref - without_exclusion).abs().max() > 0.5


def test_redundancy_sums_triton_float16():
    require_triton()
    inputs, ref = redundancy_inputs(16, torch.float16, 0.9)
    out = paged_redundancy_sums(*inputs)
    assert_rsum_close(out, ref, RSUM_TOLERANCE[torch.float16])
    assert_padding_zero(out, inputs[2])


# ---------------------------------------------------------------- compact_kv

COMPACT_LENGTHS = [40, 23, 64]
COMPACT_KEEP = 21  # not a multiple of the block size: the last target block is partial


PLACEMENTS = ["out-of-place", "in-place", "in-place-permuted"]


def make_compact_inputs(block_size, dtype, placement, scores):
    """Caches full of random values (so untouched slots are checkable), kept indices,
    new scores, and target tables: blocks no request owns, each request's first source
    blocks, or those in reverse order (so that a token's slot may be overwritten before
    it is read)."""
    generator = torch.Generator().manual_seed(3)
    num_requests, keep = len(COMPACT_LENGTHS), COMPACT_KEEP
    num_targets = math.ceil(keep / block_size)
    kv_group, block_tables, _, spare = make_group_cache(
        COMPACT_LENGTHS, block_size, dtype, head_dim=16, spare_blocks=num_requests * num_targets + 2
    )
    kv_cache = kv_group._base  # the whole cache, layer 0 included: random, no NaN (compared with equal)
    kv_cache.copy_(torch.randn(kv_cache.shape, generator=generator).to(dtype))
    targets = torch.randint(0, 1000, (num_requests, num_targets + 2), dtype=torch.int32, generator=generator)[:, 1:]
    if placement == "in-place":
        targets[:, :num_targets] = block_tables[:, :num_targets]
    elif placement == "in-place-permuted":
        targets[:, :num_targets] = block_tables[:, :num_targets].flip(1)
    else:
        targets[:, :num_targets] = torch.tensor(spare[: num_requests * num_targets], dtype=torch.int32).view(
            num_requests, num_targets
        )
    score_cache = None
    if scores != "none":
        score_cache = torch.randn(NUM_LAYERS + 1, *kv_group.shape[2:5], generator=generator)
    score_group = score_cache[1:] if score_cache is not None else None
    kept_buffer = torch.zeros(num_requests, NUM_LAYERS, NUM_KV_HEADS, keep + 2, dtype=torch.int64)
    kept = kept_buffer[..., 1 : keep + 1]  # a strided view
    for r, length in enumerate(COMPACT_LENGTHS):
        for layer in range(NUM_LAYERS):
            for h in range(NUM_KV_HEADS):
                kept[r, layer, h] = torch.randperm(length, generator=generator)[:keep].sort().values
    new_scores = None
    if scores == "new":
        new_scores = torch.rand(num_requests, NUM_LAYERS, NUM_KV_HEADS, keep, generator=generator)
    return kv_group, score_group, kept, new_scores, block_tables, targets


def expected_after_compact(kv_group, score_group, kept, new_scores, block_tables, targets):
    """Clones of the caches with each kept token copied, one at a time, from the originals."""
    block_size = kv_group.shape[3]
    kv_expected = kv_group.clone()
    score_expected = score_group.clone() if score_group is not None else None
    num_requests, num_layers, num_kv_heads, keep = kept.shape
    for r in range(num_requests):
        for layer in range(num_layers):
            for h in range(num_kv_heads):
                for j in range(keep):
                    src_block, src_slot = token_slot(block_tables, r, int(kept[r, layer, h, j]), block_size)
                    dst_block, dst_slot = token_slot(targets, r, j, block_size)
                    kv_expected[:, layer, dst_block, dst_slot, h] = kv_group[:, layer, src_block, src_slot, h]
                    if score_group is not None:
                        value = (
                            new_scores[r, layer, h, j]
                            if new_scores is not None
                            else score_group[layer, src_block, src_slot, h]
                        )
                        score_expected[layer, dst_block, dst_slot, h] = value
    return kv_expected, score_expected


def run_compact(use_triton, block_size, dtype, placement, scores, single_pass=False, active=None):
    """Compact and check against one-token-at-a-time copies; requests with active[r] == 0 must
    stay untouched."""
    inputs = make_compact_inputs(block_size, dtype, placement, scores)
    kv_group, score_group = inputs[0], inputs[1]
    kv_before = kv_group._base.clone()
    score_before = score_group._base.clone() if score_group is not None else None
    if active is None:
        kv_expected, score_expected = expected_after_compact(*inputs)
    else:  # only the active requests
        rows = active.nonzero().flatten()
        kept, new_scores, tables, targets = inputs[2], inputs[3], inputs[4], inputs[5]
        kv_expected, score_expected = expected_after_compact(
            kv_group, score_group, kept[rows], new_scores[rows] if new_scores is not None else None, tables[rows],
            targets[rows])
    result = (compact_kv if use_triton else compact_kv_torch)(*inputs, single_pass=single_pass, active=active)
    assert result is None
    # Exact: target slots hold the kept tokens, every other slot (other layers,
    # blocks, heads, the tail of the last target block) is unchanged.
    assert torch.equal(kv_group, kv_expected)
    assert torch.equal(kv_group._base[:, 0], kv_before[:, 0])  # the layer outside the group
    if score_group is not None:
        assert torch.equal(score_group, score_expected)
        assert torch.equal(score_group._base[0], score_before[0])
    return inputs


def destination_contents(kv_group, score_group, targets, keep):
    """K/V (and scores) at destination positions 0..keep-1 of every request: comparable
    across placements."""
    block_size = kv_group.shape[3]
    positions = torch.arange(keep)
    blocks = targets.long()[:, positions // block_size]  # [R, keep]
    kv = kv_group[:, :, blocks, positions % block_size]  # [2, L, R, keep, H, d]
    scores = score_group[:, blocks, positions % block_size] if score_group is not None else None
    return kv, scores


@pytest.mark.parametrize("scores", ["new", "moved", "none"])
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_compact_kv(use_triton, placement, scores):
    if use_triton:
        require_triton()
    run_compact(use_triton, 16, torch.float32, placement, scores)


@pytest.mark.parametrize("scores", ["new", "moved", "none"])
@pytest.mark.parametrize("placement", ["out-of-place", "in-place"])  # what single_pass allows
@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_compact_kv_single_pass(use_triton, placement, scores):
    if use_triton:
        require_triton()
    run_compact(use_triton, 16, torch.float32, placement, scores, single_pass=True)


@pytest.mark.parametrize("single_pass", [False, True])
@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_compact_kv_skips_inactive_requests(use_triton, single_pass):
    """Padding rows of a captured batch (flag 0) write nothing, whatever their tables say."""
    if use_triton:
        require_triton()
    active = torch.tensor([1, 0, 1], dtype=torch.int64)
    run_compact(use_triton, 8, torch.float32, "in-place", "new", single_pass=single_pass, active=active)


def test_compact_kv_single_pass_small_tiles(monkeypatch):
    """Several tiles per (request, layer, head), with the tile's destinations among its own sources."""
    require_triton()
    monkeypatch.setattr(compact_kv_module, "SINGLE_PASS_TOKENS", 4)
    run_compact(True, 4, torch.float32, "in-place", "moved", single_pass=True)


@pytest.mark.parametrize("scores", ["new", "moved"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_compact_kv_triton_chunked(placement, scores, monkeypatch):
    """Scratch for one (layer, head) pair at a time: several gather / scatter rounds."""
    require_triton()
    monkeypatch.setattr(compact_kv_module, "COMPACT_SCRATCH_BYTES", 1)
    run_compact(True, 16, torch.float32, placement, scores)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_compact_kv_in_place_matches_out_of_place(use_triton):
    if use_triton:
        require_triton()
    results = []
    for placement in PLACEMENTS:
        kv_group, score_group, kept, _, _, targets = run_compact(use_triton, 8, torch.float32, placement, "moved")
        results.append(destination_contents(kv_group, score_group, targets, kept.shape[-1]))
    (kv_out, scores_out), *in_place = results
    for kv_in, scores_in in in_place:
        assert torch.equal(kv_out, kv_in) and torch.equal(scores_out, scores_in)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_compact_kv_triton_float16(placement):
    require_triton()
    run_compact(True, 16, torch.float16, placement, "new")


# ---------------------------------------------------------------- the engine's own inputs


def test_score_kernels_on_the_compressors_packed_batch():
    """The batch exactly as the compressor builds it (lengths, pooling flags and window rows
    are columns of one packed array) through the Triton kernels and through the twins.
    Requests of different lengths, so a kernel that misread the lengths would disagree."""
    require_triton()
    from types import SimpleNamespace

    from zipage.compression.executor import Compressor
    from zipage.compression.planner import CompressionTask
    from zipage.config import CompressionConfig

    block_size, width, window, group = 16, 3, WINDOW, 3
    generator = torch.Generator().manual_seed(5)
    kv = torch.randn(2, NUM_LAYERS, 16, block_size, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    queries = torch.randn(NUM_LAYERS, 4 * window + 1, NUM_KV_HEADS * group, HEAD_DIM, generator=generator)
    blocks = torch.randperm(16, generator=generator).tolist()
    tasks = [CompressionTask(seq=SimpleNamespace(query_slot=i), source_blocks=blocks[3 * i:3 * i + 3],
                             target_blocks=blocks[3 * i:3 * i + 2], num_tokens=n, keep=2 * block_size,
                             num_previous=0, last_position=n + 11 * i, pool=i % 2 == 0, protected=i,
                             pending_release=[])
             for i, n in enumerate([48, 37, 40, 20])]
    compressor = Compressor(CompressionConfig(max_blocks_per_seq=width, window=window), kv, None, queries,
                            HEAD_DIM ** -0.5, block_size)
    b = compressor.batch_inputs(tasks)
    assert not b.lengths.is_contiguous()
    window_queries = queries[:, b.rows].transpose(0, 1).contiguous()
    args = (window_queries, kv[0], b.sources, b.lengths, HEAD_DIM ** -0.5, b.n_max)
    assert_close(paged_attention_scores(*args), paged_attention_scores_torch(*args).double(),
                 TRITON_TOLERANCE[torch.float32])
    args = (kv[0], b.sources, b.lengths, 0.5, b.n_max)
    assert_rsum_close(paged_redundancy_sums(*args), paged_redundancy_sums_torch(*args).double(),
                      RSUM_TOLERANCE[torch.float32])


def test_engine_with_the_triton_kernels_gives_the_twins_tokens(checkpoint_dir, monkeypatch):
    """A whole engine on the CPU whose compressor runs the Triton kernels (interpreted: scores,
    selection, compaction) generates the tokens it generates with the PyTorch twins: the kernels
    get the engine's own views (packed numbers, block-table slices, layer groups, the score
    cache with history), as on a GPU.
    Its KV (and window-query) stores run the Triton store kernel too."""
    require_triton()
    from tests.conftest import make_llm
    from zipage import CompressionConfig, SamplingParams
    from zipage.attention import torch_backend
    from zipage.compression import executor
    from zipage.kernels.store_kv import store_kv
    from zipage.runner import model_runner

    class TritonCompressor(executor.Compressor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._attention = paged_attention_scores
            self._redundancy = paged_redundancy_sums
            self._compact = compact_kv
            self._choose = choose_kept

    model_dir = checkpoint_dir("qwen3")
    prompts = [list(range(5, 45)), list(range(7, 30)), [3, 1, 4, 1, 5, 9, 2, 6], list(range(50, 90))]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    tokens = []
    for kernels in ("twins", "triton"):
        if kernels == "triton":  # the runner builds its compressor from this name
            monkeypatch.setattr(model_runner, "Compressor", TritonCompressor)
            monkeypatch.setattr(torch_backend, "store_kv_torch", store_kv)
        with make_llm(model_dir, block_size=16, max_model_len=256, device="cpu",
                      compression=CompressionConfig(max_blocks_per_seq=3, window=8, layer_group=1)) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert llm.stats.num_compressions >= len(prompts)
        tokens.append([o.outputs[0].token_ids for o in outputs])
    assert tokens[1] == tokens[0]
