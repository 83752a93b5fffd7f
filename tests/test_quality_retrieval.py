"""The retrieval task: every solution re-derived by an independent interpreter, from the
whole statement and from the small set of tokens a policy must keep; a recency window
of half the prompt fails every problem; the shortcut guarantees, the lengths, the split,
the tokenizer and the training entry points (no training run: see test_quality_train)."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from zipage.quality import retrieval, tasks, train
from zipage.quality.tokenizer import CharCodec, build_tokenizer

FACT = re.compile(r"^([A-Z]{2}) (\d) ([A-Z]{2})$")
QUESTION = re.compile(r"^q(\d) ([A-Z]{2}) (\d)$")
HOP = re.compile(r"^(\d) ([A-Z]{2}) (\d) ([A-Z]{2}) (\d)\+(\d)=(\d)$")
RESULT = re.compile(r"^a(\d)=(\d) (\d+)$")
ANSWER = re.compile(r"^answer (\d+)$")
SPEC_SEEDS = [("retrieval", 0), ("retrieval", 1), ("retrieval", tasks.HELD_OUT_SEED + 2),
              ("retrieval-short", 3), ("retrieval-short", 4), ("retrieval-tiny", 5), ("retrieval-tiny", 6)]


class Missing(Exception):
    """The next line needs a line that is not visible (evicted)."""


def next_line(prompt: list[str], trace: list[str]) -> str:
    """The solution's next line from the visible lines only: ``prompt``, the statement's lines
    that are kept, and ``trace``, the kept lines of the solution so far (the last one is the
    line just written). Raises ``Missing`` when a line it needs is not there."""
    facts = {m.group(1): (int(m.group(2)), m.group(3)) for m in map(FACT.match, prompt) if m}
    questions = {int(m.group(1)): line for line, m in zip(prompt, map(QUESTION.match, prompt)) if m}

    def fact(key: str) -> tuple[int, str]:
        if key not in facts:
            raise Missing(f"fact {key}")
        return facts[key]

    def question(number: int) -> str:
        if number not in questions:
            raise Missing(f"question q{number}")
        return questions[number]

    if not trace:  # the first question is the one with the highest number
        if not questions:
            raise Missing("the questions")
        return question(max(questions))
    last = trace[-1]
    if m := QUESTION.match(last):
        start = (0, m.group(2), int(m.group(3)) + 1)  # as if after a line numbered length + 1
    elif m := HOP.match(last):
        start = (int(m.group(7)), m.group(4), int(m.group(1)))
    elif m := RESULT.match(last):
        number = int(m.group(1))
        return f"answer {m.group(3)}" if number == 1 else question(number - 1)
    else:
        raise AssertionError(f"no line follows {last!r}")
    total, key, number = start
    if number > 1:
        value, pointer = fact(key)
        return f"{number - 1} {key} {value} {pointer} {total}+{value}={(total + value) % 10}"
    current = [line for line in trace if QUESTION.match(line)]
    results = [RESULT.match(line).group(3) for line in trace if RESULT.match(line)]
    if not current:
        raise Missing("the current question")
    so_far = results[-1] if results else ""
    return f"a{QUESTION.match(current[-1]).group(1)}={total} {so_far}{total}"


def interpret(statement: str) -> str:
    """The whole solution from the whole statement, one ``next_line`` at a time."""
    prompt, trace = statement.split("\n"), []
    while not trace or not trace[-1].startswith("answer"):
        trace.append(next_line(prompt, trace))
    return "\n".join(trace)


def chains(statement: str) -> list[list[int]]:
    """Per question, the statement's fact lines its chain reads (read here from the text)."""
    lines = statement.split("\n")
    line_of = {m.group(1): i for i, m in enumerate(map(FACT.match, lines)) if m}
    out = []
    for m in filter(None, map(QUESTION.match, lines)):
        key, chain = m.group(2), []
        for _ in range(int(m.group(3))):
            chain.append(line_of[key])
            key = FACT.match(lines[line_of[key]]).group(3)
        out.append(chain)
    return out


def working_set(statement: str, solution_lines: list[str], i: int) -> tuple[list[str], list[str]]:
    """What a policy must keep to write solution line ``i``: the facts of the chains not yet
    walked (the one being read included) and the questions not yet copied, from the
    statement; the current question's line, the latest result line and the previous line,
    from the solution."""
    lines = statement.split("\n")
    done = solution_lines[:i]
    walked = sum(1 for line in done if HOP.match(line))
    copied = sum(1 for line in done if QUESTION.match(line))
    needed = [line for chain in chains(statement) for line in chain][walked:]
    question_lines = [k for k, line in enumerate(lines) if QUESTION.match(line)][copied:]
    prompt = [lines[k] for k in sorted(needed + question_lines)]
    keep = {len(done) - 1} if done else set()
    for pattern in (QUESTION, RESULT):
        found = [k for k, line in enumerate(done) if pattern.match(line)]
        keep |= set(found[-1:])
    return prompt, [done[k] for k in sorted(keep)]


