"""Tests of the sampler: filters, greedy rows, seeded noise, penalties, bans, parameters.

Every random input comes from a fixed seed and the sampling noise is a pure hash,
so each statistical check below is deterministic: its bound is loose enough to be
meaningful (a wrong distribution fails it by orders of magnitude) and it cannot flake.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zipage.layers.sampler as sampler_module
from zipage.engine.sequence import Sequence
from zipage.layers.sampler import Sampler, SamplingTensors, apply_top_k_top_p_min_p, exponential_noise
from zipage.runner.inputs import sampling_tensors
from zipage.runner.penalties import PenaltyState
from zipage.sampling_params import SamplingParams

CPU = torch.device("cpu")


# -- helpers --------------------------------------------------------------------------------------
def make_tensors(temperatures, seeds=None, steps=None, top_k=None, top_p=None, min_p=None,
                 banned=None) -> SamplingTensors:
    """SamplingTensors built by hand (the runner builds them with ``sampling_tensors``)."""
    n = len(temperatures)
    temps = torch.tensor(temperatures, dtype=torch.float32)
    st = SamplingTensors(
        temperatures=temps,
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        seeds=torch.tensor(seeds if seeds is not None else list(range(n)), dtype=torch.int64),
        steps=torch.tensor(steps if steps is not None else [0] * n, dtype=torch.int64),
        all_greedy=bool((temps == 0).all()))
    if banned:
        st.banned_rows = torch.tensor([r for r, _ in banned], dtype=torch.int64)
        st.banned_tokens = torch.tensor([t for _, t in banned], dtype=torch.int64)
    return st


def softmax64(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_keep(row: np.ndarray, k: int | None, p: float | None, mp: float | None) -> np.ndarray:
    """Tokens kept by top-k, then top-p (on the top-k renormalised mass), then min-p; float64."""
    order = np.argsort(-row, kind="stable")
    candidates = order if k is None else order[:k]
    probs = softmax64(row[candidates])  # descending, renormalised over the top-k
    mass_before = np.cumsum(probs) - probs
    keep = np.zeros(len(row), dtype=bool)
    for j, token in enumerate(candidates):
        if p is not None and mass_before[j] >= p:
            continue  # the mass before it already reaches top_p
        if mp is not None and probs[j] < mp * probs[0]:
            continue
        keep[token] = True
    return keep


def top_k_probs(row: np.ndarray, k: int | None) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-row, kind="stable")
    candidates = order if k is None else order[:k]
    return candidates, softmax64(row[candidates])


def safe_top_p(rng: np.random.Generator, row: np.ndarray, k: int | None, margin: float = 1e-4) -> float:
    """A top_p in (0, 1) at least ``margin`` away from every cumulative mass (no float ambiguity)."""
    _, probs = top_k_probs(row, k)
    boundaries = np.cumsum(probs) - probs
    while True:
        p = float(rng.uniform(0.02, 0.98))
        if np.abs(boundaries - p).min() > margin:
            return p


def safe_min_p(rng: np.random.Generator, row: np.ndarray, k: int | None, margin: float = 1e-4) -> float:
    """A min_p in (0, 1) at least ``margin`` away from every probability ratio p_j / p_max."""
    _, probs = top_k_probs(row, k)
    ratios = probs / probs[0]
    while True:
        mp = float(np.exp(rng.uniform(np.log(1e-3), np.log(0.9))))
        if np.abs(ratios - mp).min() > margin:
            return mp


def chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    expected = expected_probs * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts}"
    return float((((counts - expected) ** 2)[support] / expected[support]).sum())


def seq_with(params: SamplingParams, prompt=(1, 2, 3), outputs=(), seed=0, request_id="r") -> Sequence:
    seq = Sequence(request_id, None, list(prompt), params, params.max_tokens or 16, seed)
    seq.token_ids.extend(outputs)
    return seq


# -- top-k / top-p / min-p masks ------------------------------------------------------------------
@pytest.mark.parametrize("trial", range(8))
def test_filters_match_reference_per_row(trial):
    rng = np.random.default_rng(1000 + trial)
    batch, vocab = 48, 37
    logits = torch.from_numpy(rng.normal(0.0, rng.uniform(0.5, 4.0), size=(batch, vocab)).astype(np.float32))
    rows = logits.double().numpy()
    assert all(len(np.unique(r)) == vocab for r in rows), "ties in the random logits"
    ks, ps, mps, ref_settings = [], [], [], []
    for i in range(batch):
        use_k, use_p, use_m = rng.random(3) < 0.5
        k = int(rng.integers(1, vocab + 1)) if use_k else None
        p = safe_top_p(rng, rows[i], k) if use_p else None
        mp = safe_min_p(rng, rows[i], k) if use_m else None
        ks.append(vocab if k is None else k)  # the runner's encoding of a disabled row
        ps.append(1.0 if p is None else p)
        mps.append(0.0 if mp is None else mp)
        ref_settings.append((k, p, mp))
    out = apply_top_k_top_p_min_p(logits, torch.tensor(ks), torch.tensor(ps, dtype=torch.float32),
                                  torch.tensor(mps, dtype=torch.float32))
    for i, (k, p, mp) in enumerate(ref_settings):
        keep = reference_keep(rows[i], k, p, mp)
        got_keep = torch.isfinite(out[i]).numpy()
        assert (got_keep == keep).all(), f"row {i} (k={k}, p={p}, min_p={mp}): {got_keep} != {keep}"
        assert torch.equal(out[i][got_keep], logits[i][got_keep]), "kept logits must be unchanged"
        assert torch.isneginf(out[i][~got_keep]).all()
        assert keep.any()


@pytest.mark.parametrize("which", ["top_k", "top_p", "min_p"])
def test_each_filter_alone_matches_reference(which):
    rng = np.random.default_rng({"top_k": 1, "top_p": 2, "min_p": 3}[which])
    batch, vocab = 32, 50
    logits = torch.from_numpy(rng.normal(0.0, 2.0, size=(batch, vocab)).astype(np.float32))
    rows = logits.double().numpy()
    args = dict(top_k=None, top_p=None, min_p=None)
    settings = []
    for i in range(batch):
        if which == "top_k":
            settings.append(int(rng.integers(1, vocab + 1)))
        elif which == "top_p":
            settings.append(safe_top_p(rng, rows[i], None) if i % 4 else 1.0)
        else:
            settings.append(safe_min_p(rng, rows[i], None) if i % 4 else 0.0)
    dtype = torch.int64 if which == "top_k" else torch.float32
    args[which] = torch.tensor(settings, dtype=dtype)
    out = apply_top_k_top_p_min_p(logits, **args)
    for i, s in enumerate(settings):
        ref = dict(k=None, p=None, mp=None)
        if which == "top_k":
            ref["k"] = s
        elif which == "top_p" and s < 1.0:
            ref["p"] = s
        elif which == "min_p" and s > 0.0:
            ref["mp"] = s
        keep = reference_keep(rows[i], **ref)
        assert (torch.isfinite(out[i]).numpy() == keep).all(), f"row {i}, {which}={s}"


def test_top_k_keeps_exactly_k_largest():
    rng = np.random.default_rng(7)
    logits = torch.from_numpy(rng.normal(size=(5, 30)).astype(np.float32))
    ks = torch.tensor([1, 2, 7, 29, 30])
    out = apply_top_k_top_p_min_p(logits, ks, None, None)
    for i, k in enumerate(ks.tolist()):
        kept = set(torch.isfinite(out[i]).nonzero().flatten().tolist())
        assert kept == set(logits[i].topk(k).indices.tolist())


def test_disabled_rows_keep_every_token_even_with_a_long_tail():
    """top_p=1 and min_p=0 mean "off": no token is dropped, however small its probability.

    With peaked logits the float32 running sum of the sorted probabilities reaches 1.0
    before the tail; a disabled row must not lose that tail (nor depend on neighbours).
    """
    torch.manual_seed(0)
    logits = torch.randn(16, 4000) * 4.0
    out = apply_top_k_top_p_min_p(logits, torch.full((16,), 4000), torch.ones(16), torch.zeros(16))
    assert torch.equal(out, logits)
    # Disabled rows stay intact next to enabled rows.
    top_p = torch.ones(16)
    top_p[::2] = 0.5
    out = apply_top_k_top_p_min_p(logits, None, top_p, None)
    assert torch.equal(out[1::2], logits[1::2])
    assert torch.isneginf(out[::2]).any(dim=-1).all()


def test_first_token_always_kept():
    logits = torch.tensor([[5.0, 4.0, 3.0], [0.0, 10.0, -1.0]])
    out = apply_top_k_top_p_min_p(logits, torch.tensor([1, 1]), torch.tensor([1e-6, 1e-6]),
                                  torch.tensor([1.0, 1.0]))
    assert torch.isfinite(out).tolist() == [[True, False, False], [False, True, False]]


# -- greedy ---------------------------------------------------------------------------------------
def test_greedy_rows_return_argmax_in_mixed_batch():
    rng = np.random.default_rng(3)
    batch, vocab = 40, 64
    logits = torch.from_numpy(rng.normal(0.0, 1.0, size=(batch, vocab)).astype(np.float32))
    temps = [0.0 if i % 3 == 0 else float(rng.uniform(0.3, 2.0)) for i in range(batch)]
    st = make_tensors(temps, seeds=list(range(100, 100 + batch)), steps=[5] * batch,
                      top_k=[3 if i % 2 else vocab for i in range(batch)],
                      top_p=[0.5 if i % 5 else 1.0 for i in range(batch)], min_p=[0.1] * batch)
    tokens = Sampler()(logits, st)
    greedy = logits.argmax(dim=-1)
    for i in range(batch):
        if temps[i] == 0.0:
            assert tokens[i] == greedy[i]
    # Sampling rows are not all greedy (the batch really mixes both kinds).
    sampled_rows = [i for i in range(batch) if temps[i] > 0]
    assert any(tokens[i] != greedy[i] for i in sampled_rows)
    # An all-greedy batch is argmax too.
    st = make_tensors([0.0] * batch)
    assert torch.equal(Sampler()(logits, st), greedy)


def test_greedy_on_half_precision_logits_is_the_float_argmax():
    """The all-greedy path takes argmax on the logits as they come: the same token as on their
    float32 copy, ties (common in bfloat16) included."""
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(32, 500, generator=gen) * 3).to(torch.bfloat16)
    logits[:, 7] = logits[:, 300] = logits.max() + 1  # a tie for first place in every row
    tokens = Sampler()(logits, make_tensors([0.0] * 32))
    assert torch.equal(tokens, logits.float().argmax(dim=-1)) and (tokens == 7).all()


def test_sampled_tokens_respect_filters():
    """Whatever the noise, a sampled token lies inside the row's kept set."""
    rng = np.random.default_rng(11)
    batch, vocab = 2000, 20
    row = rng.normal(0.0, 1.5, size=vocab).astype(np.float32)
    logits = torch.from_numpy(np.tile(row, (batch, 1)))
    k, p, mp = 6, safe_top_p(rng, row.astype(np.float64), 6), 0.05
    keep = reference_keep(row.astype(np.float64), k, p, mp)
    st = make_tensors([1.3] * batch, seeds=list(range(batch)), top_k=[k] * batch, top_p=[p] * batch,
                      min_p=[mp] * batch)
    tokens = Sampler()(logits, st).numpy()
    assert keep[tokens].all()
    assert len(set(tokens.tolist())) == keep.sum(), "every kept token should show up in 2000 draws"


