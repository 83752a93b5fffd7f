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
