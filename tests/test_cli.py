"""The ``zipage`` command line: its help, and the options every model-loading command shares."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from zipage.cli import build_parser, engine_kwargs


def _subcommands(parser: argparse.ArgumentParser, path=()):
    """(command path, its parser, {name: one-line help}) for ``parser`` and every parser below it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            yield path, parser, helps
            for name, child in action.choices.items():
                yield from _subcommands(child, path + (name,))


def test_help_lists_every_command_with_a_plain_description(capsys):
    parser = build_parser()
    found = list(_subcommands(parser))
    top = dict((p, h) for p, _, h in found)[()]
    assert set(top) == {"generate", "demo", "bench", "serve", "run-batch", "eval", "train-synthetic"}
    for path, sub, helps in found:
        text = " ".join(sub.format_help().split())  # argparse wraps lines
        assert "`" not in text, f"zipage {' '.join(path)} --help shows backticks"
        for name, line in helps.items():
            assert line and "`" not in line, f"zipage {' '.join(path + (name,))} has no plain one-line help"
            assert re.search(rf"\b{re.escape(name)} {re.escape(' '.join(line.split()))}", text), \
                f"zipage {' '.join(path)} --help does not list {name!r} with its help"
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Zipage: LLM inference with compressed PagedAttention" in out and "train-synthetic" in out


MODEL_COMMANDS = {
    "generate": ["generate", "--model", "m", "--prompt", "p"],
    "serve": ["serve", "m"],
    "run-batch": ["run-batch", "m", "-i", "in.jsonl", "-o", "out.jsonl"],
    "eval math": ["eval", "math", "--model", "m", "--data", "d.jsonl"],
    "bench throughput": ["bench", "throughput"],
    "bench replay": ["bench", "replay"],
    "bench serve": ["bench", "serve"],
}


@pytest.mark.parametrize("command", sorted(MODEL_COMMANDS))
def test_model_loading_commands_take_trust_remote_code(command):
    parser = build_parser()
    assert parser.parse_args(MODEL_COMMANDS[command]).trust_remote_code is False
    assert parser.parse_args(MODEL_COMMANDS[command] + ["--trust-remote-code"]).trust_remote_code is True


def test_engine_kwargs_pass_trust_remote_code_through():
    parser = build_parser()
    args = parser.parse_args(MODEL_COMMANDS["generate"] + ["--trust-remote-code"])
    assert engine_kwargs(args)["trust_remote_code"] is True
    del args.trust_remote_code  # a command built on the engine options without this flag
    assert engine_kwargs(args)["trust_remote_code"] is False


def test_bench_engine_kwargs_pass_trust_remote_code_through(checkpoint_dir):
    from zipage.bench.throughput import _settings, engine_kwargs as bench_engine_kwargs
    from zipage.bench.workloads import Request

    for flag in ([], ["--trust-remote-code"]):
        args = build_parser().parse_args(["bench", "throughput", "--scale", "small", *flag])
        kwargs, _ = bench_engine_kwargs("full", args, _settings(args), checkpoint_dir("qwen3"),
                                        [Request([1, 2, 3], 8)], 1024, torch.float32)
        assert kwargs["trust_remote_code"] is bool(flag)