# -- seeded noise ---------------------------------------------------------------------------------
def _sample_row_in_batch(target_logits, target_settings, neighbours, position, rng):
    """Sample ``target`` placed at ``position`` among ``neighbours`` random rows."""
    vocab = target_logits.shape[-1]
    n = neighbours + 1
    logits = torch.from_numpy(rng.normal(0.0, 2.0, size=(n, vocab)).astype(np.float32))
    logits[position] = target_logits
    temps = rng.choice([0.0, 0.5, 1.0, 1.7], size=n).tolist()
    seeds = rng.integers(0, 2**62, size=n).tolist()
    steps = rng.integers(0, 1000, size=n).tolist()
    ks = [int(rng.integers(1, vocab + 1)) for _ in range(n)]
    ps = rng.uniform(0.1, 1.0, size=n).tolist()
    mps = rng.uniform(0.0, 0.3, size=n).tolist()
    temps[position], seeds[position], steps[position] = target_settings[:3]
    ks[position], ps[position], mps[position] = target_settings[3:]
    use = rng.random(3) < 0.5
    st = make_tensors(temps, seeds, steps,
                      top_k=ks if use[0] or target_settings[3] < vocab else None,
                      top_p=ps if use[1] or target_settings[4] < 1.0 else None,
                      min_p=mps if use[2] or target_settings[5] > 0.0 else None)
    return int(Sampler()(logits, st)[position])


