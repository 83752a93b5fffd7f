"""Helpers shared by the benchmarks: model directories for named shapes, result files."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import tempfile
import time

import torch

COPY_BANDWIDTH_BYTES_PER_S = 4.27e12  # measured device-to-device copy on the H200 (2026-11-29)


def model_dir_for(model: str | None, shape: str, arch: str, full_vocab: bool = False,
                  one_rank_of: int = 1) -> tuple[str, str]:
    """(directory, load_format): a real checkpoint, or a named shape's config with dummy weights
    (``full_vocab``: with a synthetic tokenizer of the shape's vocabulary size; ``one_rank_of`` N > 1:
    the layers one rank of tensor parallelism over N GPUs holds, ``one_rank_shape``)."""
    if model:
        return model, "auto"
    from zipage.utils.checkpoint import make_checkpoint
    overrides = one_rank_shape(shape, arch, one_rank_of) if one_rank_of > 1 else {}
    path = os.path.join(tempfile.gettempdir(), f"zipage-shape-{arch}-{shape}{'-full-vocab' if full_vocab else ''}"
                                               f"{f'-rank-of-{one_rank_of}' if one_rank_of > 1 else ''}")
    make_checkpoint(path, arch=arch, shape=shape, dtype=torch.bfloat16, with_weights=False, full_vocab=full_vocab,
                    **overrides)
    return path, "dummy"


def one_rank_shape(shape: str, arch: str, tp: int) -> dict:
    """Config overrides that make a dense ``shape`` the model one rank holds at tensor-parallel size
    ``tp``: its query and KV heads, MLP width and vocabulary (rounded up, as the vocabulary split
    pads) divided by ``tp``; the head size, hidden size, norms and layers stay. Run on one GPU, it is
    a rank's compute without the collectives."""
    from zipage.utils.checkpoint import SHAPES, build_tokenizer, hf_config
    config = hf_config(arch, shape)
    if getattr(config, "num_experts", None):
        raise ValueError(f"shape {shape!r} is a mixture of experts: one rank's share is for dense shapes only")
    fields = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
              "intermediate_size": config.intermediate_size}
    for name, value in fields.items():
        if value % tp:
            raise ValueError(f"one rank of {tp}: {name}={value} of shape {shape!r} does not divide by {tp}")
    overrides = {name: value // tp for name, value in fields.items()}
    # the head size stays (a config without head_dim would derive it from the hidden size and the
    # fewer heads); the engine reads head_dim from any architecture's config
    overrides["head_dim"] = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    vocab_size = SHAPES[shape].get("vocab_size") or len(build_tokenizer())  # (tiny: its tokenizer's)
    overrides["vocab_size"] = -(-vocab_size // tp)
    return overrides


def run_device(device: str | torch.device | None) -> torch.device:
    """The device a run with ``--device`` (None: the engine's default) uses."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def device_name(device: str | torch.device | None = None) -> str:
    device = run_device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def copy_bandwidth(device: torch.device) -> tuple[float, str]:
    """The copy ceiling of a roofline on ``device`` (bytes read + written per second), and where the
    figure comes from: the measured constant on an H200, else a copy timed now on the device."""
    if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device):
        return COPY_BANDWIDTH_BYTES_PER_S, "H200 device-to-device copy, measured 2026-11-29"
    return measure_copy_bandwidth(device), f"{device_name(device)} copy, measured in this run"


def measure_copy_bandwidth(device: torch.device, repeats: int = 5) -> float:
    """Bytes read + written per second of the fastest of ``repeats`` copies of a buffer larger than
    the caches (the first copy, which pays for page faults, is not counted)."""
    nbytes = 1 << (30 if device.type == "cuda" else 27)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for i in range(repeats + 1):
        _synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        _synchronize(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_json(path: str | None, payload: dict, device: str | torch.device | None = None) -> None:
    """Write ``payload`` with the run's device (``device``: as ``--device``), date and torch version."""
    payload = dict(payload, device=device_name(device), date=datetime.date.today().isoformat(),
                   torch=torch.__version__)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def check_one_engine_a_process(args, modes: list[str]) -> None:
    """``--all-reduce one-shot`` with tensor parallelism runs one engine a process
    (``distributed.check_fresh_symmetric_group``): refuse several modes before any run."""
    if getattr(args, "all_reduce", "nccl") == "one-shot" and args.tensor_parallel_size > 1 and len(modes) > 1:
        raise ValueError(f"--all-reduce one-shot with --tensor-parallel-size {args.tensor_parallel_size} runs one "
                         f"engine a process: give one mode, got --modes {','.join(modes)}")
