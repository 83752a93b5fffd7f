"""The compressed engine against an independent float64 simulation of the method.

The test runs its own decoder, token by token, on the checkpoint's weights (in
float64, through transformers' modules), keeps a separate cache per layer and KV
head, and compresses it with the float64 reference of the scoring pipeline
whenever the engine's rule says so. Eviction is then checked where it matters:
the engine's logits after every compression equal the logits of a model that
attends to exactly the kept tokens, and the history scores stored after two
compressions equal max(A2, gamma * G1) as the reference computes them.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from zipage import CompressionConfig, SamplingParams
from zipage.compression import reference
from tests.conftest import make_llm

BLOCK = 16


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class _NeverFull:
    """A config whose budget ``step`` never finds full (tokens within one chunk)."""

    def __init__(self, config):
        self._config = config
        self.max_blocks_per_seq = float("inf")

    def __getattr__(self, name):
        return getattr(self._config, name)


class ReferenceCompressedDecoder:
    """One request, one token at a time, with per-(layer, KV head) caches and float64 scoring."""

    def __init__(self, model_dir: str, config: CompressionConfig, prompt_len: int):
        self.protected = config.protected_tokens(prompt_len)
        with open(f"{model_dir}/config.json") as f:
            moe = "moe" in json.load(f)["model_type"]  # experts in plain PyTorch: grouped GEMMs take no float64
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64,
                                                       **({"experts_implementation": "eager"} if moe else {})).eval()
        c = self.hf.config
        self.config = config
        self.num_layers, self.heads, self.kv_heads = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.group = self.heads // self.kv_heads
        # caches[layer] = (keys [kv_heads, n, d], values [kv_heads, n, d]); scores [layers, kv_heads, n]
        self.keys = [torch.zeros(self.kv_heads, 0, self.head_dim, dtype=torch.float64) for _ in range(self.num_layers)]
        self.values = [k.clone() for k in self.keys]
        self.scores = torch.zeros(self.num_layers, self.kv_heads, 0, dtype=torch.float64)
        self.num_previous = 0
        self.num_compressions = 0
        self.queries: list[torch.Tensor] = []  # per cached token: [layers, heads, d]

    @property
    def kv_len(self) -> int:
        return self.keys[0].shape[1]

    @torch.no_grad()
    def step(self, token: int, position: int) -> torch.Tensor:
        """Cache one token (compressing first if the budget is full) and return its logits."""
        cfg = self.config
        if self.kv_len >= cfg.max_blocks_per_seq * BLOCK:
            self.compress()
        m = self.hf.model
        x = m.embed_tokens(torch.tensor([[token]]))
        cos, sin = m.rotary_emb(x, torch.tensor([[position]]))
        step_queries = []
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)[0, 0]
            q = attn.q_proj(h).view(self.heads, self.head_dim)
            k = attn.k_proj(h).view(self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos[0] + _rotate_half(q) * sin[0]
            k = k * cos[0] + _rotate_half(k) * sin[0]
            step_queries.append(q)
            self.keys[i] = torch.cat([self.keys[i], k[:, None]], dim=1)
            self.values[i] = torch.cat([self.values[i], v[:, None]], dim=1)
            kv_of_head = torch.arange(self.heads) // self.group
            logits = torch.einsum("hd,hnd->hn", q, self.keys[i][kv_of_head]) * self.head_dim ** -0.5
            out = torch.einsum("hn,hnd->hd", logits.softmax(-1), self.values[i][kv_of_head])
            x = x + attn.o_proj(out.reshape(1, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.queries.append(torch.stack(step_queries))
        self.scores = torch.cat([self.scores, torch.zeros(self.num_layers, self.kv_heads, 1,
                                                          dtype=torch.float64)], dim=-1)
        return self.hf.lm_head(m.norm(x))[0, 0]

    @torch.no_grad()
    def chunk(self, tokens: list[int], start: int) -> torch.Tensor:
        """Cache a prompt chunk (positions ``start``...), compressing first if the budget is full,
        as the engine does between the chunks of a prompt; the logits of its last token."""
        if self.kv_len >= self.config.max_blocks_per_seq * BLOCK:
            self.compress()
        limit, self.config = self.config, _NeverFull(self.config)  # no compression inside the chunk
        try:
            for i, token in enumerate(tokens):
                logits = self.step(token, start + i)
        finally:
            self.config = limit
        return logits

    def compress(self) -> None:
        cfg, n, w = self.config, self.kv_len, self.config.window
        keep = cfg.kv_budget_tokens
        queries = torch.stack(self.queries[-w:], dim=1)[None]  # [1, L, w, Hq, d]
        keys = torch.stack(self.keys)[None]  # [1, L, H, n, d]
        lengths = torch.tensor([n])
        kept, history, combined = reference.score_tokens_with_scores(
            queries, keys, lengths, self.scores[None], torch.tensor([self.num_previous]), cfg,
            self.head_dim ** -0.5, keep, BLOCK, pool=self.num_compressions == 0, sinks=[self.protected])
        self.last_combined = combined[0]
        kept = kept[0]  # [L, H, keep]
        for i in range(self.num_layers):
            index = kept[i][..., None].expand(-1, -1, self.head_dim)
            self.keys[i] = self.keys[i].gather(1, index)
            self.values[i] = self.values[i].gather(1, index)
        self.scores = history[0].gather(-1, kept)
        self.queries = self.queries[-w:]  # the window is kept, so its queries stay valid
        self.num_previous = keep
        self.num_compressions += 1


def _engine_keeping_logits(model_dir: str, config: CompressionConfig, **options):
    """An engine and the list of every ``compute_logits`` result it makes. Eager: a CUDA graph
    replay would bypass ``compute_logits``; without asynchronous scheduling each step returns
    its own token, checked in lock step."""
    llm = make_llm(model_dir, block_size=BLOCK, compression=config, enforce_eager=True, async_scheduling=False,
                   **options)
    model = llm.engine.runner.model
    captured = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: captured.append(compute_logits(hidden)) or captured[-1]
    return llm, captured


@pytest.mark.parametrize("arch, redundancy, keep_prompt", [
    ("qwen3", "lightning", False), ("llama", "raw", False), ("qwen2", "off", False), ("qwen3", "lightning", True),
    ("qwen3_moe", "lightning", False)])
def test_engine_matches_reference_simulation(checkpoint_dir, arch, redundancy, keep_prompt):
    model_dir = checkpoint_dir(arch)
    config = CompressionConfig(max_blocks_per_seq=4, window=8, redundancy=redundancy, attention_sink=2,
                               keep_prompt=keep_prompt,
                               asynchronous=False)  # a compressed request decodes in the same step
    llm, captured = _engine_keeping_logits(model_dir, config)
    resolved, engine = llm.config.compression, llm.engine

    rng = random.Random(5)
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(21)]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=110, ignore_eos=True), request_id="r")
    seq = engine._requests["r"]
    ref = ReferenceCompressedDecoder(model_dir, resolved, len(prompt))
    assert ref.protected == (min(len(prompt), resolved.kv_budget_tokens // 2) if keep_prompt else 2)
    for position, token in enumerate(prompt[:-1]):
        ref.step(token, position)

    score_cache = engine.runner.compressor.score_cache
    tokens, compared_scores = list(prompt), False
    while engine.has_unfinished_requests():
        compressions_before = ref.num_compressions
        ref_logits = ref.step(tokens[-1], len(tokens) - 1)
        finished, _ = engine.step()
        engine_logits = captured[-1][-1].double().cpu()
        assert seq.metrics.num_compressions == ref.num_compressions, "compression trigger differs"
        err = (engine_logits - ref_logits).abs().max().item()
        assert err < 1e-4, f"logits differ by {err} at position {len(tokens) - 1}"
        token = int(engine_logits.argmax())
        assert token == int(ref_logits.argmax())
        tokens.append(token)
        if ref.num_compressions == 2 and compressions_before == 1:
            # History after two compressions: the engine's stored scores of the kept tokens.
            keep = resolved.kv_budget_tokens
            table = seq.block_table.array()
            slots = [table[j // BLOCK] * BLOCK + j % BLOCK for j in range(keep)]
            stored = score_cache.flatten(1, 2)[:, slots].permute(0, 2, 1).double().cpu()  # [L, H, keep]
            torch.testing.assert_close(stored, ref.scores[..., :keep], rtol=1e-4, atol=1e-7)
            compared_scores = True
        if finished:
            assert finished[0].outputs[0].token_ids == tokens[len(prompt):]
    assert ref.num_compressions >= 3 and compared_scores


def test_prompt_compressed_between_chunks_matches_reference_simulation(checkpoint_dir):
    """A prompt of 150 tokens in chunks of 24 under a budget of 3 blocks of 16: compressed
    between its chunks (each compression's window: the last chunk's last 8 queries), then
    while decoding; the engine's logits after the prompt and at every decode step equal the
    float64 simulation's, and the compressions happen at the same points."""
    model_dir = checkpoint_dir("qwen3")
    config = CompressionConfig(max_blocks_per_seq=4, window=8, attention_sink=2, asynchronous=False,
                               prefill_compression="always")
    llm, captured = _engine_keeping_logits(model_dir, config, max_num_batched_tokens=24)
    resolved, engine = llm.config.compression, llm.engine

    rng = random.Random(7)
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(150)]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), request_id="r")
    seq = engine._requests["r"]
    assert seq.compress_prefill
    ref = ReferenceCompressedDecoder(model_dir, resolved, len(prompt))
    most_blocks, prefill_compressions = 0, 0
    while seq.prefilling or seq.num_output_tokens == 0:
        engine.step()
        start, n = seq.chunk
        ref_logits = ref.chunk(prompt[start:start + n], start)
        assert seq.metrics.num_compressions == ref.num_compressions, "compression trigger differs"
        most_blocks = max(most_blocks, len(seq.block_table))
        prefill_compressions = ref.num_compressions
    assert prefill_compressions >= 3 and most_blocks <= 4 + 2  # N blocks plus one chunk's
    engine_logits = captured[-1][-1].double().cpu()
    err = (engine_logits - ref_logits).abs().max().item()
    assert err < 1e-4, f"logits after the prompt differ by {err}"
    tokens = list(prompt) + [int(engine_logits.argmax())]
    assert tokens[-1] == int(ref_logits.argmax())
    while engine.has_unfinished_requests():
        ref_logits = ref.step(tokens[-1], len(tokens) - 1)
        engine.step()
        engine_logits = captured[-1][-1].double().cpu()
        assert seq.metrics.num_compressions == ref.num_compressions, "compression trigger differs"
        err = (engine_logits - ref_logits).abs().max().item()
        assert err < 1e-4, f"logits differ by {err} at position {len(tokens) - 1}"
        tokens.append(int(engine_logits.argmax()))
        assert tokens[-1] == int(ref_logits.argmax())
    assert ref.num_compressions > prefill_compressions