@pytest.mark.parametrize("filters", [(64, 1.0, 0.0), (10, 0.9, 0.0), (64, 0.8, 0.02)],
                         ids=["no-filters", "top-k-top-p", "top-p-min-p"])
def test_seeded_sample_independent_of_batch(filters):
    rng = np.random.default_rng(42)
    vocab = 64
    for case in range(20):
        target = torch.from_numpy(rng.normal(0.0, 1.0, size=vocab).astype(np.float32))
        settings = (float(rng.uniform(0.5, 1.5)), int(rng.integers(0, 2**62)), int(rng.integers(0, 500)),
                    *filters)
        alone = _sample_row_in_batch(target, settings, 0, 0, rng)
        for neighbours in (1, 3, 8, 17):
            position = int(rng.integers(0, neighbours + 1))
            assert _sample_row_in_batch(target, settings, neighbours, position, rng) == alone, (
                f"case {case}: the token changed with {neighbours} neighbours at position {position}")


def test_noise_is_a_function_of_seed_step_and_token_only():
    seeds = torch.tensor([0, 1, 2**62, -5, 123456789], dtype=torch.int64)
    steps = torch.tensor([0, 0, 7, 3, 1000], dtype=torch.int64)
    full = exponential_noise(seeds, steps, 300)
    # Same values whatever the vocabulary size (a token's noise depends on its own id).
    assert torch.equal(exponential_noise(seeds, steps, 100), full[:, :100])
    # Same values whatever the batch: row by row, reversed.
    for i in range(len(seeds)):
        assert torch.equal(exponential_noise(seeds[i:i + 1], steps[i:i + 1], 300)[0], full[i])
    assert torch.equal(exponential_noise(seeds.flip(0), steps.flip(0), 300), full.flip(0))