def recency_view(statement: str, solution_lines: list[str], i: int, window: int) -> tuple[list[str], list[str]]:
    """The complete lines among the last ``window`` characters (tokens) before solution line ``i``."""
    lines = statement.split("\n") + solution_lines[:i]
    end = sum(len(line) + 1 for line in lines)
    visible, position = [], 0
    for k, line in enumerate(lines):
        if position >= end - window:
            visible.append(k)
        position += len(line) + 1
    split = statement.count("\n") + 1
    return [lines[k] for k in visible if k < split], [lines[k] for k in visible if k >= split]


# ---------------------------------------------------------------- the solutions


@pytest.mark.parametrize("spec,seed", SPEC_SEEDS)
def test_every_solution_matches_an_independent_interpreter(spec, seed):
    problem = tasks.make_problem(seed, spec)
    assert problem.solution == interpret(problem.statement) == retrieval.solve(problem.statement)
    lines = problem.solution.split("\n")
    assert all(QUESTION.match(x) or HOP.match(x) or RESULT.match(x) for x in lines[:-1])
    assert lines[-1] == f"answer {problem.answer}" and tasks.extract_answer(problem.solution) == problem.answer
    assert len(problem.answer) == len(chains(problem.statement))
    assert problem.num_steps == sum(1 for line in lines if HOP.match(line)) == len(retrieval.needed_facts(
        problem.statement))
    assert retrieval.needed_facts(problem.statement) == [k for chain in chains(problem.statement) for k in chain]


def test_many_solutions_re_execute():
    for spec in ("retrieval", "retrieval-short", "retrieval-tiny"):
        for seed in range(40):
            problem = tasks.make_problem(seed, spec)
            assert interpret(problem.statement) == problem.solution


@pytest.mark.parametrize("spec,seed", SPEC_SEEDS)
def test_each_line_follows_from_the_minimal_working_set(spec, seed):
    """The tokens a policy must keep (module docstring): enough for every line, and few (the
    standard variant: at most 42 facts and 6 questions of 8 tokens, 384 tokens, plus a result line)."""
    problem = tasks.make_problem(seed, spec)
    lines = problem.solution.split("\n")
    sizes = []
    for i, line in enumerate(lines):
        prompt, trace = working_set(problem.statement, lines, i)
        assert next_line(prompt, trace) == line
        sizes.append(sum(len(x) + 1 for x in prompt + trace))
    assert max(sizes) <= 384 + 12 and sizes[-1] < 30


def test_evicting_a_needed_fact_breaks_the_line_that_reads_it():
    problem = tasks.make_problem(7, "retrieval")
    lines = problem.solution.split("\n")
    for i, line in enumerate(lines):
        if HOP.match(line):
            prompt, trace = working_set(problem.statement, lines, i)
            key = HOP.match(line).group(2)
            with pytest.raises(Missing, match=f"fact {key}"):
                next_line([x for x in prompt if not x.startswith(key + " ")], trace)


def test_a_recency_window_of_half_the_prompt_fails_every_problem():
    """Every question needs a fact from the first half of the facts, so a window of half the
    prompt misses one in every problem; the whole prompt plus solution always suffices."""
    for spec in ("retrieval", "retrieval-short", "retrieval-tiny"):
        for seed in range(15):
            problem = tasks.make_problem(tasks.HELD_OUT_SEED + seed, spec)
            lines = problem.solution.split("\n")
            window = len(problem.statement) // 2
            failed = False
            for i, line in enumerate(lines):
                try:
                    failed = next_line(*recency_view(problem.statement, lines, i, window)) != line
                except Missing:
                    failed = True
                if failed:
                    break
            assert failed, (spec, seed)
            whole = len(problem.statement) + len(problem.solution) + 2
            assert all(next_line(*recency_view(problem.statement, lines, i, whole)) == line
                       for i, line in enumerate(lines))


# ---------------------------------------------------------------- shortcuts and spread


def test_shortcut_guarantees():
    for spec in ("retrieval", "retrieval-short", "retrieval-tiny"):
        for seed in range(60):
            problem = tasks.make_problem(seed, spec)
            statement = problem.statement.split("\n")
            facts = [FACT.match(x) for x in statement if FACT.match(x)]
            keys = [m.group(1) for m in facts]
            assert len(set(keys)) == len(keys) == retrieval.num_facts(problem.statement)
            assert all(m.group(3) in keys and m.group(3) != m.group(1) for m in facts)  # no end is marked
            assert all(QUESTION.match(x) for x in statement[len(facts):])  # questions after every fact
            walked = [k for chain in chains(problem.statement) for k in chain]
            assert len(set(walked)) == len(walked)  # disjoint chains: no fact is read twice
            hop_keys = [HOP.match(x).group(2) for x in problem.solution.split("\n") if HOP.match(x)]
            assert len(set(hop_keys)) == len(hop_keys)
            for chain in chains(problem.statement):
                assert min(chain) < len(facts) // 2  # each question needs a fact far from the end
                assert all(b != a + 1 for a, b in zip(chain, chain[1:]))  # never just the next line


