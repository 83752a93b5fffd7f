"""The Llama-style decoder shared by Llama, Qwen2, Qwen3 and Qwen3-MoE.

The families differ only in a few switches (``DecoderSpec``): biases on the
attention projections, a per-head RMSNorm on queries and keys (Qwen3), the
RoPE scaling read from the config, and which layers have a mixture-of-experts
MLP in place of the dense one (Qwen3-MoE; ``layers/moe.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from zipage.kernels.fp8_linear import silu_mul_quantize
from zipage.layers import quant
from zipage.layers.activation import SiluAndMul
from zipage.layers.attention import Attention
from zipage.layers.embedding import LMHead, VocabEmbedding
from zipage.layers.linear import RowParallelLinear, gate_up_linear, local_heads, qkv_linear
from zipage.layers.moe import SparseMoE
from zipage.layers.norm import RMSNorm
from zipage.layers.rotary import RopeInputs, RotaryEmbedding


@dataclass(frozen=True)
class DecoderSpec:
    """The architecture's switches, read from a HuggingFace config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # Mixture of experts: the layers whose MLP is sparse, and its shape
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False


class DecoderAttention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_index: int, max_position: int):
        super().__init__()
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads = local_heads(spec.num_heads, spec.num_kv_heads)
        self.head_dim = spec.head_dim
        self.q_size, self.kv_size = self.num_heads * spec.head_dim, self.num_kv_heads * spec.head_dim
        self.qkv_proj = qkv_linear(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.qkv_bias)
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, spec.o_bias)
        self.rotary_emb = RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta, spec.rope_scaling)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.attn = Attention(layer_index, self.num_heads, self.num_kv_heads, spec.head_dim, spec.head_dim ** -0.5)

    def project(self, positions: torch.Tensor, hidden: torch.Tensor, rotate: bool = True):
        """Queries, keys and values of ``hidden``: [tokens, heads or kv_heads, head_dim], the queries
        and keys normed (Qwen3) and rotated unless ``rotate`` is False (``rope_inputs`` then says how)."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if rotate:
            q, k = self.rope_inputs(positions).apply(q, k)
        return q, k, v

    def rope_inputs(self, positions: torch.Tensor) -> RopeInputs:
        if self.qk_norm:
            return RopeInputs(positions, self.rotary_emb.cos_sin, self.q_norm.weight, self.k_norm.weight,
                              self.q_norm.eps)
        return RopeInputs(positions, self.rotary_emb.cos_sin)


class DecoderMLP(nn.Module):
    def __init__(self, spec: DecoderSpec):
        super().__init__()
        self.gate_up_proj = gate_up_linear(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size, spec.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor):
        """The MLP's output; with tensor parallelism, before its sum over the group (a
        ``distributed.PartialSum``, which the norm after the layer sums)."""
        h = self.gate_up_proj(x)
        if self.down_proj.is_fp8 and quant.producer_quantizes(h):  # W8A8: the SwiGLU quantizes its product
            return self.down_proj(quant.QuantizedRows(*silu_mul_quantize(h.reshape(-1, h.shape[-1])), h.dtype),
                                  reduce=False)
        return self.down_proj(self.act(h), reduce=False)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_index: int, max_position: int):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = DecoderAttention(spec, layer_index, max_position)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if layer_index in spec.moe_layers:
            self.mlp = SparseMoE(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts,
                                 spec.num_experts_per_tok, spec.norm_topk_prob)
        else:
            self.mlp = DecoderMLP(spec)
        # Each norm's output feeds one projection (a float8 one that runs W8A8 takes it quantized).
        self.input_layernorm.feeds(self.self_attn.qkv_proj)
        if isinstance(self.mlp, DecoderMLP):
            self.post_attention_layernorm.feeds(self.mlp.gate_up_proj)

    # The layer in two halves around its attention, which alone reads the step's metadata and the
    # cache: CUDA graphs of prefill steps capture the halves (runner/piecewise_graph.py).
    def before_attention(self, positions, hidden, residual, rotate: bool = True):
        """Norm and projections: (q, k, v, residual); ``residual`` None at the first layer; ``rotate``
        as for ``DecoderAttention.project``."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return *self.self_attn.project(positions, hidden, rotate), residual

    def after_attention(self, attn_out, residual):
        """Output projection, norm and MLP of the attention's output [tokens, heads, head_dim]:
        (hidden, residual)."""
        # with tensor parallelism the output projections' sums happen in the norms after them
        hidden = self.self_attn.o_proj(attn_out.flatten(1), reduce=False)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def forward(self, positions, hidden, residual):
        # the attention layer norms and rotates q and k as it stores them (one launch on a GPU)
        q, k, v, residual = self.before_attention(positions, hidden, residual, rotate=False)
        return self.after_attention(self.self_attn.attn(q, k, v, rope=self.self_attn.rope_inputs(positions)),
                                    residual)


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, max_position: int):
        super().__init__()
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, max_position) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter name fragment, shard)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, spec: DecoderSpec, max_position: int):
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec, max_position)
        self.lm_head = LMHead(spec.vocab_size, spec.hidden_size)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def local_spec(self) -> DecoderSpec:
        """The spec with this rank's head counts: what its KV, query and score caches hold."""
        num_heads, num_kv_heads = local_heads(self.spec.num_heads, self.spec.num_kv_heads)
        return replace(self.spec, num_heads=num_heads, num_kv_heads=num_kv_heads)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
