"""Mixture-of-experts: routing, the pair alignment, the grouped GEMM against its twin and float64."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close, require_triton


def _reference(x, w13, w2, logits, top_k, renormalize):
    """Float64, token by token: the definition of the MoE MLP."""
    probs = torch.softmax(logits.double(), -1)
    weights, ids = torch.topk(probs, top_k, -1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = ids[t, j]
            gate_up = w13[e].double() @ x[t].double()
            hidden = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weights[t, j] * (w2[e].double() @ hidden)
    return out


def _inputs(tokens, experts, hidden, inter, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    return x, w13, w2, logits


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 8, 2, 16), (37, 8, 2, 16), (5, 16, 4, 32)])
def test_align_pairs_puts_every_pair_once_in_its_experts_block(tokens, experts, top_k, block_m):
    from zipage.kernels.fused_moe import align_pairs
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    sorted_pairs, block_experts, num_rows = align_pairs(ids, experts, block_m)
    num_pairs = tokens * top_k
    used = sorted_pairs[:num_rows.item()]
    assert sorted(p for p in used.tolist() if p < num_pairs) == list(range(num_pairs))
    assert (sorted_pairs[num_rows.item():] == num_pairs).all()
    flat = ids.flatten()
    for row, pair in enumerate(used.tolist()):
        if pair < num_pairs:
            assert flat[pair] == block_experts[row // block_m]
    assert num_rows.item() % block_m == 0 and num_rows.item() <= sorted_pairs.numel()


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,renormalize", [
    (1, 8, 2, 64, 32, True), (23, 8, 2, 64, 48, False), (40, 16, 4, 96, 32, True)])
def test_fused_moe_matches_its_twin_and_float64(tokens, experts, top_k, hidden, inter, renormalize):
    require_triton()
    from zipage.kernels.fused_moe import fused_moe, fused_moe_torch
    x, w13, w2, logits = _inputs(tokens, experts, hidden, inter, seed=tokens + experts)
    reference = _reference(x, w13, w2, logits, top_k, renormalize)
    assert_close(fused_moe_torch(x, w13, w2, logits, top_k, renormalize), reference, 1e-5)
    assert_close(fused_moe(x, w13, w2, logits, top_k, renormalize), reference, 1e-5)


def test_fused_moe_float16():
    require_triton()
    from zipage.kernels.fused_moe import fused_moe
    x, w13, w2, logits = _inputs(19, 8, 64, 32, seed=3, dtype=torch.float16)
    assert_close(fused_moe(x, w13, w2, logits, 2, True), _reference(x, w13, w2, logits, 2, True), 5e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_fused_moe_cuda_bf16_matches_its_twin_and_holds_in_a_graph(tokens):
    from zipage.kernels.fused_moe import fused_moe, fused_moe_torch
    x, w13, w2, logits = (t.cuda() for t in _inputs(tokens, 128, 256, 64, seed=tokens, dtype=torch.bfloat16))
    reference = _reference(x.cpu(), w13.cpu(), w2.cpu(), logits.cpu(), 8, True)
    assert_close(fused_moe(x, w13, w2, logits, 8, True).cpu(), reference, 2e-2)
    assert_close(fused_moe_torch(x, w13, w2, logits, 8, True).cpu(), reference, 2e-2)
    out = fused_moe(x, w13, w2, logits, 8, True)  # compiled: capture it
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(x, w13, w2, logits, 8, True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert_close(captured.cpu(), _reference(x.cpu(), w13.cpu(), w2.cpu(), logits.cpu(), 8, True), 2e-2)
    del out


# -- the engine on tiny Qwen3-MoE checkpoints --------------------------------------
def _prompts(seed, vocab, lengths):
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("options", [{}, {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": ()}])
def test_moe_greedy_matches_transformers(checkpoint_dir, hf_greedy, options):
    from conftest import assert_pool_full, make_llm
    from zipage import SamplingParams
    model_dir = checkpoint_dir("qwen3_moe", **options)
    llm = make_llm(model_dir, block_size=16, max_num_seqs=8)
    layers = llm.engine.runner.model.model.layers
    sparse = [type(layer.mlp).__name__ == "SparseMoE" for layer in layers]
    assert sparse == ([True, False] if not options else [False, True])  # step 2: layer 1 of 0..1
    prompts = _prompts(1, llm.engine.vocab_size, [1, 17, 40])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 24)
    assert_pool_full(llm)


def test_moe_checkpoint_errors_name_the_tensor(checkpoint_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from conftest import make_llm
    source = checkpoint_dir("qwen3_moe")
    broken = tmp_path / "moe"
    shutil.copytree(source, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.w13 \(\(3, 'up_proj'\)\)"):
        make_llm(str(broken), block_size=16)


# -- FP8 experts ------------------------------------------------------------------------
def _fp8_experts(w):
    """(float8 experts, their row scales [E, rows]) of ``w`` [E, rows, columns], per row."""
    from zipage.layers import quant
    pairs = [quant.quantize_rows(w[e].float()) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _dequantized(q, s):
    return q.double() * s.double()[..., None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(1, 8, 2, 64, 32), (29, 8, 2, 64, 48),
                                                              (40, 16, 4, 96, 32)])
def test_fused_moe_fp8_experts_match_their_twin_and_float64(tokens, experts, top_k, hidden, inter, dtype):
    """W8A16: the float8 experts' exact values times their row scales, against float64 on the
    dequantized experts; the twin, in the kernel's order, too."""
    require_triton()
    from zipage.kernels.fused_moe import fused_moe, fused_moe_torch
    x, w13, w2, logits = _inputs(tokens, experts, hidden, inter, seed=7 * tokens + experts, dtype=dtype)
    (q13, s13), (q2, s2) = _fp8_experts(w13), _fp8_experts(w2)
    reference = _reference(x, _dequantized(q13, s13), _dequantized(q2, s2), logits, top_k, True)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-3
    twin = fused_moe_torch(x, q13, q2, logits, top_k, True, w13_scale=s13, w2_scale=s2)
    out = fused_moe(x, q13, q2, logits, top_k, True, w13_scale=s13, w2_scale=s2)
    assert out.dtype == twin.dtype == dtype
    assert_close(twin, reference, tolerance)
    assert_close(out, reference, tolerance)
    # and close to the unquantized experts: e4m3's rounding, a few percent
    assert_close(out, _reference(x, w13, w2, logits, top_k, True), 0.08)


