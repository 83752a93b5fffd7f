"""The RMSNorm and norm + RoPE Triton kernels against their eager twins and a float64
reference written here from the formulas, then inside a whole model against transformers.

The kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET, read when
the kernels are decorated, i.e. at import time).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.conftest import assert_close, make_llm, require_triton  # noqa: E402
from zipage.kernels.norm_rope import add_rms_norm_triton, norm_rope_triton, rms_norm_triton, rope_triton  # noqa: E402
from zipage.layers import fusion  # noqa: E402
from zipage.layers.norm import add_rms_norm, rms_norm_eager  # noqa: E402
from zipage.layers.rotary import apply_rope, norm_and_apply_rope  # noqa: E402

EPS = 1e-6
# float32: only the order of a sum differs; float16: one rounding step of the output may differ
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def reference_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return weight.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)


def reference_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, d] float64: pair (i, i + d/2) rotated by the angle of its position."""
    half = x.shape[-1] // 2
    cos = cos_sin[positions, :half].double()[:, None, :]
    sin = cos_sin[positions, half:].double()[:, None, :]
    x1, x2 = x.double()[..., :half], x.double()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [96, 128])
@pytest.mark.parametrize("tokens", [1, 7])
def test_rms_norm_kernels_match_twin_and_reference(dtype, hidden, tokens):
    require_triton()
    gen = torch.Generator().manual_seed(hidden + tokens)
    wide = _randn(gen, tokens, hidden + 32, dtype=dtype)
    x = wide[:, 16:16 + hidden]  # strided rows, as a slice of a wider output
    residual = _randn(gen, tokens, hidden, dtype=dtype)
    weight = _randn(gen, hidden, dtype=dtype)

    out = rms_norm_triton(x, weight, EPS)
    assert_close(out, rms_norm_eager(x, weight, EPS).double(), TOLERANCE[dtype])
    assert_close(out, reference_norm(x, weight), TOLERANCE[dtype])

    out, summed = add_rms_norm_triton(x, residual, weight, EPS)
    twin_out, twin_summed = add_rms_norm.eager(x, residual, weight, EPS)
    assert torch.equal(summed, twin_summed)  # the add rounds exactly as PyTorch's
    assert_close(out, twin_out.double(), TOLERANCE[dtype])
    assert_close(out, reference_norm(summed, weight), TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(6, 2, 32), (4, 4, 16), (5, 1, 48)])
