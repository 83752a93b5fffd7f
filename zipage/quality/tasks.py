"""Seeded synthetic reasoning problems with exact answers: the "ledger" task.

A problem statement defines five values and a rule for each digit; the worked
solution walks a chain of single-digit results, one numbered step per line. Step
i starts from the previous result u, looks up the rule for u, fetches the value
the rule names and computes

    v_i = (u op x + r) mod 10

where ``op`` is + or -, ``x`` is a value of the statement (a..e) or a milestone
(``m``: the latest, ``n``: the one before it) and ``r`` is the result two steps
back. Every ``milestone_every`` steps the current result becomes a milestone and a
check line restates the two live milestones. After the last step (the statement
says how many) the answer gives the last two results and the latest milestone.

    user:      a=3 b=8 c=5 d=1 e=6
               rules 0:a+ 1:m+ 2:b- 3:n+ 4:c- 5:e+ 6:d+ 7:m- 8:e- 9:a-
               start 4 7
               steps 96
    assistant: check m1=4 m2=7
               1 7:m- m2=7 7-7+4=4
               2 4:c- c=5 4-5+7=6
               ...
               10 2:b- b=8 2-8+9=3
               m3=3
               check m2=7 m3=3
               11 3:n+ m2=7 3+7+2=2
               ...
               96 5:e+ e=6 5+6+1=2
               answer 523

Why this shape. It is built like a reasoning trace whose working set stays small
while the trace grows: the statement (rules, values, the step count that ends the
solution) matters until the end, every step needs the two steps before it, some
need a milestone, and older steps are never needed again. Milestone and check lines
repeat earlier results, so the cache holds redundant copies of every live fact. A
policy that keeps the statement, the last lines and the latest check line (about
150 tokens) can reproduce the solution at any length; one that keeps only recent
tokens loses the rules, one that keeps only what the last tokens attend to loses
the rules not used lately.

Shortcuts are designed out: three operands make an exact expression rarely repeat
within a solution (2,000 combinations, about 100 steps), so the model must add
rather than copy an earlier line, and there is no second pass to copy.

Problem ``seed`` gives the same problem everywhere (``random.Random``). Held-out
problems use seeds from ``HELD_OUT_SEED`` up; training draws its seeds below it.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

VALUE_NAMES = "abcdefgh"
HELD_OUT_SEED = 1 << 40  # held-out problems: seeds >= this; training: seeds below
ANSWER_PATTERN = re.compile(r"answer (\d+)")


@dataclass(frozen=True)
class TaskSpec:
    """How long the solutions are and how the problems are drawn."""

    min_steps: int = 36  # about 1,000 tokens with the prompt
    max_steps: int = 110  # about 3,000 tokens
    milestone_every: int = 10
    num_values: int = 5  # named values of the statement (a, b, c, ...)
    milestone_rules: float = 0.4  # share of the rules that read a milestone (m or n)

    def __post_init__(self):
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.milestone_every < 1:
            raise ValueError(f"milestone_every must be >= 1, got {self.milestone_every}")
        if not 1 <= self.num_values <= len(VALUE_NAMES):
            raise ValueError(f"num_values must be in [1, {len(VALUE_NAMES)}], got {self.num_values}")
        if not 0.0 <= self.milestone_rules <= 1.0:
            raise ValueError(f"milestone_rules must be in [0, 1], got {self.milestone_rules}")


# Named variants: "standard" is the trained task; "short" and "tiny" serve CPU checks and CI.
SPECS = {
    "standard": TaskSpec(),
    "short": TaskSpec(min_steps=10, max_steps=24, milestone_every=5),
    "tiny": TaskSpec(min_steps=3, max_steps=6, milestone_every=2, num_values=3),
}


@dataclass(frozen=True)
class Problem:
    seed: int
    statement: str  # the user message
    solution: str  # the worked solution, ending with the answer line
    answer: str  # digits: the last two results and the latest milestone
    num_steps: int


def get_spec(spec: TaskSpec | str) -> TaskSpec:
    if isinstance(spec, TaskSpec):
        return spec
    if spec not in SPECS:
        raise ValueError(f"unknown task spec {spec!r}; choose from {sorted(SPECS)}")
    return SPECS[spec]


def _draw_rules(rng: random.Random, names: str, milestone_share: float) -> list[tuple[str, str]]:
    """(source, op) for each digit: a value name, "m" or "n"; both milestones appear at least once
    when milestones are drawn at all, so every solution reads an earlier milestone."""
    rules = []
    for _ in range(10):
        if rng.random() < milestone_share:
            source = rng.choice("mn")
        else:
            source = rng.choice(names)
        rules.append((source, rng.choice("+-")))
    if milestone_share > 0:
        slots = rng.sample(range(10), 2)
        for slot, source in zip(slots, "mn"):
            if not any(s == source for s, _ in rules):
                rules[slot] = (source, rules[slot][1])
    return rules


def make_problem(seed: int, spec: TaskSpec | str = "standard") -> Problem:
    """The problem of ``seed``: statement, worked solution and answer.

    A draw whose chain comes back to a state it was in (same results, milestones and
    place in the step cycle) would repeat itself from there on, so it is drawn again.
    """
    spec = get_spec(spec)
    rng = random.Random(seed)
    while True:
        problem = _draw(rng, spec, seed)
        if problem is not None:
            return problem


def _draw(rng: random.Random, spec: TaskSpec, seed: int) -> Problem | None:
    names = VALUE_NAMES[:spec.num_values]
    values = {name: rng.randrange(10) for name in names}
    rules = _draw_rules(rng, names, spec.milestone_rules)
    before, start = rng.randrange(10), rng.randrange(10)
    num_steps = rng.randint(spec.min_steps, spec.max_steps)

    statement = "\n".join([
        " ".join(f"{name}={values[name]}" for name in names),
        "rules " + " ".join(f"{digit}:{source}{op}" for digit, (source, op) in enumerate(rules)),
        f"start {before} {start}",
        f"steps {num_steps}",
    ])
    cycle = math.lcm(10, spec.milestone_every)
    seen = set()
    milestones = [before, start]  # m1, m2: the start values
    lines = [f"check m1={before} m2={start}"]
    previous, current = before, start
    for step in range(1, num_steps + 1):
        state = (step % cycle, previous, current, milestones[-1], milestones[-2])
        if state in seen:
            return None
        seen.add(state)
        source, op = rules[current]
        if source in names:
            label, x = source, values[source]
        else:
            index = len(milestones) - (1 if source == "m" else 2)  # 0-based
            label, x = f"m{index + 1}", milestones[index]
        sign = 1 if op == "+" else -1
        digit = step % 10
        result = (current + sign * x + previous + digit) % 10
        lines.append(f"{step} {current}:{source}{op} {label}={x} {current}{op}{x}+{previous}+{digit}={result}")
        previous, current = current, result
        if step % spec.milestone_every == 0 and step < num_steps:
            milestones.append(current)
            k = len(milestones)
            lines.append(f"m{k}={current}")
            lines.append(f"check m{k - 1}={milestones[-2]} m{k}={current}")
    answer = f"{previous}{current}{milestones[-1]}"
    lines.append(f"answer {answer}")
    return Problem(seed=seed, statement=statement, solution="\n".join(lines), answer=answer, num_steps=num_steps)


def held_out_problems(count: int, spec: TaskSpec | str = "standard", start: int = 0) -> list[Problem]:
    """``count`` problems no training run draws (seeds ``HELD_OUT_SEED + start + i``)."""
    return [make_problem(HELD_OUT_SEED + start + i, spec) for i in range(count)]


def training_seed(rng: random.Random) -> int:
    """A training problem's seed, below ``HELD_OUT_SEED``."""
    return rng.randrange(HELD_OUT_SEED)


def extract_answer(text: str) -> str | None:
    """The digits of the last ``answer`` line, or None."""
    found = ANSWER_PATTERN.findall(text)
    return found[-1] if found else None


def messages(problem: Problem, with_solution: bool = False) -> list[dict]:
    """The problem as a chat; with the solution as the assistant's reply when asked."""
    chat = [{"role": "user", "content": problem.statement}]
    if with_solution:
        chat.append({"role": "assistant", "content": problem.solution})
    return chat