def test_fused_moe_fp8_needs_its_scales():
    require_triton()
    from zipage.kernels.fused_moe import fused_moe
    x, w13, w2, logits = _inputs(3, 8, 64, 32, seed=1)
    (q13, s13), (q2, _) = _fp8_experts(w13), _fp8_experts(w2)
    with pytest.raises(AssertionError, match="weight_scale"):
        fused_moe(x, q13, q2, logits, 2, True, w13_scale=s13)


def _moe_layer(rank: int, size: int, monkeypatch, tensors: dict, fp8: bool = True):
    from zipage import distributed
    from zipage.layers import quant
    from zipage.layers.moe import SparseMoE
    monkeypatch.setattr(distributed, "_rank", rank)
    monkeypatch.setattr(distributed, "_size", size)
    with quant.fp8_linears(fp8):
        layer = SparseMoE(32, 16, 4, 2, True)
    for (expert, part), tensor in tensors.items():
        param = layer.w2 if part == "down_proj" else layer.w13
        layer.weight_loader(param, tensor, (expert, part))
    return layer


def _expert_tensors(experts=4, hidden=32, inter=16):
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for e in range(experts):
        for part in ("gate_proj", "up_proj"):
            tensors[(e, part)] = torch.randn(inter, hidden, generator=g) * (e + 1)
        tensors[(e, "down_proj")] = torch.randn(hidden, inter, generator=g)
    return tensors