def test_needed_facts_are_spread_over_the_prompt_and_a_minority():
    quarters, shares = Counter(), []
    for seed in range(200):
        problem = tasks.make_problem(seed, "retrieval")
        count = retrieval.num_facts(problem.statement)
        needed = retrieval.needed_facts(problem.statement)
        quarters.update(4 * k // count for k in needed)
        shares.append(len(needed) / count)
    total = sum(quarters.values())
    assert all(0.18 < quarters[q] / total < 0.35 for q in range(4)), quarters
    assert max(shares) <= 42 / 120 and sum(shares) / len(shares) < 0.2


def test_problems_are_seeded_and_held_out_seeds_are_apart():
    assert tasks.make_problem(5, "retrieval") == tasks.make_problem(5, "retrieval")
    assert tasks.make_problem(5, "retrieval") != tasks.make_problem(6, "retrieval")
    assert tasks.make_problem(5, "retrieval-tiny").statement != tasks.make_problem(5, "tracing-tiny").statement
    held = tasks.held_out_problems(3, "retrieval")
    assert [p.seed for p in held] == [tasks.HELD_OUT_SEED + i for i in range(3)]
    assert held[0] == tasks.make_problem(tasks.HELD_OUT_SEED, "retrieval")
    rng = random.Random(0)
    assert all(tasks.training_seed(rng) < tasks.HELD_OUT_SEED for _ in range(1000))


# ---------------------------------------------------------------- lengths and the tokenizer


@pytest.mark.parametrize("spec,prompt_range,solution_range,total_max", [
    ("retrieval", (1000, 2000), (250, 800), 2800),
    ("retrieval-short", (250, 560), (90, 360), 900),
    ("retrieval-tiny", (90, 140), (90, 150), 300),  # the tiny model's 512 positions, with room
])
def test_token_lengths(spec, prompt_range, solution_range, total_max):
    codec = CharCodec()
    prompts, solutions = [], []
    for seed in range(150):
        problem = tasks.make_problem(seed, spec)
        ids, prompt_len = codec.encode_chat(tasks.messages(problem), problem.solution)
        prompts.append(prompt_len)
        solutions.append(len(ids) - prompt_len)
        assert codec.ids["<unk>"] not in ids.tolist() and len(ids) <= total_max
    assert prompt_range[0] <= min(prompts) and max(prompts) <= prompt_range[1]
    assert solution_range[0] <= min(solutions) and max(solutions) <= solution_range[1]
    if spec == "retrieval":  # the knob spans the range: about 1,040 to 2,000 prompt tokens
        assert min(prompts) < 1150 and max(prompts) > 1850 and 1350 < sum(prompts) / len(prompts) < 1650


def test_the_tokenizer_round_trips():
    tok = build_tokenizer()
    unk = tok.token_to_id("<unk>")
    for problem in tasks.held_out_problems(2, "retrieval-short"):
        text = problem.statement + "\n" + problem.solution
        ids = tok.encode(text).ids
        assert unk not in ids and len(ids) == len(text) and tok.decode(ids) == text


# ---------------------------------------------------------------- registration


def test_spec_checks_its_values_and_is_registered():
    from zipage.quality.retrieval import RetrievalSpec

    with pytest.raises(ValueError, match="must not exceed min_facts"):
        RetrievalSpec(min_facts=10, max_facts=20, max_questions=4, max_hops=3)
    with pytest.raises(ValueError, match="its own fact from the first half"):
        RetrievalSpec(min_facts=6, max_facts=6, min_questions=4, max_questions=4, min_hops=1, max_hops=1)
    with pytest.raises(ValueError, match="max_hops"):
        RetrievalSpec(max_hops=10)
    with pytest.raises(ValueError, match="min_facts"):
        RetrievalSpec(min_facts=300, max_facts=700)
    assert {"retrieval", "retrieval-short", "retrieval-tiny"} <= set(tasks.SPECS)
    assert tasks.family("retrieval-short") == "retrieval" and tasks.tiny_variant("retrieval") == "retrieval-tiny"
    assert tasks.family("tracing") == "tracing" and tasks.tiny_variant("standard") == "tiny"
    fixed = RetrievalSpec(min_facts=150, max_facts=150)  # the prompt-length knob, fixed
    assert retrieval.num_facts(tasks.make_problem(0, fixed).statement) == 150


def test_training_takes_the_task():
    import argparse

    parser = argparse.ArgumentParser()
    train.add_train_args(parser)
    args = parser.parse_args(["--task", "retrieval", "--tiny", "--out", "x"])
    args.from_module = True
    config = train.config_from_args(args)
    assert config.task == "retrieval-tiny" and config.max_position_embeddings == 512
    assert train.curriculum_of(config) is None  # the tiny run trains on its variant alone
    args = parser.parse_args(["--task", "retrieval", "--out", "x"])
    args.from_module = True
    assert train.curriculum_of(train.config_from_args(args)).start == "retrieval-tiny"  # grown from it
    batches = train.batches_from(random.Random(0), tasks.get_spec("retrieval-tiny"), batch_tokens=4096)
    inputs, labels = next(batches)
    assert inputs.shape[1] <= 320 and (labels != train.IGNORE).any()