def test_norm_rope_kernel_matches_twins_and_reference(dtype, heads, kv_heads, head_dim):
    require_triton()
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    tokens = 9
    qkv = _randn(gen, tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)  # strided views, as in the model
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    angles = torch.rand(64, head_dim // 2, generator=gen) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    q_weight, k_weight = _randn(gen, head_dim, dtype=dtype), _randn(gen, head_dim, dtype=dtype)

    q_out, k_out = rope_triton(positions, q, k, cos_sin)
    for out, twin, x in zip((q_out, k_out), apply_rope.eager(positions, q, k, cos_sin), (q, k)):
        assert_close(out, twin.double(), TOLERANCE[dtype])
        assert_close(out, reference_rope(x, positions, cos_sin), TOLERANCE[dtype])

    q_out, k_out = norm_rope_triton(positions, q, k, cos_sin, q_weight, k_weight, EPS)
    twins = norm_and_apply_rope.eager(positions, q, k, cos_sin, q_weight, k_weight, EPS)
    for out, twin, x, w in zip((q_out, k_out), twins, (q, k), (q_weight, k_weight)):
        assert out.is_contiguous()
        assert_close(out, twin.double(), TOLERANCE[dtype])
        assert_close(out, reference_rope(reference_norm(x, w), positions, cos_sin), TOLERANCE[dtype])


@pytest.mark.parametrize("dtype, heads, kv_heads, head_dim, norm, cache, query", [
    (torch.float32, 6, 2, 32, True, "model", True),
    (torch.float16, 4, 4, 16, False, "model", False),
    (torch.float32, 5, 1, 32, True, "fp8", True),
    (torch.float16, 6, 2, 16, True, "fp8", False),
])
def test_norm_rope_store_is_norm_rope_then_store(dtype, heads, kv_heads, head_dim, norm, cache, query):
    """The fused kernel (query/key norm, RoPE and the KV store in one launch) gives what the two
    kernels give one after the other, bit for bit: the rotated queries and keys, the cache slots
    (float8 with their scales, the values token-major, as the engine keeps a float8 cache), the
    observation-window rows, and nothing at padding slots."""
    require_triton()
    from zipage.kernels.common import FP8_DTYPE
    from zipage.kernels.norm_rope import norm_rope_store_kv
    from zipage.kernels.store_kv import store_kv

    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    tokens, blocks, block_size = 11, 4, 8
    qkv = _randn(gen, tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))  # strided views, as in the model
    k = k * torch.logspace(-3, 2, tokens)[:, None, None].to(dtype)  # rows of every size: the scales differ
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    angles = torch.rand(64, head_dim // 2, generator=gen) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    weights = (_randn(gen, head_dim, dtype=dtype), _randn(gen, head_dim, dtype=dtype)) if norm else (None, None)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[[1, 6]] = -1  # padding rows
    rows = torch.randperm(16, generator=gen)[:tokens]  # distinct, as the engine gives (or a spare row)
    results = []
    for fused in (True, False):
        cache_dtype = FP8_DTYPE if cache == "fp8" else dtype
        k_cache = torch.full((blocks, block_size, kv_heads, head_dim), 3.0).to(cache_dtype)
        v_cache = k_cache.movedim(-3, -1).contiguous().movedim(-1, -3) if cache == "fp8" else k_cache.clone()
        scales = dict(k_scale=torch.full((blocks, block_size, kv_heads), -1.0),
                      v_scale=torch.full((blocks, block_size, kv_heads), -1.0)) if cache == "fp8" else {}
        query_cache = torch.zeros(16, heads, head_dim, dtype=dtype) if query else None
        window = (query_cache, rows) if query else (None, None)
        if fused:
            q_out, k_out = norm_rope_store_kv(positions, q, k, v, cos_sin, *weights, EPS, k_cache, v_cache, slots,
                                              *window, **scales)
        else:
            q_out, k_out = norm_rope_triton(positions, q, k, cos_sin, *weights, EPS)
            store_kv(k_out, v, k_cache, v_cache, slots, q_out if query else None, *window, **scales)
        results.append([q_out, k_out, k_cache.float(), v_cache.float(), *scales.values(),
                        *([query_cache] if query else [])])
    for fused, separate in zip(*results):
        assert torch.equal(fused, separate)
    k_cache = results[0][2].view(-1, kv_heads, head_dim)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.all(k_cache[untouched] == 3) and not torch.all(k_cache[~untouched] == 3)


def test_no_tokens():
    require_triton()
    x = torch.empty(0, 64)
    assert rms_norm_triton(x, torch.ones(64), EPS).shape == (0, 64)
    q, k = norm_rope_triton(torch.empty(0, dtype=torch.int64), torch.empty(0, 4, 16), torch.empty(0, 2, 16),
                            torch.zeros(8, 16), torch.ones(16), torch.ones(16), EPS)
    assert q.shape == (0, 4, 16) and k.shape == (0, 2, 16)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_model_with_the_kernels_gives_transformers_tokens(arch, checkpoint_dir, hf_greedy):
    """Fusion on (as on CUDA): every norm and RoPE of the model runs through the kernels."""
    require_triton()
    from zipage import SamplingParams
    from zipage.layers import norm, rotary

    model_dir = checkpoint_dir(arch)
    llm = make_llm(model_dir, block_size=16, max_model_len=128)
    prompts = [[5 + i, 17, 33 + 2 * i, 8, 90 - i] for i in range(3)]
    wrappers = [norm.rms_norm, norm.add_rms_norm, rotary.apply_rope, rotary.norm_and_apply_rope]
    kernels = [w.kernel for w in wrappers]
    calls = {w.__name__: 0 for w in wrappers}

    def counted(name, kernel):
        def run(*args):
            calls[name] += 1
            return kernel(*args)
        return run

    fusion.enable_fusion(True)  # process-wide, and the engine was built with it off (CPU)
    try:
        for w, k in zip(wrappers, kernels):
            w.kernel = counted(w.__name__, k)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    finally:
        fusion.enable_fusion(False)
        for w, k in zip(wrappers, kernels):
            w.kernel = k
    rope = "norm_and_apply_rope" if arch == "qwen3" else "apply_rope"
    assert calls["rms_norm"] > 0 and calls["add_rms_norm"] > 0 and calls[rope] > 0
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 6)


@pytest.mark.parametrize("kv_cache_dtype, compressed", [("auto", False), ("auto", True), ("fp8", True)])
def test_engine_norms_rotates_and_stores_in_one_launch(kv_cache_dtype, compressed, checkpoint_dir, hf_greedy,
                                                       monkeypatch):
    """With the Triton backend and fusion on (as on CUDA), each layer's query/key norm, RoPE and KV
    store run as one launch, also under compression (the queries into the observation window too):
    the greedy tokens are those of the two launches, and without compression transformers'."""
    require_triton()
    from tests.conftest import assert_pool_full
    from zipage import CompressionConfig, SamplingParams
    from zipage.attention import triton_backend
    from zipage.kernels import norm_rope

    model_dir = checkpoint_dir("qwen3")
    # 30 tokens each: with compression each request outgrows its two blocks of 16 within three
    # tokens, is compressed and decodes the rest from the compacted cache
    prompts = [[5 + i, 17, 33 + 2 * i, 8, 90 - i] * 6 for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    launches = {"fused": 0}
    fused_kernel = norm_rope.norm_rope_store_kv

    def counted(*args, **kwargs):
        launches["fused"] += 1
        return fused_kernel(*args, **kwargs)

    monkeypatch.setattr(norm_rope, "norm_rope_store_kv", counted)
    tokens = {}
    for fuse in (True, False):
        monkeypatch.setattr(triton_backend, "FUSE_ROPE_STORE", fuse)
        llm = make_llm(model_dir, block_size=16, max_model_len=128, kv_cache_dtype=kv_cache_dtype,
                       compression=CompressionConfig(max_blocks_per_seq=2) if compressed else None)
        runner = llm.engine.runner
        runner.backend = triton_backend.TritonBackend(use_flash_prefill=False)
        for layer in runner.model.attention_layers():
            layer.backend = runner.backend
        before = launches["fused"]
        fusion.enable_fusion(True)  # process-wide, and the engine was built with it off (CPU)
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            fusion.enable_fusion(False)
        assert (launches["fused"] > before) == fuse
        assert (llm.engine.stats.num_compressions > 0) == compressed
        assert_pool_full(llm)
        tokens[fuse] = [o.outputs[0].token_ids for o in outputs]
    assert tokens[True] == tokens[False]
    if not compressed:
        assert tokens[True] == [hf_greedy(model_dir, p, 8) for p in prompts]
