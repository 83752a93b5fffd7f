"""The compression scoring pipeline (zipage.compression.policy) against its float64 reference.

Every policy function is compared with the loop-by-loop reference in
``zipage.compression.reference`` on ragged batches (padding filled with NaN garbage,
which must never leak), then checked on hand-made cases with known answers.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zipage.compression import policy
from zipage.compression import reference as ref
from zipage.config import CompressionConfig

# (name, seed, L, H, G, d, w, b, lengths, extra padding)
CASES = [
    ("g1-w1-b4", 1, 2, 2, 1, 16, 1, 4, [1, 5, 16, 23], 0),  # n_r == w, 1 block + 1, multiple of b, partial
    ("g2-w4-b8", 2, 2, 2, 2, 16, 4, 8, [4, 9, 16, 29], 3),
    ("g4-w4-b16", 3, 1, 2, 4, 16, 4, 16, [17, 4, 32, 40], 0),
    ("g4-w16-b16", 4, 2, 1, 4, 8, 16, 16, [16, 33, 47], 2),
    ("g2-w2-b4", 5, 1, 2, 2, 8, 2, 4, [12, 2, 7], 1),
]
CASE_IDS = [case[0] for case in CASES]


def _case(case, dtype=torch.float32, garbage=float("nan")):
    """Random inputs for one case: clustered keys with exact and scaled copies, zero keys
    and ``garbage`` at padding; queries of the window; ``lengths`` int64."""
    _, seed, L, H, G, d, w, b, lengths, extra = case
    gen = torch.Generator().manual_seed(seed)
    R, n_max = len(lengths), max(lengths) + extra
    centers = torch.randn(R, L, H, 4, d, generator=gen, dtype=torch.float64)
    member = torch.randint(0, 4, (R, L, H, n_max), generator=gen)
    noise = torch.rand(R, L, H, n_max, 1, generator=gen, dtype=torch.float64) * 1.5 + 0.1
    keys = torch.gather(centers, 3, member[..., None].expand(R, L, H, n_max, d))
    keys = keys + noise * torch.randn(R, L, H, n_max, d, generator=gen, dtype=torch.float64)
    for r, n in enumerate(lengths):  # exact copies, scaled copies and zero keys
        if n >= 4:
            keys[r, :, :, n - 2] = keys[r, :, :, 0]
            keys[r, :, :, n // 2] = 3.0 * keys[r, :, :, 1]
            keys[r, :, :, n // 3] = 0.0
    queries = 2.0 * torch.randn(R, L, w, H * G, d, generator=gen, dtype=torch.float64)
    keys, queries = keys.to(dtype), queries.to(dtype)
    for r, n in enumerate(lengths):
        keys[r, :, :, n:] = garbage
    return queries, keys, torch.tensor(lengths, dtype=torch.int64)


def _mask(lengths, shape):
    return (torch.arange(shape[-1]) < lengths.view(-1, 1, 1, 1)).expand(shape)


def _safe_threshold(keys, lengths, theta, margin=1e-4):
    """``theta`` moved, if needed, so that no valid pair's cosine lies within ``margin`` of it
    (float32 and float64 must agree on which pairs exceed it)."""
    k = keys.to(torch.float64)
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    sim = unit @ unit.transpose(-1, -2)
    sims = torch.cat([sim[r, ..., :n, :n].reshape(-1) for r, n in enumerate(lengths.tolist())])
    while (sims - theta).abs().min() < margin:
        theta += 3.7 * margin
    return theta


def assert_valid_close(actual, expected, lengths, rtol=1e-5, atol=1e-7):
    assert actual.dtype == torch.float32, actual.dtype
    assert actual.shape == expected.shape
    assert not torch.isnan(actual).any()
    valid = _mask(lengths, actual.shape)
    torch.testing.assert_close(actual.double()[valid], expected[valid], rtol=rtol, atol=atol)


def assert_padding(actual, lengths, value):
    pad = ~_mask(lengths, actual.shape)
    assert (actual[pad] == value).all(), actual[pad]


# ---------------------------------------------------------------- each function against the reference


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_attention_scores(case):
    queries, keys, lengths = _case(case)
    scale = 1 / math.sqrt(keys.shape[-1])
    got = policy.attention_scores(queries, keys, lengths, scale)
    want = ref.attention_scores(queries, keys, lengths, scale)
    assert_valid_close(got, want, lengths, rtol=1e-5, atol=1e-12)
    assert_padding(got, lengths, 0.0)
    if case[4] == 1:  # without GQA each window row is a distribution, and so is their mean
        sums = got.double().sum(-1)
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_scores_low_precision_inputs(dtype):
    queries, keys, lengths = _case(CASES[1], dtype=dtype, garbage=0.0)
    got = policy.attention_scores(queries, keys, lengths, 0.25)
    want = ref.attention_scores(queries, keys, lengths, 0.25)  # on the same rounded values
    assert_valid_close(got, want, lengths, rtol=1e-5, atol=1e-8)
    rsum = policy.redundancy_sums(keys, lengths, 0.5, 8)
    assert rsum.dtype == torch.float32
    assert_valid_close(rsum, ref.redundancy_sums(keys, lengths, 0.5, 8), lengths, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decay", [None, 0.8])
@pytest.mark.parametrize("case", CASES[:3], ids=CASE_IDS[:3])
def test_update_global_scores(case, decay):
    _, seed, L, H, *_ = case
    lengths = torch.tensor(case[8])
    gen = torch.Generator().manual_seed(seed + 100)
    n_max = int(lengths.max()) + case[9]
    attention = torch.rand(len(lengths), L, H, n_max, generator=gen) * _mask(lengths, (len(lengths), L, H, n_max))
    previous = torch.rand(len(lengths), L, H, n_max, generator=gen) * 1.2
    num_previous = torch.tensor([0, 1] + [int(n) for n in lengths[2:-1] // 2] + [int(lengths[-1])])  # 0, partial, all
    for r, n in enumerate(num_previous.tolist()):
        previous[r, :, :, n:] = float("nan")  # never read
    got = policy.update_global_scores(attention, previous, num_previous, decay)
    want = ref.update_global_scores(attention, previous, num_previous, decay)
    assert_valid_close(got, want, lengths, rtol=1e-6, atol=0)
    assert_padding(got, lengths, 0.0)
    assert got.data_ptr() != attention.data_ptr()
    # No previous scores at all: G = A.
    assert torch.equal(policy.update_global_scores(attention, None, torch.zeros_like(num_previous), decay), attention)


@pytest.mark.parametrize("width", [1, 3, 5, 7])
def test_max_pool(width):
    lengths = torch.tensor([1, 2, 5, 9, 30])
    gen = torch.Generator().manual_seed(width)
    scores = torch.randn(5, 2, 3, 32, generator=gen)
    scores[~_mask(lengths, scores.shape)] = float("nan")  # padding never wins
    got = policy.max_pool(scores, lengths, width)
    want = ref.max_pool(scores, lengths, width)
    assert_valid_close(got, want, lengths, rtol=0, atol=0)
    assert_padding(got, lengths, 0.0)


@pytest.mark.parametrize("block_size", [4, 8, 16, None], ids=["b4", "b8", "b16", "raw"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_redundancy(case, block_size):
    queries, keys, lengths = _case(case)
    theta = _safe_threshold(keys, lengths, 0.45)
    got = policy.redundancy_sums(keys, lengths, theta, block_size)
    want = ref.redundancy_sums(keys, lengths, theta, block_size)
    assert_valid_close(got, want, lengths, rtol=1e-5, atol=1e-5)
    assert_padding(got, lengths, 0.0)
    for tau in (0.4, 1.3):
        got_r = policy.redundancy_scores(keys, lengths, theta, tau, block_size)
        want_r = ref.redundancy_scores(keys, lengths, theta, tau, block_size)
        assert_valid_close(got_r, want_r, lengths, rtol=1e-5, atol=1e-8)
        assert_padding(got_r, lengths, 0.0)
        # The softmax step alone, from the reference's rsum.
        norm = policy.normalise_redundancy(want.float(), lengths, tau, block_size)
        assert_valid_close(norm, ref.normalise_redundancy(want, lengths, tau, block_size), lengths, rtol=1e-5,
                           atol=1e-8)
        assert_padding(norm, lengths, 0.0)
        sums = norm.double().sum(-1)
        torch.testing.assert_close(sums, torch.ones_like(sums))


@pytest.mark.parametrize("attention_weight", [0.0, 0.2, 1.0])
def test_combine_and_protect(attention_weight):
    gen = torch.Generator().manual_seed(7)
    lengths = torch.tensor([6, 11, 3])
    pooled, redundancy = torch.rand(3, 2, 2, 12, generator=gen), torch.rand(3, 2, 2, 12, generator=gen)
    for red in (redundancy, None):
        got = policy.combine_scores(pooled, red, attention_weight)
        want = ref.combine_scores(pooled, red, attention_weight)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
        assert got.data_ptr() != pooled.data_ptr()
    # a count for all requests, or one per request (keep_prompt protects each request's prompt)
    for window, sink in ((1, 0), (3, 0), (3, 2), (1, 5), (2, torch.tensor([0, 4, 7])), (1, torch.tensor([6, 0, 2]))):
        got = policy.protect(pooled, lengths, window, sink)
        want = ref.protect(pooled, lengths, window, sink)
        assert torch.equal(got.double(), want), (window, sink)
        assert_padding(got, lengths, float("-inf"))


def test_select_kept_matches_reference():
    gen = torch.Generator().manual_seed(11)
    lengths = torch.tensor([9, 16, 12])
    scores = policy.protect(torch.randn(3, 2, 4, 16, generator=gen), lengths, 2, 1)
    for keep in (3, 5, 9):
        got = policy.select_kept(scores, keep)
        assert got.dtype == torch.int64 and got.shape == (3, 2, 4, keep)
        assert torch.equal(got, ref.select_kept(scores, keep))


def _config(w, **options):
    return CompressionConfig(window=w, **options)


def _assert_same_selection(got, want, scores, keep, atol=1e-6):
    """Equal sets, except where the reference scores tie (within ``atol``) at the keep boundary."""
    flat_got, flat_want = got.reshape(-1, keep), want.reshape(-1, keep)
    flat_scores = scores.reshape(-1, scores.shape[-1])
    for row in range(flat_got.shape[0]):
        a, b = set(flat_got[row].tolist()), set(flat_want[row].tolist())
        if a == b:
            continue
        boundary = flat_scores[row].topk(keep).values[-1]
        for j in a ^ b:
            assert abs(float(flat_scores[row, j] - boundary)) <= atol, (row, j, a ^ b)


PIPELINES = [  # (case index, redundancy, decay, pooling width, pool, sink, keep, lambda)
    (0, "lightning", 0.8, 5, True, 0, 1, 0.2),
    (1, "lightning", None, 5, False, 0, 4, 0.2),
    (2, "raw", 0.8, 3, True, 0, 4, 0.5),
    (3, "lightning", 0.8, None, True, 0, 16, 0.2),
    (4, "off", 0.8, 5, True, 0, 2, 0.2),
    (1, "raw", None, None, False, 0, 4, 0.0),
    (4, "lightning", 0.8, 3, True, 0, 2, 1.0),
]
TALL = [  # longer requests so sink, keep and the window leave room for choice
    ("tall-g2", 21, 2, 2, 2, 16, 4, 8, [24, 37, 29], 2),
    ("tall-g1", 22, 1, 2, 1, 16, 1, 4, [13, 21, 40], 0),
]
PIPELINES += [
    (5, "lightning", 0.8, 5, True, 3, 14, 0.2),
    (5, "raw", 0.8, None, False, 2, 20, 0.3),
    (6, "lightning", None, 5, True, 1, 9, 0.2),
    (6, "off", None, None, False, 4, 11, 0.2),
]


@pytest.mark.parametrize("spec", PIPELINES, ids=[f"{p[0]}-{p[1]}-{p[2]}-{p[3]}-{p[4]}-s{p[5]}" for p in PIPELINES])
def test_score_tokens(spec):
    index, redundancy, decay, width, pool, sink, keep, weight = spec
    case = (CASES + TALL)[index]
    queries, keys, lengths = _case(case)
    w, b = case[6], case[7]
    assert keep <= int(lengths.min()) and keep >= w + sink
    theta = _safe_threshold(keys, lengths, 0.5)
    config = _config(w, redundancy=redundancy, global_score_decay=decay, pooling_width=width, attention_sink=sink,
                     attention_weight=weight, similarity_threshold=theta)
    R, L, H, n_max = keys.shape[:4]
    gen = torch.Generator().manual_seed(index)
    previous = torch.rand(R, L, H, n_max, generator=gen) * 0.3
    num_previous = torch.tensor([0] + [int(n) * (r % 3) // 2 for r, n in enumerate(lengths.tolist()[1:])])
    scale = 1 / math.sqrt(keys.shape[-1])
    kept, history = policy.score_tokens(queries, keys, lengths, previous, num_previous, config, scale, keep, b, pool)
    want_kept, want_history, want_scores = ref.score_tokens_with_scores(queries, keys, lengths, previous, num_previous,
                                                                        config, scale, keep, b, pool)
    assert kept.dtype == torch.int64 and kept.shape == (R, L, H, keep)
    assert_valid_close(history, want_history, lengths, rtol=1e-5, atol=1e-8)
    assert_padding(history, lengths, 0.0)
    _assert_same_selection(kept, want_kept, want_scores, keep)
    assert (kept.diff(dim=-1) > 0).all()


# ---------------------------------------------------------------- padding, NaN and chunking


def test_padding_never_leaks_and_no_nan():
    """Garbage padding (NaN, huge) and all-zero keys give the same valid outputs and no NaN."""
    outs = []
    for garbage in (float("nan"), 1e30, 0.0):
        queries, keys, lengths = _case(CASES[1], garbage=garbage)
        attention = policy.attention_scores(queries, keys, lengths, 0.25)
        rsum = policy.redundancy_sums(keys, lengths, 0.5, 8)
        rraw = policy.redundancy_scores(keys, lengths, 0.5, 0.4, None)
        outs.append((attention, rsum, rraw))
        for t in outs[-1]:
            assert not torch.isnan(t).any()
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)
    zeros = torch.zeros(2, 1, 2, 10, 8)
    lengths = torch.tensor([10, 7])
    queries = torch.zeros(2, 1, 3, 4, 8)
    attention = policy.attention_scores(queries, zeros, lengths, 1.0)
    assert not torch.isnan(attention).any()
    assert_valid_close(attention, ref.attention_scores(queries, zeros, lengths, 1.0), lengths)
    for block in (4, None):
        rsum = policy.redundancy_sums(zeros, lengths, 0.5, block)
        assert torch.equal(rsum, torch.zeros_like(rsum))
        red = policy.redundancy_scores(zeros, lengths, 0.5, 0.4, block)
        assert_valid_close(red, ref.redundancy_scores(zeros, lengths, 0.5, 0.4, block), lengths)
    # A batch row with no tokens at all (never produced by the engine) still gives no NaN.
    empty = torch.tensor([0, 5])
    for t in (policy.attention_scores(queries[:, :, :1], zeros, empty, 1.0),
              policy.redundancy_scores(torch.randn(2, 1, 2, 10, 8), empty, 0.5, 0.4, None),
              policy.max_pool(torch.randn(2, 1, 2, 10), empty, 5)):
        assert not torch.isnan(t).any()
        assert (t[0] == 0).all()


def test_chunked_rows_match_one_chunk(monkeypatch):
    queries, keys, lengths = _case(CASES[2])
    whole = (policy.attention_scores(queries, keys, lengths, 0.25), policy.redundancy_sums(keys, lengths, 0.5, 16),
             policy.redundancy_sums(keys, lengths, 0.5, None))
    monkeypatch.setattr(policy, "SCRATCH_ELEMENTS", 1)  # one (request, layer, head) row per chunk
    chunked = (policy.attention_scores(queries, keys, lengths, 0.25), policy.redundancy_sums(keys, lengths, 0.5, 16),
               policy.redundancy_sums(keys, lengths, 0.5, None))
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- crafted cases with known answers


def _duplicate_keys(n, d, copies, extra_copies=()):
    """One-hot keys e_j (mutually orthogonal), with the positions in ``copies`` sharing one key."""
    keys = torch.zeros(1, 1, 1, n, d)
    for j in range(n):
        keys[0, 0, 0, j, j + 1] = 1.0
    for j in copies:
        keys[0, 0, 0, j] = 0.0
        keys[0, 0, 0, j, 0] = 1.0
    for j, factor in extra_copies:
        keys[0, 0, 0, j] = 0.0
        keys[0, 0, 0, j, 0] = factor
    return keys


@pytest.mark.parametrize("block_size", [8, None])
def test_duplicate_keys_rsum(block_size):
    # A=1 < B=3 < C=6 identical, all others orthogonal: m*(A) = m*(B) = C, m*(C) = B.
    # rsum(A) = s(B,A) + s(C,A) = 2; rsum(B) = s(A,B) + s(C,B) - s(C,B) = 1;
    # rsum(C) = s(A,C) + s(B,C) - s(A,C) - s(B,C) = 0; every other key 0.
    keys = _duplicate_keys(8, 16, (1, 3, 6))
    rsum = policy.redundancy_sums(keys, torch.tensor([8]), 0.5, block_size)
    expected = torch.zeros(8)
    expected[1], expected[3] = 2.0, 1.0
    torch.testing.assert_close(rsum[0, 0, 0], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(rsum.double(), ref.redundancy_sums(keys, torch.tensor([8]), 0.5, block_size))


def test_duplicates_across_blocks_only_count_in_raw():
    # Copies at 1 and 9 sit in different blocks of 8 (and a scaled copy at 10 in the partial block).
    keys = _duplicate_keys(12, 16, (1, 9), extra_copies=[(10, 5.0)])
    lengths = torch.tensor([12])
    lightning = policy.redundancy_sums(keys, lengths, 0.5, 8)[0, 0, 0]
    raw = policy.redundancy_sums(keys, lengths, 0.5, None)[0, 0, 0]
    # lightning: only 9 and 10 are partners: m*(9) = 10, m*(10) = 9 -> both 0.
    torch.testing.assert_close(lightning, torch.zeros(12), rtol=0, atol=1e-6)
    # raw: 1, 9, 10 copies: rsum(1) = 2, rsum(9) = 1, rsum(10) = 0.
    expected = torch.zeros(12)
    expected[1], expected[9] = 2.0, 1.0
    torch.testing.assert_close(raw, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("redundancy", ["lightning", "raw"])
def test_latest_copy_is_kept_when_attention_is_flat(redundancy):
    n, d = 8, 16
    keys = _duplicate_keys(n, d, (1, 3, 5))
    queries = torch.zeros(1, 1, 1, 1, d)  # w = 1, zero query: A = 1/n everywhere
    lengths = torch.tensor([n])
    attention = policy.attention_scores(queries, keys, lengths, 1.0)
    torch.testing.assert_close(attention, torch.full_like(attention, 1 / n))
    config = _config(1, redundancy=redundancy, global_score_decay=None, pooling_width=None)
    kept, _ = policy.score_tokens(queries, keys, lengths, None, torch.zeros(1, dtype=torch.int64), config, 1.0,
                                  n - 2, 8, pool=False)
    assert kept[0, 0, 0].tolist() == [0, 2, 4, 5, 6, 7]  # older copies 1 and 3 evicted, latest copy 5 kept
    kept_one_more, _ = policy.score_tokens(queries, keys, lengths, None, torch.zeros(1, dtype=torch.int64), config,
                                           1.0, n - 1, 8, pool=False)
    assert kept_one_more[0, 0, 0].tolist() == [0, 2, 3, 4, 5, 6, 7]  # then the middle copy (rsum 1 < 2)


def test_window_query_does_not_see_later_window_tokens():
    gen = torch.Generator().manual_seed(3)
    n, d, w = 10, 8, 3
    keys = torch.randn(1, 1, 1, n, d, generator=gen)
    queries = torch.randn(1, 1, w, 1, d, generator=gen)
    lengths = torch.tensor([n])

    def per_row(k):
        """Each window row's own causal softmax, computed here without the policy."""
        rows = []
        for i in range(w):
            last = n - w + i
            p = torch.softmax(k[0, 0, 0, :last + 1] @ queries[0, 0, i, 0], dim=0)
            rows.append(torch.cat([p, torch.zeros(n - last - 1)]))
        return rows

    base = policy.attention_scores(queries, keys, lengths, 1.0)[0, 0, 0]
    perturbed_keys = keys.clone()
    perturbed_keys[0, 0, 0, n - 1] = 50.0 * queries[0, 0, 0, 0]  # the last window token, huge for row 0's query
    perturbed = policy.attention_scores(queries, perturbed_keys, lengths, 1.0)[0, 0, 0]
    before, after = per_row(keys), per_row(perturbed_keys)
    # Rows 0 .. w-2 cannot see token n-1: their contributions are unchanged by the perturbation.
    assert all(torch.equal(before[i], after[i]) for i in range(w - 1))
    torch.testing.assert_close(base, sum(before) / w)
    torch.testing.assert_close(perturbed, sum(after) / w)
    torch.testing.assert_close(perturbed - after[w - 1] / w, base - before[w - 1] / w)
    # Window token n - w + t receives weight only from rows i >= t.
    assert perturbed[n - 1] == pytest.approx(float(after[w - 1][n - 1]) / w, rel=1e-5)
    assert float(perturbed[n - 1]) < 1 / w + 1e-6  # a non-causal row 0 would give it almost all its weight


