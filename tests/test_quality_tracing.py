"""The register-tracing task: every solution line re-derived by an independent interpreter,
its small working set, the split and the tokenizer; then the tiny training run and the
settings comparison of ``zipage eval synthetic`` on its checkpoint."""

from __future__ import annotations

import json
import os
import random
import re

import pytest
import torch

from zipage.quality import tasks
from zipage.quality.tokenizer import CharCodec, save_tokenizer

SET = re.compile(r"^(\d+) ([A-L]) ([a-f]):([a-f])([+-])([a-f]) "
                 r"([a-f])=(\d) ([a-f])=(\d) (\d)([+-])(\d)=(\d) ([a-f])=(\d)$")
JUMP = re.compile(r"^(\d+) ([A-L]) if ([a-f]) high go ([A-L]) ([a-f])=(\d) (high|low) go ([A-L])$")
VALUE = re.compile(r"([a-f])=(\d)")
SPEC_SEEDS = [("tracing", 0), ("tracing", 1), ("tracing", 2), ("tracing", tasks.HELD_OUT_SEED + 3),
              ("tracing-short", 4), ("tracing-short", 5), ("tracing-tiny", 6)]


def parse_statement(statement: str) -> tuple[dict, list[tuple], int]:
    """Registers (name -> value), the program (label, instruction text) and the step count."""
    lines = statement.split("\n")
    registers = {name: int(v) for name, v in VALUE.findall(lines[0])}
    program = [tuple(line.split(" ", 1)) for line in lines[1:-1]]
    steps = int(re.fullmatch(r"steps (\d+)", lines[-1]).group(1))
    return registers, program, steps


def execute(label: str, text: str, registers: dict, program: list[tuple]) -> tuple[str, str]:
    """One instruction of the program on ``registers`` (updated in place): the step line's
    text after its number, and the label of the next instruction."""
    labels = [lab for lab, _ in program]
    after = labels[(labels.index(label) + 1) % len(labels)]
    jump = re.fullmatch(r"if ([a-f]) high go ([A-L])", text)
    if jump:
        register, target = jump.groups()
        high = registers[register] >= 5
        following = target if high else after
        return f"{label} {text} {register}={registers[register]} {'high' if high else 'low'} go {following}", following
    dst, x, op, y = re.fullmatch(r"([a-f]):([a-f])([+-])([a-f])", text).groups()
    u, v = registers[x], registers[y]
    result = (u + v) % 10 if op == "+" else (u - v) % 10
    registers[dst] = result
    return f"{label} {text} {x}={u} {y}={v} {u}{op}{v}={result} {dst}={result}", after


def state_line(registers: dict) -> str:
    return "state " + " ".join(f"{name}={v}" for name, v in registers.items())


def reference_solution(statement: str, dump_every: int) -> str:
    """The whole solution, re-executed from the statement alone."""
    registers, program, steps = parse_statement(statement)
    lines, label = [state_line(registers)], program[0][0]
    texts = dict(program)
    for left in range(steps, 0, -1):
        text, label = execute(label, texts[label], registers, program)
        lines.append(f"{left} {text}")
        if left % dump_every == 0 or left == 1:
            lines.append(state_line(registers))
    return "\n".join(lines + ["answer " + "".join(str(v) for v in registers.values())])


def next_step_line(program: list[tuple], working_set: list[str]) -> str:
    """The next step line from a working set only: the latest state line and the step lines
    after it. Every ``x=d`` there states x's value at that point, so the last one wins; the
    label follows the previous step line (its ``go`` or the next instruction)."""
    registers = {}
    for line in working_set:
        registers.update((name, int(v)) for name, v in VALUE.findall(line))
    last = working_set[-1]
    if last.startswith("state "):  # right after a state line: the step line before it decides
        last = working_set[-2]
    number, label = last.split(" ")[:2]
    labels = [lab for lab, _ in program]
    following = last.split(" go ")[-1] if JUMP.match(last) else labels[(labels.index(label) + 1) % len(labels)]
    text, _ = execute(following, dict(program)[following], registers, program)
    return f"{int(number) - 1} {text}"


