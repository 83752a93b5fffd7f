"""Helpers shared by the benchmarks: model directories for named shapes, result files."""

from __future__ import annotations

import datetime
import json
import os
import platform
import tempfile

import torch

COPY_BANDWIDTH_BYTES_PER_S = 4.27e12  # measured device-to-device copy on the H200 (2026-11-29)


def model_dir_for(model: str | None, shape: str, arch: str) -> tuple[str, str]:
    """(directory, load_format): a real checkpoint, or a named shape's config with dummy weights."""
    if model:
        return model, "auto"
    from zipage.utils.checkpoint import make_checkpoint
    path = os.path.join(tempfile.gettempdir(), f"zipage-shape-{arch}-{shape}")
    make_checkpoint(path, arch=arch, shape=shape, dtype=torch.bfloat16, with_weights=False)
    return path, "dummy"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()})"


def write_json(path: str | None, payload: dict) -> None:
    payload = dict(payload, device=device_name(), date=datetime.date.today().isoformat(),
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