@pytest.mark.parametrize("redundancy", ["lightning", "raw", "off"])
def test_score_tokens_keeps_protected_tokens(redundancy):
    case = TALL[0]
    queries, keys, lengths = _case(case)
    w, sink, keep = case[6], 3, 8
    config = _config(w, redundancy=redundancy, attention_sink=sink)
    # Make the protected tokens look worthless: near-zero attention and maximal redundancy.
    keys = keys.clone()
    for r, n in enumerate(lengths.tolist()):
        keys[r, :, :, list(range(sink)) + list(range(n - w, n))] = keys[r, :, :, :1]
    kept, history = policy.score_tokens(queries, keys, lengths, None, torch.zeros(3, dtype=torch.int64), config, 0.25,
                                        keep, case[7], pool=True)
    assert kept.shape == (*keys.shape[:3], keep)
    for r, n in enumerate(lengths.tolist()):
        rows = kept[r].reshape(-1, keep)
        assert (rows.diff(dim=-1) > 0).all() and (rows >= 0).all() and (rows < n).all()
        for required in list(range(sink)) + list(range(n - w, n)):
            assert (rows == required).any(-1).all()
    assert_padding(history, lengths, 0.0)


def test_global_score_uses_previous_only_for_survivors():
    attention = torch.tensor([0.1, 0.4, 0.2, 0.3, 0.0]).view(1, 1, 1, 5)
    previous = torch.tensor([1.0, 0.1, 0.5, 9.0, 9.0]).view(1, 1, 1, 5)
    num_previous = torch.tensor([3])  # tokens 0..2 survived the last compression; 3 arrived since, 4 padding
    got = policy.update_global_scores(attention, previous, num_previous, 0.8)
    # max(0.1, 0.8) ; max(0.4, 0.08) ; max(0.2, 0.4) ; A ; A
    torch.testing.assert_close(got[0, 0, 0], torch.tensor([0.8, 0.4, 0.4, 0.3, 0.0]))
    assert torch.equal(policy.update_global_scores(attention, previous, num_previous, None), attention)
    assert torch.equal(policy.update_global_scores(attention, previous, torch.tensor([0]), 0.8), attention)


