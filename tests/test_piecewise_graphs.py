"""Piecewise graphs: steps with prompt tokens run as pieces between attentions, each piece on
static buffers (replayed as CUDA graphs on a GPU, called as functions on the CPU). The pieces'
plumbing (buffers, padding to a bucket, the order of pieces and attentions) is checked against
the plain forward and transformers; with ZIPAGE_TEST_DEVICE=cuda, the captured graphs too."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import TEST_DEVICE, assert_pool_full, make_llm
from zipage import SamplingParams
from zipage.config import PIECEWISE_GRAPH_TOKENS, EngineConfig
from zipage.runner.piecewise_graph import PiecewiseGraphs, piecewise_token_sizes

NEW_TOKENS = 16


def test_token_sizes_cover_every_step_with_bounded_padding():
    for max_tokens in (1, 7, 8, 100, 128, 129, 640, 2048, 8192):
        sizes = piecewise_token_sizes(max_tokens)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens and sizes[0] >= 1
        for n in range(1, max_tokens + 1):
            bucket = next(s for s in sizes if s >= n)
            # at most doubled below 128 tokens, then under 128 tokens more (under 25% past 512)
            assert (bucket <= max(8, 2 * n)) if n <= 128 else (bucket - n < 128), (max_tokens, n, bucket)
    assert piecewise_token_sizes(2048)[:6] == [8, 16, 32, 64, 128, 256]
    with pytest.raises(ValueError, match="got 0"):
        piecewise_token_sizes(0)


@pytest.mark.parametrize("value", [-1, 1.5, "2048", 70000])
def test_bad_piecewise_graph_tokens_are_refused(value):
    with pytest.raises(ValueError, match=r"piecewise_graph_tokens must be an integer in \[0, 65536\] or None"):
        EngineConfig("m", device="cpu", piecewise_graph_tokens=value)


def test_the_default_piecewise_graph_tokens_is_on_for_one_gpu_only():
    assert EngineConfig("m", device="cpu").piecewise_graph_tokens == 0  # no graphs on the CPU
    assert EngineConfig("m", device="cpu", piecewise_graph_tokens=640).piecewise_graph_tokens == 640
    assert PIECEWISE_GRAPH_TOKENS == 2048
    if torch.cuda.is_available():
        assert EngineConfig("m").piecewise_graph_tokens == PIECEWISE_GRAPH_TOKENS


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_replayed_pieces_compose_like_the_layers(arch):
    """The pieces of a model around a stand-in attention (any function of q, k and v), replayed for
    steps of several sizes in turn, give what the layers give called one after the other."""
    from zipage.models.registry import build_model
    from zipage.utils.checkpoint import hf_config
    from zipage.utils.loader import init_dummy_weights

    device = torch.device("cuda" if TEST_DEVICE == "cuda" else "cpu")
    config = hf_config(arch, vocab_size=300)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    with torch.device(device):
        model = build_model(config, 256).eval()
    init_dummy_weights(model, seed=1)
    layers, decoder = model.model.layers, model.model

    def attention(q, k, v, out=None):  # depends on every head of q, k and v
        group = q.shape[1] // k.shape[1]
        result = torch.tanh(q) + (k * v).repeat_interleave(group, 1).sin()
        return result if out is None else out.copy_(result)

    def reference(ids, positions):
        hidden, residual = decoder.embed_tokens(ids), None
        for layer in layers:
            q, k, v, residual = layer.before_attention(positions, hidden, residual)
            hidden, residual = layer.after_attention(attention(q, k, v), residual)
        return decoder.norm(hidden, residual)[0]

    pieces = PiecewiseGraphs(model, 96, device)
    pieces.attention = [attention] * len(layers)  # written into the pieces' buffer, as the layers do
    with torch.inference_mode():
        pieces.capture()
        assert sorted(pieces.graphs) == [8, 16, 32, 64, 96]
        generator = torch.Generator().manual_seed(0)
        for n in (5, 96, 40, 1, 64, 40):  # padded and exact buckets, a large step before smaller ones
            ids = torch.randint(0, 300, (n,), generator=generator).to(device)
            positions = torch.randint(0, 256, (n,), generator=generator).to(device)
            torch.testing.assert_close(pieces.run(ids, positions), reference(ids, positions), rtol=1e-4, atol=1e-4)


class CheckedPieces(PiecewiseGraphs):
    """Pieces whose every step is also run through the plain forward (storing the same keys and
    values again) and compared."""

    def __init__(self, model, max_tokens, device):
        super().__init__(model, max_tokens, device)
        self.model = model
        self.steps, self.padded = 0, 0

    def run(self, input_ids, positions):
        hidden = super().run(input_ids, positions).clone()
        expected = self.model(input_ids, positions)
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
        self.steps += 1
        self.padded += next(t for t in self.sizes if t >= input_ids.shape[0]) > input_ids.shape[0]
        return hidden


def install(llm, max_tokens: int) -> CheckedPieces:
    runner = llm.engine.runner
    pieces = CheckedPieces(runner.model, max_tokens, runner.device)
    pieces.capture()
    runner.piecewise = pieces
    return pieces


def _prompts(seed: int, vocab: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _run(llm, arrivals: dict[int, list[tuple[str, list[int]]]], max_tokens: int = NEW_TOKENS):
    engine, done, step = llm.engine, {}, 0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    while arrivals or engine.has_unfinished_requests():
        for request_id, prompt in arrivals.pop(step, []):
            engine.add_request(prompt, params, request_id=request_id)
        outputs, _ = engine.step()
        done.update((o.request_id, o.outputs[0].token_ids) for o in outputs if o.finished)
        step += 1
        assert step < 10_000
    return done


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU's pieces are functions; see the CUDA test below")
@pytest.mark.parametrize("name", ["qwen3", "llama", "qwen3_moe"])
def test_pieces_match_the_plain_forward_and_transformers(checkpoint_dir, hf_greedy, name):
    model_dir = checkpoint_dir(name)
    # Chunks of 24 tokens beside decodes; steps over 20 tokens run the plain forward instead.
    llm = make_llm(model_dir, block_size=16, max_num_seqs=8, max_num_batched_tokens=24)
    pieces = install(llm, 20)
    prompts = _prompts(5, llm.engine.vocab_size, [3, 40, 9, 61, 17])
    arrivals = {0: [("0", prompts[0]), ("1", prompts[1])], 2: [("2", prompts[2])],
                5: [("3", prompts[3]), ("4", prompts[4])]}
    done = _run(llm, arrivals)
    for i, prompt in enumerate(prompts):
        assert done[str(i)] == hf_greedy(model_dir, prompt, NEW_TOKENS), f"prompt of {len(prompt)}"
    assert pieces.steps and pieces.padded, "no step ran through the pieces, or none was padded"
    assert_pool_full(llm)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU's pieces are functions; see the CUDA test below")
def test_pieces_with_compression_match_the_plain_forward(checkpoint_dir):
    from zipage.config import CompressionConfig

    model_dir = checkpoint_dir("qwen3")
    compression = CompressionConfig(kv_budget_tokens=32, window=4, prefill_compression="always")
    llm = make_llm(model_dir, block_size=16, max_num_seqs=4, max_num_batched_tokens=16, compression=compression)
    pieces = install(llm, 16)
    prompts = _prompts(9, llm.engine.vocab_size, [70, 5, 33])
    done = _run(llm, {0: [("0", prompts[0]), ("1", prompts[1])], 3: [("2", prompts[2])]}, max_tokens=60)
    assert all(len(tokens) == 60 for tokens in done.values())
    assert pieces.steps > 0 and llm.engine.stats.num_compressions > 0
    assert_pool_full(llm)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_engines_with_pieces_give_the_eager_engines_tokens(checkpoint_dir, name):
    """``piecewise_graph_tokens``: captured graphs on a GPU, the pieces as functions on the CPU."""
    model_dir = checkpoint_dir(name)
    prompts = _prompts(3, 256, [3, 150, 9, 300, 40, 1])
    arrivals = {0: [("0", prompts[0]), ("1", prompts[1])], 2: [("2", prompts[2]), ("3", prompts[3])],
                6: [("4", prompts[4]), ("5", prompts[5])]}
    results = {}
    for graph_tokens in (0, 96):
        llm = make_llm(model_dir, block_size=16, max_num_seqs=8, max_num_batched_tokens=128,
                       piecewise_graph_tokens=graph_tokens)
        runner = llm.engine.runner
        assert (runner.piecewise is not None) == (graph_tokens > 0)
        if graph_tokens:
            assert runner.piecewise.sizes[-1] == 96 and all(len(g) == len(runner.model.model.layers) + 1
                                                            for g in runner.piecewise.graphs.values())
        results[graph_tokens] = _run(llm, {k: list(v) for k, v in arrivals.items()}, max_tokens=32)
        assert_pool_full(llm)
        del llm
    assert results[96] == results[0]
