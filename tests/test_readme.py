"""The README runs as written: every Python snippet and ``zipage`` command in it is run on
the CPU against the shipped checkpoint (``checkpoints/ledger-14m``), each in its own
process with a time bound, and its lists of options name exactly what the code accepts.

A fenced code block preceded by ``<!-- readme-test: skip (reason) -->`` is not run; the
README marks that way only what installs packages, needs a GPU or a large checkpoint, or
starts a server that runs until stopped (docs/testing.md).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\w*)\s*$")
RUN_TIMEOUT_S = 150  # one snippet or command; each takes a few seconds to half a minute on 2 cores
MAX_SKIPPED = 6


@dataclasses.dataclass
class Block:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    skip: str | None  # the reason, when marked

    @property
    def name(self) -> str:
        return f"{self.lang}-line-{self.line}"


def readme_blocks(text: str) -> list[Block]:
    """Fenced code blocks with their language and the skip marker of the line before them."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence_line = len(opening.group("indent")), i + 1
        previous = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = SKIP.search(previous)
        body, i = [], i + 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        blocks.append(Block(opening.group("lang"), "\n".join(body) + "\n", fence_line,
                            marker.group("reason") if marker else None))
        i += 1
    return blocks


def shell_commands(code: str) -> list[str]:
    """The commands of a bash block: comments dropped, backslash continuations joined."""
    commands, current = [], ""
    for raw in code.splitlines():
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        commands.append((current + line).strip())
        current = ""
    return commands


BLOCKS = readme_blocks(README.read_text())
RUN = [b for b in BLOCKS if b.skip is None and b.lang in ("python", "bash")]


def _env() -> dict:
    env = dict(os.environ)
    # one thread: the shipped model's matrices are small, and two threads stall badly when
    # another process holds a core
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _run(argv: list[str], what: str) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"README {what} ran past {RUN_TIMEOUT_S} s")
    assert done.returncode == 0, (f"README {what} failed ({done.returncode}):\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def test_readme_has_runnable_snippets_and_few_skips():
    langs = [b.lang for b in RUN]
    assert langs.count("python") >= 3 and langs.count("bash") >= 1, langs
    skipped = [b for b in BLOCKS if b.skip is not None]
    assert len(skipped) <= MAX_SKIPPED, [f"{b.name}: {b.skip}" for b in skipped]
    for b in BLOCKS:  # a marker must sit right before a block (else it silently skips nothing)
        assert b.skip is None or b.skip.strip(), b.name
    text = README.read_text()
    assert text.count("readme-test: skip") == len(skipped), "a skip marker is not right before a code block"


@pytest.mark.parametrize("block", [b for b in RUN if b.lang == "python"], ids=lambda b: b.name)
def test_python_snippet_runs(block):
    done = _run([sys.executable, "-c", block.code], f"Python snippet at line {block.line}")
    assert done.stdout.strip(), f"the snippet at line {block.line} printed nothing"


@pytest.mark.parametrize("command", [(b, c) for b in RUN if b.lang == "bash" for c in shell_commands(b.code)],
                         ids=lambda bc: f"line-{bc[0].line}-{bc[1].split()[1] if len(bc[1].split()) > 1 else ''}")
def test_command_runs(command):
    block, line = command
    argv = shlex.split(line)
    assert argv[0] == "zipage", (f"README line {block.line}: only `zipage` commands run here; mark other blocks "
                                 f"with a skip marker and a reason: {line!r}")
    done = _run([sys.executable, "-m", "zipage.cli", *argv[1:]], f"command {line!r}")
    assert done.stdout.strip()


def _signature(text: str, call: str, first: str) -> dict:
    """``name -> default`` of the signature ``call(first...)`` written in backticks in the README."""
    match = re.search(r"`" + re.escape(call) + r"\((" + first + r"\b.*?)\)`", text, re.S)
    assert match, f"the README shows no `{call}({first}, ...)` signature"
    tree = ast.parse(f"f({' '.join(match.group(1).split())})", mode="eval")
    params = {a.id: dataclasses.MISSING for a in tree.body.args}
    params.update({k.arg: ast.literal_eval(k.value) for k in tree.body.keywords})
    return params


def _defaults(*classes) -> dict:
    out = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = dataclasses.MISSING  # a sub-config, not an LLM option
            else:
                out[f.name] = dataclasses.MISSING
    return out


def test_llm_signature_and_table_name_every_option():
    from zipage.config import CacheConfig, EngineConfig, SchedulerConfig

    text = README.read_text()
    written = _signature(text, "LLM", "model")
    accepted = {k: v for k, v in _defaults(EngineConfig, CacheConfig, SchedulerConfig).items()
                if k not in ("cache", "scheduler")}
    assert set(written) == set(accepted), (f"README's LLM(...) lacks {sorted(set(accepted) - set(written))}, "
                                           f"names unknown {sorted(set(written) - set(accepted))}")
    for name, default in written.items():
        if default is not dataclasses.MISSING:
            assert default == accepted[name], f"README says LLM({name}={default!r}); the default is {accepted[name]!r}"
    from zipage import LLM
    for name, param in inspect.signature(LLM.__init__).parameters.items():
        if param.kind is param.KEYWORD_ONLY:  # LLM's own defaults must agree with the README too
            assert written[name] == param.default, (f"README says LLM({name}={written[name]!r}); "
                                                    f"LLM has {param.default!r}")
    table = text[text.index("`LLM(model, "):]
    table = table[table.index("| option | meaning |"):]
    table = table[:table.index("\n\n")]
    rows = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert rows == set(written) - {"model"}, (f"the options table lacks {sorted(set(written) - {'model'} - rows)}, "
                                              f"has extra {sorted(rows - set(written))}")


def test_sampling_params_signature_names_every_field():
    from zipage import SamplingParams

    written = _signature(README.read_text(), "SamplingParams", "temperature")
    init = inspect.signature(SamplingParams.__init__).parameters
    fields = {f.name: init[f.name].default for f in dataclasses.fields(SamplingParams)}
    assert set(written) == set(fields), (f"README's SamplingParams(...) lacks {sorted(set(fields) - set(written))}, "
                                         f"names unknown {sorted(set(written) - set(fields))}")
    for name, default in written.items():
        assert default == fields[name], (f"README says SamplingParams({name}={default!r}); "
                                         f"the default is {fields[name]!r}")


def test_compression_config_fields_and_defaults():
    from zipage import CompressionConfig

    text = README.read_text()
    paragraph = text[text.index("`CompressionConfig` fields (published defaults):"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    for f in dataclasses.fields(CompressionConfig):
        written = re.search(r"`" + f.name + r"=([^`]+)`", paragraph)
        if written is None:
            assert f"`{f.name}`" in paragraph, f"README's CompressionConfig fields do not mention {f.name}"
            continue
        assert ast.literal_eval(written.group(1)) == f.default, (
            f"README says {f.name}={written.group(1)}; the default is {f.default!r}")


def test_the_two_commands_are_the_ci_commands():
    """The README's two commands are exactly what CI runs from nothing (.ci/run) and the demo."""
    two = next(b for b in BLOCKS if b.lang == "bash" and "scripts/setup.sh" in b.code)
    commands = shell_commands(two.code)
    assert commands == ["bash scripts/setup.sh && .venv/bin/zipage demo",
                        "bash scripts/setup.sh && .venv/bin/python -m pytest -q"]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