# ---------------------------------------------------------------- properties of protect + select_kept


@st.composite
def _selection_problems(draw):
    R = draw(st.integers(1, 3))
    window = draw(st.integers(1, 4))
    sink = draw(st.integers(0, 3))
    lengths = [draw(st.integers(window + sink, 14)) for _ in range(R)]
    n_max = max(lengths) + draw(st.integers(0, 3))
    keep = draw(st.integers(window + sink, min(lengths)))
    values = st.floats(width=32, allow_nan=True, allow_infinity=True)
    scores = draw(st.lists(values, min_size=R * 2 * n_max, max_size=R * 2 * n_max))
    return torch.tensor(scores, dtype=torch.float32).view(R, 1, 2, n_max), torch.tensor(lengths), window, sink, keep


@settings(derandomize=True, deadline=None, max_examples=150)
@given(_selection_problems())
def test_protect_then_select_properties(problem):
    scores, lengths, window, sink, keep = problem
    protected = policy.protect(scores, lengths, window, sink)
    assert not torch.isnan(protected).any()
    kept = policy.select_kept(protected, keep)
    assert kept.shape == (*scores.shape[:3], keep)
    for r, n in enumerate(lengths.tolist()):
        rows = kept[r].reshape(-1, keep)
        assert (rows.diff(dim=-1) > 0).all()  # sorted and unique
        assert (rows >= 0).all() and (rows < n).all()
        for required in set(range(min(sink, n))) | set(range(n - window, n)):
            assert (rows == required).any(-1).all()
        for row, chosen in zip(protected[r].reshape(-1, protected.shape[-1]), rows):
            mask = torch.zeros_like(row, dtype=torch.bool)
            mask[chosen] = True
            if (~mask).any():  # a true top-k
                assert row[mask].min() >= row[~mask].max()

def test_keep_prompt_protects_the_prompt_up_to_half_the_budget():
    config = CompressionConfig(kv_budget_tokens=64, window=8, keep_prompt=True)
    config.resolve(16)
    assert [config.protected_tokens(n) for n in (0, 5, 32, 33, 500)] == [0, 5, 32, 32, 32]
    small = CompressionConfig(kv_budget_tokens=16, window=16, keep_prompt=True, attention_sink=0)
    small.resolve(16)  # half the budget would leave no room for the window
    assert small.protected_tokens(100) == 0
    plain = CompressionConfig(kv_budget_tokens=64, attention_sink=3)
    plain.resolve(16)
    assert plain.protected_tokens(40) == 3
    with pytest.raises(ValueError, match="keep_prompt must be a bool, got 1"):
        CompressionConfig(keep_prompt=1)
