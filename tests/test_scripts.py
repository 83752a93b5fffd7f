"""The shell scripts that run measurements on a GPU parse, and refuse a part they do not have before
they need a GPU: a mistake in one shows here, not in a GPU job's time."""

import pathlib
import subprocess

import pytest

SCRIPTS = sorted(pathlib.Path(__file__).resolve().parent.parent.glob("scripts/*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script, message", [
    ("gpu_fp8.sh",
     "PART must be tests, attention, decode, zipage8k, full8k, all, probs, probs-quality, probs8k, gemm-tma, "
     "quantizers, pdl, pdl8k, registers or ratio8k"),
    ("gpu_tp.sh", "PART must be test, decode, profile, allreduce, zipage8k, full8k, 32b-zipage or 32b-full"),
    ("gpu_quality_tasks.sh", "PART must be train, compare, all or fp8"),
])
def test_script_refuses_an_unknown_part(script, message):
    path = SCRIPTS[0].parent / script
    done = subprocess.run(["bash", str(path), "no-such-part"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "no-such-part" in done.stderr, done.stderr


def test_tp_script_refuses_a_bad_gpu_count():
    done = subprocess.run(["bash", str(SCRIPTS[0].parent / "gpu_tp.sh"), "decode", "two"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "TP must be a whole number of GPUs >= 1, got 'two'" in done.stderr