def test_fp8_experts_are_quantized_per_row_and_sharded_with_their_scales(monkeypatch):
    """Each expert row holds its own scale; with tensor parallelism a rank holds its slice of
    every expert's intermediate rows (w13) with their scales, and of the columns of w2 with the
    scales of the whole rows, so that the ranks' partial outputs sum to one process's."""
    from zipage.kernels.fused_moe import fused_moe_torch
    from zipage.layers import quant
    tensors = _expert_tensors()
    whole = _moe_layer(0, 1, monkeypatch, tensors)
    assert whole.is_fp8 and whole.w13.dtype == whole.w2.dtype == quant.FP8
    q, s = quant.quantize_rows(tensors[(2, "up_proj")])
    assert torch.equal(whole.w13[2, 16:].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(whole.w13_scale[2, 16:], s)
    ranks = [_moe_layer(r, 2, monkeypatch, tensors) for r in range(2)]
    for r, layer in enumerate(ranks):
        rows = slice(8 * r, 8 * r + 8)
        for half in (0, 16):  # gate rows, then up rows
            assert torch.equal(layer.w13[:, half // 2:half // 2 + 8].view(torch.uint8),
                               whole.w13[:, half:half + 16][:, rows].view(torch.uint8))
            assert torch.equal(layer.w13_scale[:, half // 2:half // 2 + 8], whole.w13_scale[:, half:half + 16][:, rows])
        assert torch.equal(layer.w2_scale, whole.w2_scale)
        assert torch.equal(layer.w2.view(torch.uint8), whole.w2[:, :, rows].view(torch.uint8))
    g = torch.Generator().manual_seed(9)
    x, logits = torch.randn(6, 32, generator=g), torch.randn(6, 4, generator=g)

    def run(layer):
        return fused_moe_torch(x, layer.w13, layer.w2, logits, 2, True, w13_scale=layer.w13_scale,
                               w2_scale=layer.w2_scale)
    assert torch.allclose(run(ranks[0]) + run(ranks[1]), run(whole), rtol=1e-5, atol=1e-5)


def test_fp8_experts_unquantized_when_the_checkpoint_keeps_them(monkeypatch):
    layer = _moe_layer(0, 1, monkeypatch, {})
    layer.unquantize(torch.float32)
    assert not layer.is_fp8 and layer.w13.dtype == layer.w2.dtype == torch.float32
    tensors = _expert_tensors()
    for (expert, part), tensor in tensors.items():
        layer.weight_loader(layer.w2 if part == "down_proj" else layer.w13, tensor, (expert, part))
    assert torch.equal(layer.w2[1], tensors[(1, "down_proj")])


def _requantized_experts(name, tensor):
    """A checkpoint's expert tensors as fp8 experts hold them (rounded per row), the rest as they are."""
    from zipage.layers import quant
    from zipage.layers.moe import EXPERT_TENSOR
    if EXPERT_TENSOR.search(name) is None:
        return {name: tensor}
    return {name: quant.dequantize_rows(*quant.quantize_rows(tensor))}


def _rewrite(src, dst, transform, quantization_config=None):
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for key, value in load_file(os.path.join(src, "model.safetensors")).items():
        tensors.update(transform(key, value))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = quantization_config
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    return dst


def _greedy(model_dir, **kwargs):
    from conftest import assert_pool_full, make_llm
    from zipage import SamplingParams
    llm = make_llm(model_dir, block_size=16, max_num_seqs=8, **kwargs)
    prompts = _prompts(4, llm.engine.vocab_size, [3, 21, 40])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    model = llm.engine.runner.model
    assert_pool_full(llm)
    llm.close()
    return tokens, model


def test_moe_engine_fp8_experts_equal_requantized_checkpoint(checkpoint_dir, tmp_path, monkeypatch):
    """quantization="fp8" on a MoE checkpoint: float8 experts (the router kept), whose outputs
    are those of the checkpoint with its experts rounded per row as they are stored."""
    from zipage.layers import quant
    monkeypatch.setattr(quant, "FORCE_PATH", "dequant")  # the dense layers: plain float32 matmuls
    model_dir = checkpoint_dir("qwen3_moe")
    tokens, model = _greedy(model_dir, quantization="fp8")
    moe = model.model.layers[0].mlp
    assert moe.is_fp8 and moe.w13.dtype == quant.FP8 and moe.gate.weight.dtype == torch.float32
    dense_fp8_dir = _rewrite(model_dir, str(tmp_path / "experts-rounded"), _requantized_experts)
    rounded, _ = _greedy(dense_fp8_dir, quantization="fp8")
    # the same values; only the order of a product and its scale differs (float32 rounding)
    agreement = sum(a == b for x, y in zip(tokens, rounded) for a, b in zip(x, y)) / sum(map(len, tokens))
    assert agreement >= 0.9, agreement


def test_moe_block_fp8_checkpoint_loads_its_experts(checkpoint_dir, tmp_path):
    """Qwen's FP8 format for a MoE: every expert projection float8 with weight_scale_inv per
    128 x 128 block (the router too here; one layer's experts kept in modules_to_not_convert)."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_fp8_weights import _block_quantize

    from zipage.layers import quant
    from zipage.models.registry import build_model
    from zipage.utils.loader import load_config, load_weights
    model_dir = checkpoint_dir("qwen3_moe")
    kept = "model.layers.0.mlp.experts"

    def block(name, tensor):
        if not name.endswith("proj.weight") and not name.endswith("mlp.gate.weight") or name.startswith(kept):
            return {name: tensor}
        q, scale_inv = _block_quantize(tensor)
        return {name: q, name + "_scale_inv": scale_inv}

    fp8_dir = _rewrite(model_dir, str(tmp_path / "fp8"), block,
                       {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                        "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", kept]})
    model = build_model(load_config(fp8_dir), 64)
    load_weights(model, fp8_dir)
    layers = [layer.mlp for layer in model.model.layers if type(layer.mlp).__name__ == "SparseMoE"]
    assert layers and not layers[0].is_fp8 and layers[0].w13.dtype == torch.float32  # kept
    from safetensors.torch import load_file
    stored = load_file(f"{fp8_dir}/model.safetensors")
    for i, layer in enumerate(model.model.layers):
        if type(layer.mlp).__name__ != "SparseMoE" or i == 0:
            continue
        assert layer.mlp.is_fp8
        name = f"model.layers.{i}.mlp.experts.1.down_proj.weight"
        q, s = quant.quantize_rows(quant.dequantize_blocks(stored[name], stored[name + "_scale_inv"], (128, 128)))
        assert torch.equal(layer.mlp.w2[1].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(layer.mlp.w2_scale[1], s)
        assert layer.mlp.gate.weight.dtype == torch.float32  # the router: dequantized, never fp8


def test_moe_fp8_dummy_weights(checkpoint_dir):
    """Random fp8 experts in a named shape, built as the runner builds a bf16 model (under a
    bf16 default dtype): the scales stay float32."""
    from zipage.layers import quant
    from zipage.models.registry import build_model
    from zipage.utils.loader import init_dummy_weights, load_config
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_model(load_config(checkpoint_dir("qwen3_moe")), 64, quantization="fp8")
    finally:
        torch.set_default_dtype(default)
    init_dummy_weights(model, seed=0)
    moe = model.model.layers[0].mlp
    assert moe.w13_scale.dtype == moe.w2_scale.dtype == torch.float32
    values = _dequantized(moe.w13, moe.w13_scale)
    assert moe.w13.dtype == quant.FP8 and 0.015 < values.std() < 0.025
    assert torch.isfinite(moe.w2_scale).all() and (moe.w2_scale > 0).all()
    x = torch.randn(3, moe.w13.shape[2], dtype=torch.bfloat16)
    assert torch.isfinite(moe(x)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_fused_moe_cuda_fp8_experts_match_their_twin_and_hold_in_a_graph(tokens):
    """bf16 activations, float8 experts widened by the integer conversion, in a CUDA graph."""
    from zipage.kernels.fused_moe import fused_moe, fused_moe_torch
    x, w13, w2, logits = _inputs(tokens, 128, 256, 64, seed=tokens, dtype=torch.bfloat16)
    (q13, s13), (q2, s2) = _fp8_experts(w13), _fp8_experts(w2)
    reference = _reference(x, _dequantized(q13, s13), _dequantized(q2, s2), logits, 8, True)
    x, logits, q13, s13, q2, s2 = (t.cuda() for t in (x, logits, q13, s13, q2, s2))
    scales = dict(w13_scale=s13, w2_scale=s2)
    assert_close(fused_moe(x, q13, q2, logits, 8, True, **scales).cpu(), reference, 2e-2)
    assert_close(fused_moe_torch(x, q13, q2, logits, 8, True, **scales).cpu(), reference, 2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(x, q13, q2, logits, 8, True, **scales)
    x.copy_(torch.randn_like(x))
    graph.replay()
    expected = _reference(x.cpu(), _dequantized(q13, s13).cpu(), _dequantized(q2, s2).cpu(), logits.cpu(), 8, True)
    assert_close(captured.cpu(), expected, 2e-2)