def test_noise_differs_across_steps_and_seeds():
    vocab = 1000
    base = exponential_noise(torch.tensor([7]), torch.tensor([3]), vocab)[0]
    others = [((7, 4)), ((7, 2)), ((8, 3)), ((6, 3)), ((3, 7)), ((7 + 2**32, 3))]
    for seed, step in others:
        noise = exponential_noise(torch.tensor([seed]), torch.tensor([step]), vocab)[0]
        assert (noise == base).float().mean() < 0.01, f"(seed={seed}, step={step}) repeats (7, 3)"
    # Within one row, tokens get different values too.
    assert len(set(base.tolist())) > 0.99 * vocab


def test_exponential_noise_is_positive_finite_with_unit_mean():
    seeds = torch.arange(2000, dtype=torch.int64) * 7919 + 11
    steps = torch.arange(2000, dtype=torch.int64) % 37
    noise = exponential_noise(seeds, steps, 512).double()
    assert torch.isfinite(noise).all()
    assert (noise > 0).all()
    # Exp(1): mean 1, variance 1, P(E > 1) = 1/e. 1M draws: standard errors about 1e-3.
    assert abs(noise.mean().item() - 1.0) < 0.01
    assert abs(noise.var().item() - 1.0) < 0.03
    assert abs((noise > 1.0).double().mean().item() - np.exp(-1.0)) < 0.005


@pytest.mark.parametrize("hash_value", [0, -1, 1 << 40, (1 << 63) - 1, -(1 << 63)])
def test_exponential_noise_extreme_hashes_stay_in_open_interval(monkeypatch, hash_value):
    """The map from a 64-bit hash to Exp(1) noise must never give 0 (or inf) at the extremes."""
    monkeypatch.setattr(sampler_module, "_mix64", lambda x: torch.full_like(x, hash_value))
    noise = exponential_noise(torch.tensor([1]), torch.tensor([0]), 4)
    assert torch.isfinite(noise).all() and (noise > 0).all(), noise


def test_zero_noise_regression_never_picks_masked_token():
    """(seed 5129005, step 0) used to hash token 8 to noise -0.0, so p/E = 0/-0 = NaN won argmax."""
    seed, vocab = 5129005, 16
    noise = exponential_noise(torch.tensor([seed]), torch.tensor([0]), vocab)
    assert (noise > 0).all()
    logits = torch.zeros(1, vocab)
    logits[0, 0] = 10.0
    st = make_tensors([1.0], seeds=[seed], steps=[0], top_k=[1])
    assert Sampler()(logits, st).item() == 0
    st = make_tensors([1.0], seeds=[seed], steps=[0], banned=[(0, 8)])
    assert Sampler()(torch.zeros(1, vocab), st).item() != 8


