"""Supported architectures: HuggingFace config -> ``DecoderSpec``."""

from __future__ import annotations

from zipage.models.decoder import DecoderForCausalLM, DecoderSpec

# architecture -> (qkv bias, o_proj bias, q/k norm); None = read `attention_bias` from the config
_FAMILIES = {
    "LlamaForCausalLM": (None, None, False),
    "Qwen2ForCausalLM": (True, False, False),
    "Qwen3ForCausalLM": (None, None, True),
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
    )


def build_model(config, max_position: int) -> DecoderForCausalLM:
    return DecoderForCausalLM(spec_from_config(config), max_position)