@pytest.mark.parametrize("spec,seed", SPEC_SEEDS)
def test_every_line_matches_an_independent_execution(spec, seed):
    problem = tasks.make_problem(seed, spec)
    every = tasks.get_spec(spec).dump_every
    assert problem.solution == reference_solution(problem.statement, every)
    lines = problem.solution.split("\n")
    assert all(SET.match(line) or JUMP.match(line) for line in lines if line[0].isdigit())
    assert tasks.extract_answer(problem.solution) == problem.answer == "".join(VALUE.sub(r"\2", lines[-2]).split()[1:])
    _, _, steps = parse_statement(problem.statement)
    assert problem.num_steps == steps


@pytest.mark.parametrize("spec,seed", SPEC_SEEDS)
def test_each_step_follows_from_the_program_and_the_lines_since_the_latest_state(spec, seed):
    """What a policy must keep: the program, the latest state line and the step lines after it
    (fewer than ``dump_every``). Nothing older, not the statement's starting values."""
    problem = tasks.make_problem(seed, spec)
    _, program, _ = parse_statement(problem.statement)
    program_text = "\n".join(f"{label} {text}" for label, text in program)
    lines = problem.solution.split("\n")
    widest = 0
    for i, line in enumerate(lines):
        if i < 2 or not line[0].isdigit():
            continue
        latest = max(k for k in range(i) if lines[k].startswith("state "))
        working_set = lines[latest:i] if latest < i - 1 else lines[latest - 1:i]
        assert next_step_line(program, working_set) == line
        widest = max(widest, len(program_text) + sum(len(x) + 1 for x in working_set))
    assert widest < 250


def test_state_lines_come_after_multiples_of_dump_every_and_the_last_line():
    for seed in range(20):
        problem = tasks.make_problem(seed, "tracing")
        lines = problem.solution.split("\n")
        for line, following in zip(lines, lines[1:]):
            if line[0].isdigit():
                number = int(line.split(" ")[0])
                assert following.startswith("state ") == (number % 5 == 0 or number == 1), (line, following)
        assert lines[-1] == f"answer {problem.answer}" and len(problem.answer) == 5


def test_problems_are_seeded_and_held_out_seeds_are_apart():
    assert tasks.make_problem(5, "tracing") == tasks.make_problem(5, "tracing")
    assert tasks.make_problem(5, "tracing") != tasks.make_problem(6, "tracing")
    assert tasks.make_problem(5, "tracing").statement != tasks.make_problem(5, "standard").statement
    held = tasks.held_out_problems(3, "tracing")
    assert [p.seed for p in held] == [tasks.HELD_OUT_SEED + i for i in range(3)]
    assert held[0] == tasks.make_problem(tasks.HELD_OUT_SEED, "tracing")
    rng = random.Random(0)
    assert all(tasks.training_seed(rng) < tasks.HELD_OUT_SEED for _ in range(1000))


def test_lengths_jumps_and_no_repeats():
    """About 740 to 1,900 tokens; every instruction runs; every jump goes both ways; no
    (instruction, registers) state comes back, so no run of step lines repeats."""
    codec = CharCodec()
    lengths = []
    for seed in range(200):
        problem = tasks.make_problem(seed, "tracing")
        ids, _ = codec.encode_chat(tasks.messages(problem), problem.solution)
        lengths.append(len(ids))
        registers, program, _ = parse_statement(problem.statement)
        seen, ways = set(), {}
        for line in problem.solution.split("\n"):
            step = SET.match(line) or JUMP.match(line)
            if not step:
                registers.update((name, int(v)) for name, v in VALUE.findall(line))
                continue
            state = (step.group(2), tuple(registers.values()))
            assert state not in seen
            seen.add(state)
            if JUMP.match(line):
                ways.setdefault(step.group(2), set()).add(step.group(7))
            else:
                registers[step.group(15)] = int(step.group(16))
        assert {label for label, _ in seen} == {label for label, _ in program}
        assert all(w == {"high", "low"} for w in ways.values()) and len(ways) == 2
    assert 700 <= min(lengths) and max(lengths) <= 2000
    assert 1250 <= sum(lengths) / len(lengths) <= 1450


