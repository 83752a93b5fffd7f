"""Load a HuggingFace checkpoint directory: config, safetensors weights, tokenizer.

Nothing in the directory runs as code unless the caller passes ``trust_remote_code=True``:
a config or tokenizer that needs the directory's own Python is refused with a
``ValueError`` (transformers would otherwise ask on stdin).
"""

from __future__ import annotations

import glob
import logging
import os

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from zipage.layers.quant import dequantize_blocks, is_fp8

logger = logging.getLogger(__name__)


def check_model_dir(model_dir: str) -> None:
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist (give a local checkpoint directory)")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"model directory {model_dir!r} has no config.json")


def load_config(model_dir: str, trust_remote_code: bool = False):
    from transformers import AutoConfig
    check_model_dir(model_dir)
    return _load(AutoConfig, "config", model_dir, trust_remote_code)


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    """The checkpoint's tokenizer, or ``None`` when it ships none (token-id prompts only)."""
    from transformers import AutoTokenizer
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(model_dir, n)) for n in names):
        logger.warning("no tokenizer files in %s: prompts must be token ids", model_dir)
        return None
    return _load(AutoTokenizer, "tokenizer", model_dir, trust_remote_code)


def _load(auto_class, what: str, model_dir: str, trust_remote_code: bool):
    """``auto_class.from_pretrained`` with the remote-code decision made here, never asked on stdin."""
    if not isinstance(trust_remote_code, bool):
        raise ValueError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
    try:
        return auto_class.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except ValueError as error:
        if trust_remote_code or "trust_remote_code" not in str(error):
            raise
        raise ValueError(f"the {what} of {model_dir!r} needs the Python code shipped in that directory "
                         f"(auto_map in its config files); it was not run. Pass trust_remote_code=True "
                         f"(--trust-remote-code) only if you trust that code") from None


def load_weights(model: nn.Module, model_dir: str) -> None:
    """Copy every safetensors tensor into its (possibly fused) parameter; all must be covered.

    A float8 tensor of a block-wise FP8 checkpoint comes with ``<name>_scale_inv`` (any file):
    it is dequantized to float32 here, one tensor at a time, and the layer's loader requantizes
    it to its own format (``layers/quant.py``)."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {model_dir!r}")
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    expected = {(name, shard) for name, p in params.items()
                for shard in (_shards_of(model, name) or [None])}
    loaded = set()
    try:
        where = {}  # tensor name -> its file (block scales may sit in another file than their weight)
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                where.update(dict.fromkeys(f.keys(), path))
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                loaded |= _copy_tensors(model, f, path, params, packed, where)
    except SafetensorError as error:  # truncated, or not safetensors at all
        raise ValueError(f"cannot read weight file {path!r}: {error}") from error
    missing = sorted(f"{n}" + (f" ({s})" if s else "") for n, s in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks weights for: {', '.join(missing[:10])}"
                         + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))


def _copy_tensors(model: nn.Module, f, path: str, params: dict, packed: dict, where: dict) -> set:
    """Copy one open safetensors file's tensors into their parameters; (parameter, shard) pairs filled."""
    loaded = set()
    for name in f.keys():
        if name.endswith(".weight_scale_inv"):
            if name[:-len("_scale_inv")] not in where:
                raise ValueError(f"{name} in {path!r} has no weight {name[:-len('_scale_inv')]}")
            continue  # read with its weight
        target, shard = _target_of(name, packed)
        param = params.get(target)
        if param is None:
            if not name.endswith("rotary_emb.inv_freq") and not (
                    name == "lm_head.weight" and model.spec.tie_word_embeddings):
                logger.warning("ignoring checkpoint tensor %s (no such parameter)", name)
            continue
        loader = getattr(param, "weight_loader", None)
        tensor = f.get_tensor(name)
        if is_fp8(tensor):
            tensor = _dequantize_checkpoint_tensor(model, name, tensor, path, where)
        if loader is None:
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{name} in {path!r}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            param.data.copy_(tensor)
        else:
            loader(param, tensor, shard)
        loaded.add((target, shard))
    return loaded


def _dequantize_checkpoint_tensor(model: nn.Module, name: str, tensor: torch.Tensor, path: str,
                                  where: dict) -> torch.Tensor:
    """float32 values of a block-wise FP8 checkpoint tensor (its ``weight_scale_inv`` per block)."""
    block = getattr(model, "fp8_block_size", None)
    scale_name = name + "_scale_inv"
    if block is None or scale_name not in where:
        raise ValueError(f"{name} in {path!r} is float8 but "
                         + ("config.json has no fp8 quantization_config with a weight_block_size" if block is None
                            else f"the checkpoint has no {scale_name}"))
    with safe_open(where[scale_name], framework="pt", device="cpu") as f:
        scale_inv = f.get_tensor(scale_name)
    return dequantize_blocks(tensor, scale_inv, block)


def _target_of(name: str, packed: dict) -> tuple[str, str | None]:
    from zipage.layers.moe import SparseMoE
    expert = SparseMoE.checkpoint_target(name)  # one expert's projection: a slice of the stacked weights
    if expert is not None:
        return expert
    for fragment, (fused, shard) in packed.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard
    return name, None


def _shards_of(model: nn.Module, param_name: str) -> list | None:
    shards = getattr(model.get_parameter(param_name), "shards", None)  # a parameter's own (stacked experts)
    if shards is not None:
        return list(shards)
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    return list(getattr(module, "shard_slices", {}) or []) or None


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks in real shapes: N(0, 0.02), norms at 1. A float8 weight is
    drawn in the model's dtype and quantized, a layer at a time."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    dtype = next(p.dtype for p in model.parameters() if not is_fp8(p))
    for name, param in model.named_parameters():
        if "norm" in name.rsplit(".", 2)[-2]:
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        elif is_fp8(param):
            module = model.get_submodule(name.rsplit(".", 1)[0])
            weight = torch.empty(param.shape, dtype=dtype, device=param.device).normal_(0.0, 0.02, generator=generator)
            module._store_weight(param.data, 0, weight)
        else:
            param.normal_(0.0, 0.02, generator=generator)
