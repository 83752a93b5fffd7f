"""The synthetic ledger task and its character tokenizer."""

from __future__ import annotations

import re

import pytest

from zipage.quality import tasks
from zipage.quality.tokenizer import VOCAB, CharCodec, save_tokenizer

STEP = re.compile(r"^(\d+) ([A-J])([a-z]) (\w+)=(\d) (\d)\+(\d)=(\d) (\d)\+(\d)=(\d)$")


def _statement(text: str):
    lines = text.split("\n")
    values = {k: int(v) for k, v in re.findall(r"([a-z])=(\d)", lines[0])}
    rules = {"ABCDEFGHIJ".index(key): source for key, source in re.findall(r"([A-J])([a-z])", lines[1])}
    start = [int(v) for v in lines[2].split()[1:]]
    steps = int(lines[3].split()[1])
    return values, rules, start, steps


def solve_step(working_set: str) -> str:
    """The next step line computed from a working set only: the statement, the latest
    check line and the last three step lines (an independent reading of the rules).
    Its number is the last step line's minus one, or the statement's step count first."""
    values, rules, start, steps = _statement(working_set)
    recent = [m for m in (STEP.match(line) for line in working_set.split("\n")) if m]
    results = start + [int(m.group(11)) for m in recent]
    number = int(recent[-1].group(1)) - 1 if recent else steps
    current, back = results[-1], results[-3]
    check = [line for line in working_set.split("\n") if line.startswith("check ")][-1]
    milestones = [(int(k), int(v)) for k, v in re.findall(r"m(\d+)=(\d)", check)]
    source = rules[current]
    if source in values:
        label, x = source, values[source]
    else:
        k, x = milestones[-1] if source == "m" else milestones[-2]
        label = f"m{k}"
    partial = (current + x) % 10
    result = (partial + back) % 10
    return f"{number} {'ABCDEFGHIJ'[current]}{source} {label}={x} {current}+{x}={partial} {partial}+{back}={result}"


def after_step(line: str, every: int) -> str:
    """What follows a step line, decided from that line alone: "answer" after line 1,
    a milestone after a line numbered by a multiple of ``every``, else the next step."""
    number = int(STEP.match(line).group(1))
    return "answer" if number == 1 else "milestone" if number % every == 0 else "step"


@pytest.mark.parametrize("seed,spec", [(0, "standard"), (1, "standard"), (2, "standard"),
                                       (tasks.HELD_OUT_SEED + 7, "standard"), (3, "short"), (4, "tiny")])
def test_every_step_follows_from_a_small_working_set(seed, spec):
    problem = tasks.make_problem(seed, spec)
    every = tasks.SPECS[spec].milestone_every
    lines = problem.solution.split("\n")
    assert lines[0].startswith("check m1=") and lines[-1] == f"answer {problem.answer}"
    numbers, milestones = [], 2
    for i, line in enumerate(lines):
        match = STEP.match(line)
        if match:
            before = lines[:i]
            check = [x for x in before if x.startswith("check ")][-1]
            last_three = [x for x in before if STEP.match(x)][-3:]
            working_set = "\n".join([problem.statement, check] + last_three)
            assert len(working_set) < 200  # constant, whatever the solution's length
            assert solve_step(working_set) == line
            numbers.append(int(match.group(1)))
            following = lines[i + 1]
            kind = "answer" if following.startswith("answer ") else "milestone" if following.startswith("m") else "step"
            assert kind == after_step(line, every), (line, following)
        elif line.startswith("m"):
            milestones += 1
            assert line == f"m{milestones}={lines[i - 1][-1]}"
            assert lines[i + 1].startswith(f"check m{milestones - 1}=") and lines[i + 1].endswith(f" {line}")
    _, _, _, steps = _statement(problem.statement)
    assert numbers == list(range(steps, 0, -1)) and steps == problem.num_steps
    results = [line[-1] for line in lines if STEP.match(line)]
    latest = [line[-1] for line in lines if re.match(r"^m\d+=\d$", line)] or [lines[0][-1]]
    assert problem.answer == results[-2] + results[-1] + latest[-1]
    assert tasks.extract_answer(problem.solution) == problem.answer


