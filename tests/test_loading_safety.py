"""Loading a model directory runs none of its Python unless the caller consents, never waits
for an answer on stdin, and names the file of weights it cannot read."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import make_llm
from zipage.utils.loader import load_config, load_tokenizer

# Imported only if something runs the directory's code: then it leaves a marker file.
HOSTILE_MODULE = '''import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import PretrainedConfig, PreTrainedTokenizerFast


class HostileConfig(PretrainedConfig):
    model_type = "zipage_hostile"


class HostileTokenizer(PreTrainedTokenizerFast):
    pass
'''


def _add_hostile_module(model_dir) -> str:
    marker = os.path.join(model_dir, "RAN")
    with open(os.path.join(model_dir, "hostile.py"), "w") as f:
        f.write(HOSTILE_MODULE.format(marker=marker))
    return marker


@pytest.fixture
def hostile_config_dir(tmp_path):
    """A config of a model type transformers does not know, whose class is the directory's own code."""
    model_dir = tmp_path / "hostile-config"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "zipage_hostile", "architectures": ["Qwen3ForCausalLM"],
        "auto_map": {"AutoConfig": "hostile.HostileConfig"}}))
    return str(model_dir), _add_hostile_module(str(model_dir))


@pytest.fixture
def hostile_tokenizer_dir(tmp_path, checkpoint_dir):
    """A working tiny checkpoint whose tokenizer config points at the directory's own class."""
    model_dir = str(tmp_path / "hostile-tokenizer")
    shutil.copytree(checkpoint_dir("qwen3"), model_dir)
    path = os.path.join(model_dir, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config["auto_map"] = {"AutoTokenizer": ["hostile.HostileTokenizer", "hostile.HostileTokenizer"]}
    config["tokenizer_class"] = "HostileTokenizer"
    with open(path, "w") as f:
        json.dump(config, f)
    return model_dir, _add_hostile_module(model_dir)


def _python(code: str, tmp_path, stdin: str | None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (transformers' module cache under ``tmp_path``); ``stdin``:
    what it may read, or None for a closed stdin."""
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "hf-modules"), TRANSFORMERS_VERBOSITY="error")
    return subprocess.run([sys.executable, "-c", code], input=stdin, stdin=None if stdin is not None else
                          subprocess.DEVNULL, capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def answers_yes(monkeypatch, tmp_path):
    """A stdin that would consent to running the code if anything asked (and, should that happen,
    transformers' copy of the code kept under ``tmp_path``)."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))


def test_config_needing_its_own_code_is_refused_without_asking(hostile_config_dir, answers_yes):
    model_dir, marker = hostile_config_dir
    start = time.perf_counter()
    with pytest.raises(ValueError, match="needs the Python code shipped in that directory.*trust_remote_code=True"):
        load_config(model_dir)
    with pytest.raises(ValueError, match="--trust-remote-code"):
        make_llm(model_dir)
    assert time.perf_counter() - start < 30  # nothing waited for an answer
    assert not os.path.exists(marker)
    assert sys.stdin.read() == "y\n" * 10  # nobody read the consent


@pytest.mark.parametrize("stdin", ["y\n" * 10, None], ids=["answers-yes", "closed"])
def test_cli_refuses_such_a_model_at_once(hostile_config_dir, tmp_path, stdin):
    """End to end, as a user runs it: exit status 2, the reason on stderr, and no code ran."""
    model_dir, marker = hostile_config_dir
    start = time.perf_counter()
    done = _python(f"import sys; from zipage.cli import main; sys.exit(main(['generate', '--model', {model_dir!r}, "
                   f"'--prompt', 'hi', '--device', 'cpu']))", tmp_path, stdin)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "needs the Python code shipped in that directory" in done.stderr and "--trust-remote-code" in done.stderr
    assert "[y/N]" not in done.stdout + done.stderr
    assert time.perf_counter() - start < 120
    assert not os.path.exists(marker)


def test_tokenizer_code_runs_only_with_consent(hostile_tokenizer_dir, tmp_path, answers_yes):
    model_dir, marker = hostile_tokenizer_dir
    assert type(load_tokenizer(model_dir)).__name__ != "HostileTokenizer"
    llm = make_llm(model_dir, block_size=16, max_model_len=64)
    assert type(llm.tokenizer).__name__ != "HostileTokenizer"
    assert not os.path.exists(marker)
    # The control: with consent the same directory's code does run (so the checks above could fail).
    done = _python(f"from zipage import LLM; llm = LLM({model_dir!r}, device='cpu', block_size=16, max_model_len=64, "
                   f"trust_remote_code=True); print(type(llm.tokenizer).__name__)", tmp_path, stdin=None)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "HostileTokenizer" and os.path.exists(marker)


def test_trust_remote_code_must_be_a_bool(checkpoint_dir):
    from zipage.config import EngineConfig

    with pytest.raises(ValueError, match="trust_remote_code must be True or False, got 'yes'"):
        EngineConfig(model=checkpoint_dir("qwen3"), device="cpu", trust_remote_code="yes")
    with pytest.raises(ValueError, match="trust_remote_code must be True or False, got 1"):
        load_config(checkpoint_dir("qwen3"), trust_remote_code=1)


@pytest.mark.parametrize("damage", ["truncated", "not-safetensors", "empty"])
def test_unreadable_weight_file_is_named(checkpoint_dir, tmp_path, damage):
    model_dir = tmp_path / "damaged"
    shutil.copytree(checkpoint_dir("qwen3"), model_dir)
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[:len(data) // 2], "not-safetensors": b"\x10" + b"\x00" * 7 + b"{oops}" * 9,
                         "empty": b""}[damage])
    with pytest.raises(ValueError, match=f"cannot read weight file '{weights}': .*header") as error:
        make_llm(str(model_dir))
    assert type(error.value.__cause__).__name__ == "SafetensorError"
