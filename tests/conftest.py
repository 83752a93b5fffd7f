"""Shared fixtures: tiny random checkpoints written by transformers, and HF references."""

from __future__ import annotations

import os

# Engine tests run on the CPU unless ZIPAGE_TEST_DEVICE=cuda (a GPU check).
TEST_DEVICE = os.environ.get("ZIPAGE_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    # Triton kernels run on the CPU through its interpreter; Triton reads this when a
    # kernel is defined, so it must be set before anything imports zipage.kernels.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from zipage.utils.checkpoint import make_checkpoint  # noqa: E402

# Llama with llama3 rope scaling whose original context is short, so scaling matters here.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

CHECKPOINTS = {
    "qwen3": dict(arch="qwen3"),
    "qwen2": dict(arch="qwen2"),
    "llama": dict(arch="llama", rope_scaling=LLAMA3_SCALING),
}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """``checkpoint_dir(name, **options)``: path of a tiny checkpoint, built once per session."""
    cache: dict = {}

    def build(name: str, **options) -> str:
        key = (name, tuple(sorted(options.items())))
        if key not in cache:
            settings = dict(CHECKPOINTS.get(name, {"arch": name}), **options)
            path = tmp_path_factory.mktemp(f"ckpt-{name}")
            cache[key] = make_checkpoint(str(path), initializer_range=0.05, seed=len(cache), **settings)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def hf_greedy():
    """``hf_greedy(model_dir, prompt_ids, n)``: transformers' greedy continuation (cached)."""
    from transformers import AutoModelForCausalLM
    models: dict = {}
    results: dict = {}

    def run(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (model_dir, tuple(prompt_ids), max_new_tokens)
        if key not in results:
            if model_dir not in models:
                models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            ids = torch.tensor([prompt_ids])
            with torch.no_grad():
                out = models[model_dir].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                                 eos_token_id=None, pad_token_id=0)
            results[key] = out[0, len(prompt_ids):].tolist()
        return results[key]

    return run


def make_llm(model_dir: str, **kwargs):
    """An engine on the test device, in float32 so that greedy tokens match transformers."""
    from zipage import LLM
    kwargs.setdefault("device", TEST_DEVICE)
    kwargs.setdefault("dtype", "float32")
    if TEST_DEVICE != "cpu":  # many engines share one GPU in a test session
        kwargs.setdefault("kv_cache_memory_bytes", 1 << 28)
    return LLM(model_dir, **kwargs)


def assert_pool_full(llm) -> None:
    """Every block is back in the free pool and no request is left."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks leaked"
    assert all(c == 0 for c in bm.ref_counts)
    assert engine._num_constrained == 0, f"{engine._num_constrained} requests with a grammar still counted"


# -- kernel-test helpers ---------------------------------------------------------
def require_triton():
    pytest.importorskip("triton")


def relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def assert_close(out, ref, tolerance):
    assert torch.isfinite(out).all(), "output has non-finite (unwritten or NaN) elements"
    error = relative_error(out, ref)
    assert error < tolerance, f"relative error {error:.3g} >= {tolerance:.3g}"