# -- statistics of the exponential race -----------------------------------------------------------
LOGITS8 = np.array([2.0, 1.5, 1.0, 0.6, 0.1, -0.4, -1.0, -2.5], dtype=np.float32)
CHI2_BOUND = 40.0  # 7 degrees of freedom: P(chi2 > 40) ~ 1e-6; deterministic inputs anyway


def _counts(temperature, n=20000, seeds=None, steps=None, **filters) -> np.ndarray:
    logits = torch.from_numpy(np.tile(LOGITS8, (n, 1)))
    st = make_tensors([temperature] * n, seeds=seeds, steps=steps,
                      **{k: [v] * n for k, v in filters.items()})
    tokens = Sampler()(logits, st).numpy()
    return np.bincount(tokens, minlength=len(LOGITS8))


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.8])
def test_sample_frequencies_match_softmax(temperature):
    n = 20000
    expected = softmax64(LOGITS8.astype(np.float64) / temperature)
    many_seeds = _counts(temperature, seeds=(np.arange(n) * 2654435761 % (2**61)).tolist(), steps=[0] * n)
    one_seed = _counts(temperature, seeds=[12345] * n, steps=list(range(n)))  # one request, many steps
    for counts in (many_seeds, one_seed):
        assert chi_square(counts, expected) < CHI2_BOUND, (counts, expected * n)
        assert np.abs(counts / n - expected).max() < 0.02
    # The test has teeth: a neighbouring temperature is rejected by a wide margin.
    wrong = softmax64(LOGITS8.astype(np.float64) / (temperature * 1.25))
    assert chi_square(many_seeds, wrong) > 5 * CHI2_BOUND


def test_sample_frequencies_after_top_k_and_top_p_renormalisation():
    n, temperature = 20000, 0.9
    scaled = LOGITS8.astype(np.float64) / temperature
    seeds = list(range(n))
    # top-k = 4: the top four, renormalised.
    expected = np.zeros(8)
    expected[:4] = softmax64(scaled[:4])
    counts = _counts(temperature, seeds=seeds, top_k=4)
    assert chi_square(counts, expected) < CHI2_BOUND
    # top-p = 0.75: the smallest prefix whose mass reaches 0.75, renormalised.
    probs = softmax64(scaled)
    mass_before = np.cumsum(probs) - probs
    kept = mass_before < 0.75
    assert 2 <= kept.sum() < 8 and np.abs(mass_before - 0.75).min() > 1e-3
    expected = np.where(kept, probs, 0.0) / probs[kept].sum()
    counts = _counts(temperature, seeds=seeds, top_p=0.75)
    assert chi_square(counts, expected) < CHI2_BOUND
    # top-k = 6 then top-p = 0.75 of the renormalised top six; plus min-p = 0.2.
    probs6 = softmax64(scaled[:6])
    kept = ((np.cumsum(probs6) - probs6) < 0.75) & (probs6 >= 0.2 * probs6[0])
    expected = np.zeros(8)
    expected[:6] = np.where(kept, probs6, 0.0) / probs6[kept].sum()
    counts = _counts(temperature, seeds=seeds, top_k=6, top_p=0.75, min_p=0.2)
    assert chi_square(counts, expected) < CHI2_BOUND


# -- repetition penalty ---------------------------------------------------------------------------
def test_repetition_penalty_divides_positive_and_multiplies_negative():
    vocab = 6
    logits = torch.tensor([
        [3.0, 2.0, -5.0, -5.0, -5.0, -5.0],   # seen 0 (positive): 3/2 = 1.5 < 2 -> token 1
        [-1.0, -0.6, -5.0, -5.0, -5.0, -5.0],  # seen 1 (negative): -0.6*2 = -1.2 < -1 -> token 0
        [3.0, 2.0, -5.0, -5.0, -5.0, -5.0],   # seen 1 only: 3 untouched, 2/2 = 1 -> token 0
        [1.0, 1.9, -5.0, -5.0, -5.0, -5.0],   # penalty < 1 rewards seen 0: 1/0.5 = 2 > 1.9 -> 0
        [3.0, 2.0, -5.0, -5.0, -5.0, -5.0],   # penalty 1 (neighbour uses one): untouched -> 0
        [-2.0, -1.1, -5.0, -5.0, -5.0, -5.0],  # seen 0 (negative): -4 stays below unseen -1.1
    ])
    state = PenaltyState(6, vocab, CPU)
    state.prompt_mask[[0, 1, 2, 3, 5], [0, 1, 1, 0, 0]] = True  # the tokens each row has seen
    st = make_tensors([0.0] * 6)
    st.penalty_rows = torch.arange(6)
    st.repetition_penalty = torch.tensor([2.0, 2.0, 2.0, 0.5, 1.0, 2.0])
    st.frequency_penalty = st.presence_penalty = torch.zeros(6)
    assert Sampler(state)(logits, st).tolist() == [1, 0, 0, 0, 0, 1]
    # Without the penalty the picks are the plain argmax.
    assert Sampler()(logits, make_tensors([0.0] * 6)).tolist() == [0, 1, 0, 1, 0, 1]