def test_the_tokenizer_round_trips_every_problem(tmp_path):
    from transformers import AutoTokenizer

    codec = CharCodec()
    unk = codec.ids["<unk>"]
    for spec in ("tracing", "tracing-short", "tracing-tiny"):
        for seed in range(100):
            problem = tasks.make_problem(seed, spec)
            ids, _ = codec.encode_chat(tasks.messages(problem), problem.solution)
            assert unk not in ids.tolist() and problem.solution in codec.decode(ids)
    save_tokenizer(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    for problem in tasks.held_out_problems(3, "tracing"):
        ids = tok.encode(problem.statement + "\n" + problem.solution, add_special_tokens=False)
        assert tok.unk_token_id not in ids and tok.decode(ids) == problem.statement + "\n" + problem.solution


def test_spec_checks_its_values():
    from zipage.quality.tracing import TracingSpec

    with pytest.raises(ValueError, match="num_jumps must be in \\[0, 5\\]"):
        TracingSpec(num_instructions=7, num_jumps=6)
    with pytest.raises(ValueError, match="num_registers must be in \\[2, 6\\], got 7"):
        TracingSpec(num_registers=7)
    with pytest.raises(ValueError, match="min_steps"):
        TracingSpec(min_steps=9, max_steps=8)
    assert tasks.family("tracing-short") == "tracing" and tasks.tiny_variant("tracing") == "tracing-tiny"
    assert tasks.family("standard") == "ledger" and tasks.tiny_variant("short") == "tiny"


# ---------------------------------------------------------------- training and evaluation


@pytest.fixture(scope="module")
def tiny_tracing_model(tmp_path_factory):
    """``python -m zipage.quality.train --task tracing --tiny``: the checkpoint and its record."""
    from zipage.quality import train

    out = str(tmp_path_factory.mktemp("tracing-tiny"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train.main(["--task", "tracing", "--tiny", "--out", out]) == 0
    finally:
        torch.set_num_threads(threads)
    with open(os.path.join(out, "training.json")) as f:
        return out, json.load(f)


def test_tiny_training_on_tracing_writes_a_checkpoint(tiny_tracing_model):
    out, record = tiny_tracing_model
    assert record["config"]["task"] == "tracing-tiny"
    curve = [entry["loss"] for entry in record["loss_curve"]]
    assert curve[-1] < 0.6 * curve[0], curve  # it learns
    assert 0.0 <= record["held_out"]["accuracy"] <= 1.0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(out, name)), name


def test_eval_compares_settings_on_the_tiny_checkpoint(tiny_tracing_model, tmp_path, capsys):
    from zipage.cli import main

    model, _ = tiny_tracing_model
    out = tmp_path / "compare"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["eval", "synthetic", "--model", model, "--task", "tracing-tiny", "--num-problems", "2",
                     "--budgets", "0.5", "--settings", "defaults,keep_prompt,tuned", "--block-size", "16",
                     "--window", "8", "--device", "cpu", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    with open(out / "synthetic.json") as f:
        record = json.load(f)
    assert [(r["policy"], r.get("setting")) for r in record["runs"]] == [
        ("full", None), ("zipage", "defaults"), ("zipage", "keep_prompt"), ("zipage", "tuned")]
    compared = record["settings"]["compared"]
    assert compared["defaults"] == dict(keep_prompt=False, pool_every_compression=False, window=8)
    assert compared["tuned"] == dict(keep_prompt=True, pool_every_compression=True, window=16)
    assert record["settings"]["family"] == "tracing"
    budgets = {r["budget_tokens"] for r in record["runs"][1:]}
    assert len(budgets) == 1
    best = record["summary"]["best_settings"][str(budgets.pop())]
    for metric in ("accuracy", "prefix_fraction"):
        top = max(r[metric] for r in record["runs"][1:])
        assert best[metric] == [r["setting"] for r in record["runs"][1:] if r[metric] == top]
    table = (out / "synthetic.md").read_text()
    assert "| best accuracy | best prefix |" in table and "- tuned: window 16, statement kept" in table
    assert os.path.isfile(out / "synthetic.png") and "best accuracy" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--settings", "defaults,fast"], ["--settings", "tuned", "--keep-prompt"],
                                   ["--settings", "tuned", "--policies", "zipage"]])
def test_eval_rejects_bad_settings(flags, capsys):
    from zipage.cli import main

    # checked before any model is loaded
    assert main(["eval", "synthetic", "--model", "no-such-model", "--task", "tracing-tiny", *flags]) == 2
    assert "--settings" in capsys.readouterr().err
