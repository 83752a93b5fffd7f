"""The compiled (fused) elementwise functions against their eager definitions."""

import pytest
import torch

from zipage.layers import fusion
from zipage.layers.activation import silu_and_mul
from zipage.layers.norm import add_rms_norm, rms_norm
from zipage.layers.rotary import apply_rope, norm_and_apply_rope
from zipage.layers.sampler import exponential_noise, exponential_race


def _inputs(tokens: int, gen: torch.Generator):
    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    return dict(x=randn(tokens, 64), r=randn(tokens, 64), w=randn(64), q=randn(tokens, 4, 16),
                k=randn(tokens, 2, 16), pos=torch.randint(0, 50, (tokens,), generator=gen), cos_sin=randn(50, 16),
                qw=randn(16), kw=randn(16), gate_up=randn(tokens, 96), logits=randn(tokens, 300) * 3,
                temps=torch.rand(tokens, generator=gen) + 0.3, seeds=torch.randint(0, 1 << 40, (tokens,), generator=gen),
                steps=torch.randint(0, 10_000, (tokens,), generator=gen))


def _run_all(a):
    return [rms_norm(a["x"], a["w"], 1e-6), *add_rms_norm(a["x"], a["r"], a["w"], 1e-6),
            *apply_rope(a["pos"], a["q"], a["k"], a["cos_sin"]),
            *norm_and_apply_rope(a["pos"], a["q"], a["k"], a["cos_sin"], a["qw"], a["kw"], 1e-6),
            silu_and_mul(a["gate_up"]), exponential_race(a["logits"], a["temps"], a["seeds"], a["steps"])]


@pytest.fixture
def fusion_on():
    fusion.enable_fusion(True)
    yield
    fusion.enable_fusion(False)


def test_fused_functions_match_eager(fusion_on):
    gen = torch.Generator().manual_seed(0)
    for tokens in (5, 1, 33):  # dynamic sizes, and the size-1 specialisation
        a = _inputs(tokens, gen)
        fusion.enable_fusion(False)
        eager = _run_all(a)
        fusion.enable_fusion(True)
        compiled = _run_all(a)
        for e, c in zip(eager, compiled):
            if e.is_floating_point():
                torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(c, e)


def test_exponential_race_is_the_probability_race():
    """argmax(logits / T - log E) picks the same token as argmax(softmax(logits / T) / E)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 1000, generator=gen, dtype=torch.float64) * 4
    temps = torch.rand(64, generator=gen, dtype=torch.float64) + 0.2
    seeds, steps = torch.arange(64) * 7919, torch.arange(64)
    noise = exponential_noise(seeds, steps, 1000).double()
    expected = ((logits / temps[:, None]).softmax(-1) / noise).argmax(-1)
    assert torch.equal(exponential_race(logits, temps, seeds, steps), expected)