def test_repetition_penalty_through_sampling_tensors():
    vocab = 8
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    penalised = seq_with(params, prompt=[3, 4], outputs=[5])
    plain = seq_with(SamplingParams(temperature=0.0), prompt=[3, 4], outputs=[5])
    state = PenaltyState(4, vocab, CPU)
    state.admit([penalised, plain])  # a prefill: only the penalised request takes a row
    assert state.rows == {penalised: 0}
    assert state.prompt_mask[0].tolist() == [t in (3, 4) for t in range(vocab)]
    assert state.counts[0].tolist() == [int(t == 5) for t in range(vocab)]
    st = sampling_tensors([penalised, plain], vocab, set(), CPU, state.rows)
    assert st.penalty_rows.tolist() == [0] and st.penalty_index.tolist() == [0]
    assert st.repetition_penalty.tolist() == [1.5]
    assert st.frequency_penalty.tolist() == st.presence_penalty.tolist() == [0.0]
    logits = torch.tensor([[0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 2.5, 0.0]] * 2)
    # 3/1.5 = 2 < 2.5 for the penalised row; the other row keeps token 3.
    assert Sampler(state)(logits, st).tolist() == [6, 3]


# -- min_tokens bans ------------------------------------------------------------------------------
def test_banned_tokens_never_sampled_or_chosen():
    n, vocab, eos, stop = 3000, 10, 9, 4
    logits = torch.zeros(n, vocab)
    logits[:, eos] = 20.0  # overwhelmingly likely if allowed
    logits[:, stop] = 19.0
    temps = [0.0 if i % 10 == 0 else 1.0 for i in range(n)]
    banned = [(i, t) for i in range(n) if i % 2 == 0 for t in (eos, stop)]
    st = make_tensors(temps, seeds=list(range(n)), banned=banned, top_p=[0.9] * n)
    tokens = Sampler()(logits, st).numpy()
    assert not np.isin(tokens[::2], [eos, stop]).any()
    assert (tokens[1::2] == eos).mean() > 0.5  # unbanned rows still pick it
    # Greedy banned rows take the best allowed token.
    st = make_tensors([0.0, 0.0], banned=[(0, eos)])
    assert Sampler()(logits[:2], st).tolist() == [stop, eos]


def test_min_tokens_bans_come_from_sampling_tensors():
    vocab, eos = 12, {10, 11}
    early = seq_with(SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[2, 50]), outputs=[7, 7])
    done = seq_with(SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[2]), outputs=[7, 7, 7])
    no_eos = seq_with(SamplingParams(temperature=1.0, min_tokens=2, ignore_eos=True, stop_token_ids=[3]))
    st = sampling_tensors([early, done, no_eos], vocab, eos, CPU)
    pairs = sorted(zip(st.banned_rows.tolist(), st.banned_tokens.tolist()))
    assert pairs == [(0, 2), (0, 10), (0, 11), (2, 3)]  # 50 is past the vocabulary
    logits = torch.zeros(3, vocab)
    logits[:, [2, 3, 10, 11]] = 30.0
    for seed in range(50):
        st.seeds = torch.tensor([seed, seed + 1, seed + 2])
        tokens = Sampler()(logits, st).tolist()
        assert tokens[0] not in (2, 10, 11) and tokens[2] != 3
        assert tokens[1] in (2, 3, 10, 11)
    # No bans at all: no tensors.
    st = sampling_tensors([done], vocab, eos, CPU)
    assert st.banned_rows is None and st.banned_tokens is None