def test_problems_are_seeded_and_held_out_ones_differ_from_training():
    assert tasks.make_problem(5) == tasks.make_problem(5)
    assert tasks.make_problem(5) != tasks.make_problem(6)
    held = tasks.held_out_problems(3)
    assert [p.seed for p in held] == [tasks.HELD_OUT_SEED + i for i in range(3)]
    import random
    rng = random.Random(0)
    assert all(tasks.training_seed(rng) < tasks.HELD_OUT_SEED for _ in range(1000))


def test_lengths_cover_one_to_three_thousand_tokens_and_milestones_are_read():
    codec = CharCodec()
    lengths, reads_milestone = [], 0
    for seed in range(200):
        p = tasks.make_problem(seed)
        ids, prompt_len = codec.encode_chat(tasks.messages(p), p.solution)
        lengths.append(len(ids))
        reads_milestone += bool(re.search(r"[A-J][mn] ", p.solution))
    assert 900 <= min(lengths) and max(lengths) <= 3100
    assert 1700 <= sum(lengths) / len(lengths) <= 2100
    assert reads_milestone == 200


def test_no_solution_repeats_itself():
    """Runs of five step lines (step numbers aside) almost never come back within a solution,
    no result repeats for long, and a step line does not determine the next one."""
    followers: dict = {}
    repeated, total = 0, 0
    for seed in range(200):
        lines = [line.split(" ", 1)[1] for line in tasks.make_problem(seed).solution.split("\n") if STEP.match(line)]
        windows = [tuple(lines[i:i + 5]) for i in range(len(lines) - 4)]
        repeated += len(windows) - len(set(windows))
        total += len(windows)
        results = "".join(line[-1] for line in lines)
        assert not re.search(r"(\d)\1\1\1", results), results
        for a, b in zip(lines, lines[1:]):
            followers.setdefault((seed, a), set()).add(b)
    assert repeated / total < 0.005
    ambiguous = sum(len(f) > 1 for f in followers.values())
    assert ambiguous > 0.1 * len(followers)


def test_extract_answer_and_specs():
    assert tasks.extract_answer("12 ...\nanswer 523") == "523"
    assert tasks.extract_answer("answer 1\nanswer 42") == "42"
    assert tasks.extract_answer("no answer here") is None
    tiny = tasks.make_problem(0, "tiny")
    assert 3 <= tiny.num_steps <= 6 and tiny.statement.startswith("a=")
    with pytest.raises(ValueError, match="unknown task spec"):
        tasks.make_problem(0, "huge")
    with pytest.raises(ValueError, match="min_steps"):
        tasks.TaskSpec(min_steps=5, max_steps=4)


def test_tokenizer_files_match_the_codec(tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    codec = CharCodec()
    assert len(tok) == len(VOCAB) == codec.vocab_size
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == 0
    for seed in range(5):
        p = tasks.make_problem(seed)
        ids, prompt_len = codec.encode_chat(tasks.messages(p), p.solution)
        text = tok.apply_chat_template(tasks.messages(p), tokenize=False, add_generation_prompt=True)
        assert tok.encode(text, add_special_tokens=False) == ids[:prompt_len].tolist()
        assert tok.encode(p.solution, add_special_tokens=False) == ids[prompt_len:-1].tolist()
        assert ids[-1] == tok.eos_token_id
        assert tok.decode(ids[prompt_len:].tolist(), skip_special_tokens=True) == p.solution
        assert codec.decode(ids) == text + p.solution + "<|im_end|>"
    assert tok.decode(tok.encode("a=3 \u00e9", add_special_tokens=False)) == "a=3 <unk>"
