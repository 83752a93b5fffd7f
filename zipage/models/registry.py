"""Supported architectures: HuggingFace config -> ``DecoderSpec``."""

from __future__ import annotations

from zipage.layers.linear import Linear
from zipage.layers.moe import SparseMoE
from zipage.layers.quant import checkpoint_fp8, fp8_linears, matches_module
from zipage.models.decoder import DecoderForCausalLM, DecoderSpec

# architecture -> (qkv bias, o_proj bias, q/k norm); None = read `attention_bias` from the config
_FAMILIES = {
    "LlamaForCausalLM": (None, None, False),
    "Qwen2ForCausalLM": (True, False, False),
    "Qwen3ForCausalLM": (None, None, True),
    "Qwen3MoeForCausalLM": (None, None, True),
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)


def rope_settings(config) -> tuple[float, dict | None]:
    """(theta, scaling) from either the old ``rope_scaling`` or the new ``rope_parameters`` fields."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or params or None
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None and scaling:
        theta = scaling.get("rope_theta")
    return float(theta if theta is not None else 10000.0), scaling


def spec_from_config(config) -> DecoderSpec:
    architectures = getattr(config, "architectures", None) or []
    arch = next((a for a in architectures if a in _FAMILIES), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {architectures or '(none in config.json)'}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    qkv_bias, o_bias, qk_norm = _FAMILIES[arch]
    attention_bias = bool(getattr(config, "attention_bias", False))
    theta, scaling = rope_settings(config)
    num_heads = config.num_attention_heads
    return DecoderSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias if o_bias is None else o_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=qk_norm,
        **moe_settings(config),
    )


def moe_settings(config) -> dict:
    """The mixture-of-experts fields of a ``DecoderSpec`` (none for a dense model). As transformers'
    Qwen3-MoE: layer i is sparse unless listed in ``mlp_only_layers``, when (i + 1) is a multiple of
    ``decoder_sparse_step``."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    if not experts:
        return {}
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    layers = tuple(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return dict(moe_layers=layers, num_experts=int(experts), num_experts_per_tok=int(config.num_experts_per_tok),
                moe_intermediate_size=int(config.moe_intermediate_size),
                norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)))


# Linear layers that keep the model's dtype under fp8: the MoE router (tiny, and which experts
# a token goes to is sensitive to its logits)
ALWAYS_UNQUANTIZED = ("mlp.gate",)


def build_model(config, max_position: int, quantization: str | None = None) -> DecoderForCausalLM:
    """The model with empty weights. ``quantization="fp8"``, or a block-wise FP8 checkpoint
    (``quantization_config``): its linear layers hold float8 weights (``layers/quant.py``),
    but for the checkpoint's ``modules_to_not_convert``."""
    spec = spec_from_config(config)
    block, keep = checkpoint_fp8(config)
    fp8 = quantization == "fp8" or block is not None
    with fp8_linears(fp8):
        model = DecoderForCausalLM(spec, max_position)
    keep = keep + list(ALWAYS_UNQUANTIZED)
    if fp8:
        dtype = model.model.embed_tokens.weight.dtype
        for name, module in model.named_modules():
            if isinstance(module, Linear) and module.is_fp8 and matches_module(name, keep + _fused(name, keep)):
                module.unquantize(dtype)
            elif isinstance(module, SparseMoE) and module.is_fp8 and (
                    matches_module(name, keep) or matches_module(f"{name}.experts", keep)):
                module.unquantize(dtype)
    model.quantization = "fp8" if fp8 else None
    model.fp8_block_size = block  # the checkpoint's weight_block_size (None: not an FP8 checkpoint)
    return model


def _fused(name: str, entries: list[str]) -> list[str]:
    """Entries naming a part of a fused module (``...q_proj`` of ``...qkv_proj``), renamed to it."""
    out = []
    for fragment, (fused, _) in DecoderForCausalLM.packed_modules.items():
        out += [e.replace(fragment, fused) for e in entries if fragment in e and fused in name]
    return out