# -- sampling_tensors -----------------------------------------------------------------------------
def test_sampling_tensors_optional_parts_only_when_used():
    vocab = 100
    plain = [seq_with(SamplingParams(temperature=0.8), seed=s, request_id=str(s)) for s in range(3)]
    st = sampling_tensors(plain, vocab, set(), CPU)
    assert st.top_k is None and st.top_p is None and st.min_p is None
    assert st.repetition_penalty is None and st.penalty_rows is None and st.banned_rows is None
    assert not st.all_greedy
    assert st.seeds.tolist() == [0, 1, 2]

    mixed = [seq_with(SamplingParams(temperature=0.8, top_k=5)),
             seq_with(SamplingParams(temperature=0.0, top_p=0.5)),
             seq_with(SamplingParams(temperature=1.0, min_p=0.1, top_k=0))]
    st = sampling_tensors(mixed, vocab, set(), CPU)
    assert st.top_k.tolist() == [5, vocab, vocab]
    assert st.top_p.tolist() == [1.0, 0.5, 1.0]
    assert st.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert st.temperatures.tolist() == pytest.approx([0.8, 0.0, 1.0])
    assert not st.all_greedy

    greedy = [seq_with(SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1))]
    st = sampling_tensors(greedy, vocab, set(), CPU)
    assert st.all_greedy and st.top_k is None and st.top_p is None and st.min_p is None


def test_sampling_tensors_steps_and_seeds():
    seqs = [seq_with(SamplingParams(), prompt=[1] * 5, outputs=[2] * n, seed=1000 + n, request_id=str(n))
            for n in (0, 1, 4)]
    st = sampling_tensors(seqs, 10, set(), CPU)
    assert st.steps.tolist() == [0, 1, 4]
    assert st.seeds.tolist() == [1000, 1001, 1004]
    assert st.steps.dtype == torch.int64 and st.seeds.dtype == torch.int64


def test_sampling_tensors_feed_the_sampler():
    """The runner's tensors plus the sampler: the same request samples the same token in any batch."""
    vocab = 50
    rng = np.random.default_rng(5)
    row = torch.from_numpy(rng.normal(size=vocab).astype(np.float32))
    target = seq_with(SamplingParams(temperature=0.9, seed=77), outputs=[1, 2], seed=77)
    alone = Sampler()(row[None], sampling_tensors([target], vocab, {0}, CPU)).item()
    state = PenaltyState(4, vocab, CPU)
    others = [seq_with(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=r),
                       seed=i, request_id=str(i))
              for i, (t, k, p, m, r) in enumerate([(1.0, 3, 0.5, 0.0, 1.2), (0.0, -1, 1.0, 0.3, 1.0),
                                                   (0.5, 10, 0.9, 0.05, 1.0)])]
    batch = others[:1] + [target] + others[1:]
    state.admit(batch)
    logits = torch.from_numpy(rng.normal(size=(4, vocab)).astype(np.float32))
    logits[1] = row
    assert Sampler(state)(logits, sampling_tensors(batch, vocab, {0}, CPU, state.rows))[1].item() == alone


# -- SamplingParams validation --------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(min_p=1.1), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(presence_penalty=2.01), r"presence_penalty must be in \[-2.0, 2.0\], got 2.01"),
    (dict(presence_penalty=float("inf")), "presence_penalty"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2.0, 2.0\], got -3"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed=1.5), "seed"),
    (dict(frobnicate=1), "frobnicate"),
])
def test_sampling_params_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_good_values():
    p = SamplingParams(temperature=0, top_p=1.0, top_k=0, min_p=1.0, max_tokens=1, min_tokens=1,
                       stop="x", stop_token_ids=[0, 5], seed=-3, repetition_penalty=0.5,
                       presence_penalty=-2, frequency_penalty=2.0)
    assert (p.presence_penalty, p.frequency_penalty) == (-2.0, 2.0) and p.has_penalties
    assert p.temperature == 0.0 and p.greedy
    assert p.top_k == -1  # 0 means disabled, stored as -1
    assert p.stop == ["x"] and p.stop_token_ids == [0, 5]
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(top_k=1).top_k == 1
    assert SamplingParams(top_p=1e-9).top_p == pytest.approx(1e-9)
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    assert SamplingParams(temperature=2).temperature == 2.0
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams().min_tokens == 0
