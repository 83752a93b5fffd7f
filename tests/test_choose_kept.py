"""The fused selection kernel (history, pooling, redundancy, protection, top-k) against its
PyTorch twin (the functions of policy.py) and against a float64 reference written here
from the design page, one row and one token at a time. The Triton kernel runs on CPU
tensors under Triton's interpreter (set before the kernel module is imported)."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.conftest import require_triton  # noqa: E402
from zipage.config import CompressionConfig  # noqa: E402
from zipage.kernels.choose_kept import choose_kept, choose_kept_torch  # noqa: E402

LAYERS, HEADS, BLOCK = 2, 2, 8
WIDTH = 5  # source blocks: n_max = 40
LENGTHS = [40, 33, 21, 16]
KEEP = 16


def make_inputs(seed=0, quantised=False):
    """Scores and a score cache as a compression batch sees them. quantised: attention on a coarse
    grid, so that many scores tie exactly (the tie rule decides)."""
    generator = torch.Generator().manual_seed(seed)
    n_max = WIDTH * BLOCK
    num_requests = len(LENGTHS)
    attention = torch.rand(num_requests, LAYERS, HEADS, n_max, generator=generator)
    if quantised:
        attention = (attention * 4).floor() / 4
    rsum = torch.randn(num_requests, LAYERS, HEADS, n_max, generator=generator) * 20
    lengths = torch.tensor(LENGTHS, dtype=torch.int64)
    for r, length in enumerate(LENGTHS):  # padding holds garbage, never read
        attention[r, :, :, length:] = float("nan")
        rsum[r, :, :, length:] = float("nan")
    num_blocks = num_requests * WIDTH + 3
    tables = torch.randperm(num_blocks, generator=generator)[:num_requests * WIDTH].view(num_requests, WIDTH)
    tables = tables.to(torch.int32)
    score_cache = torch.rand(LAYERS + 1, num_blocks, BLOCK, HEADS, generator=generator) * 2
    if quantised:
        score_cache = (score_cache * 4).floor() / 4
    num_previous = torch.tensor([24, 0, 21, 10], dtype=torch.int64)
    pool = torch.tensor([True, False, True, True])
    sinks = torch.tensor([1, 4, 0, 2], dtype=torch.int64)
    return attention, rsum, lengths, num_previous, pool, sinks, score_cache[1:], tables


def pools(pool, r) -> bool:
    """Whether request r pools: ``pool`` is a bool for all, or a flag per request."""
    return bool(pool) if isinstance(pool, bool) else bool(pool[r])


def reference_scores(attention, rsum, lengths, num_previous, pool, sinks, score_group, tables, config):
    """float64 [R, L, H, n_max]: the history score G and the combined score S before protection
    (0 at padding), one row at a time."""
    history = torch.zeros(attention.shape, dtype=torch.float64)
    combined = torch.zeros(attention.shape, dtype=torch.float64)
    for r in range(attention.shape[0]):
        n = int(lengths[r])
        for layer in range(attention.shape[1]):
            for h in range(attention.shape[2]):
                a = attention[r, layer, h, :n].double()
                g = a.clone()
                if score_group is not None and config.global_score_decay is not None:
                    for j in range(int(num_previous[r])):
                        block, slot = int(tables[r, j // BLOCK]), j % BLOCK
                        g[j] = max(a[j], score_group[layer, block, slot, h].double() * config.global_score_decay)
                p = g
                if pools(pool, r) and config.pooling_width:
                    half = config.pooling_width // 2
                    p = torch.stack([g[max(0, j - half):min(n, j + half + 1)].max() for j in range(n)])
                s = p
                if rsum is not None:
                    x = rsum[r, layer, h, :n].double() / (config.redundancy_temperature * BLOCK)
                    e = (x - x.max()).exp()
                    s = config.attention_weight * p - (1 - config.attention_weight) * e / e.sum().clamp_min(1.0)
                history[r, layer, h, :n] = g
                combined[r, layer, h, :n] = s
    return history, combined


def reference(history, combined, lengths, sinks, config, keep):
    """Protection (+inf for the window and the sink) and the `keep` largest, ties to the older
    token: kept indices (ascending) and their history scores."""
    kept_all, scores_all = torch.zeros(*history.shape[:3], keep, dtype=torch.int64), []
    for index in torch.cartesian_prod(*(torch.arange(d) for d in history.shape[:3])).tolist():
        r = index[0]
        n = int(lengths[r])
        s = [float("inf") if j >= n - config.window or j < int(sinks[r]) else float(combined[tuple(index)][j])
             for j in range(n)]
        kept_all[tuple(index)] = torch.tensor(sorted(sorted(range(n), key=lambda j: (-s[j], j))[:keep]))
    return kept_all, history.gather(-1, kept_all)


def assert_same_choice(kept, expected, combined, tolerance=1e-6):
    """Equal kept sets, except where the scores at the boundary are equal to float32 rounding."""
    for index in torch.nonzero((kept != expected).any(-1)).tolist():
        a, b = set(kept[tuple(index)].tolist()), set(expected[tuple(index)].tolist())
        row = combined[tuple(index)]
        boundary = min(float(row[j]) for j in b)
        for j in a ^ b:
            assert abs(float(row[j]) - boundary) <= tolerance * max(1.0, abs(boundary)), (index, sorted(a ^ b))


CASES = {
    "everything": dict(history=True, pooling=True, redundancy=True),
    "no history": dict(history=False, pooling=True, redundancy=True),
    "no pooling": dict(history=True, pooling=False, redundancy=True),
    "attention only": dict(history=False, pooling=False, redundancy=False),
}


def run_case(implementation, history, pooling, redundancy, seed=0, quantised=False):
    attention, rsum, lengths, num_previous, pool, sinks, score_group, tables = make_inputs(seed, quantised)
    config = CompressionConfig(max_blocks_per_seq=WIDTH, window=4, pooling_width=5 if pooling else None,
                               global_score_decay=0.9 if history else None, layer_group=LAYERS)
    args = (attention, rsum if redundancy else None, lengths, num_previous, pool if pooling else False, sinks,
            score_group if history else None, tables, config, KEEP, BLOCK)
    kept, scores = implementation(*args)
    history, combined = reference_scores(*args[:9])
    expected, expected_scores = reference(history, combined, lengths, sinks, config, KEEP)
    return kept, scores, expected, expected_scores, combined


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("implementation", ["torch", "triton"])
def test_choose_kept_matches_the_float64_reference(implementation, case):
    if implementation == "triton":
        require_triton()
    function = choose_kept if implementation == "triton" else choose_kept_torch
    kept, scores, expected, expected_scores, combined = run_case(function, **CASES[case])
    assert kept.dtype == torch.int64 and kept.shape == expected.shape
    assert torch.all(kept[..., 1:] > kept[..., :-1]), "kept indices must be ascending and distinct"
    assert_same_choice(kept, expected, combined)
    same = (kept == expected).all(-1)
    assert torch.allclose(scores[same].double(), expected_scores[same], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choose_kept_breaks_exact_ties_like_the_twin(seed):
    """Scores on a coarse grid tie often; both keep the older of equal tokens."""
    require_triton()
    for case in ("attention only", "no history", "everything"):
        kept, scores, *_ = run_case(choose_kept, **CASES[case], seed=seed, quantised=True)
        twin_kept, twin_scores, expected, *_ = run_case(choose_kept_torch, **CASES[case], seed=seed, quantised=True)
        if case == "attention only":  # exact in float32: the same tokens as the reference too
            assert torch.equal(kept, expected)
        assert torch.equal(kept, twin_kept)
        assert torch.equal(scores, twin_scores)


def test_choose_kept_keeps_everything_when_keep_is_the_length():
    require_triton()
    attention, rsum, lengths, num_previous, pool, sinks, score_group, tables = make_inputs()
    lengths = torch.full_like(lengths, 16)
    config = CompressionConfig(max_blocks_per_seq=WIDTH, window=4)
    kept, scores = choose_kept(attention, rsum, lengths, num_previous, pool, sinks, score_group, tables, config, 16,
                               BLOCK)
    assert torch.equal(kept, torch.arange(16).expand_as(kept))


def test_choose_kept_without_scores():
    require_triton()
    attention, rsum, lengths, num_previous, pool, sinks, score_group, tables = make_inputs()
    config = CompressionConfig(max_blocks_per_seq=WIDTH, window=4)
    args = (attention, rsum, lengths, num_previous, pool, sinks, None, tables, config, KEEP, BLOCK)
    kept, scores = choose_kept(*args, write_scores=False)
    twin_kept, _ = choose_kept_torch(*args)
    assert scores is None and torch.equal(kept, twin_kept)


def test_choose_kept_pool_flag_for_every_request():
    """pool=True (every request pools) is the all-true tensor, in the kernel as in the twin."""
    require_triton()
    attention, rsum, lengths, num_previous, _, sinks, score_group, tables = make_inputs(seed=3)
    config = CompressionConfig(max_blocks_per_seq=WIDTH, window=4, layer_group=LAYERS)
    args = (attention, rsum, lengths, num_previous)
    rest = (sinks, score_group, tables, config, KEEP, BLOCK)
    kept, scores = choose_kept(*args, True, *rest)
    flags, flag_scores = choose_kept(*args, torch.ones(len(LENGTHS), dtype=torch.bool), *rest)
    twin_kept, twin_scores = choose_kept_torch(*args, True, *rest)
    assert torch.equal(kept, flags) and torch.equal(scores, flag_scores)
    assert_same_choice(kept, twin_kept, reference_scores(*args, True, *rest[:4])[1])
