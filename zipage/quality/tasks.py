"""Seeded synthetic reasoning problems with exact answers: the "ledger" task.

A problem statement defines five values and a rule for each digit; the worked
solution walks a chain of single-digit results, one numbered step per line. Step
i starts from the previous result u, names the rule for u (rules are lettered,
A for 0 to J for 9), fetches the value the rule points to and computes

    s = (u + x) mod 10,    v_i = (s + r) mod 10

where ``x`` is a value of the statement (a..e) or a milestone (``m``: the latest,
``n``: the one before it) and ``r`` is the result three steps back. Every
``milestone_every`` steps the current result becomes a milestone and a check line
restates the two live milestones. After the last step (the statement says how
many) the answer gives the last two results and the latest milestone.

    user:      a=9 b=4 c=5 d=8 e=0
               rules Ab Bb Cn Dd Ee Fm Gb Hd Im Jn
               start 0 0 3
               steps 63
    assistant: check m1=0 m2=3
               1 Dd d=8 3+8=1 1+0=1
               2 Bb b=4 1+4=5 5+0=5
               3 Fm m2=3 5+3=8 8+3=1
               ...
               10 Ab b=4 0+4=4 4+5=9
               m3=9
               check m2=3 m3=9
               11 Jn m2=3 9+3=2 2+3=5
               12 Fm m3=9 5+9=4 4+0=4
               13 Ee e=0 4+0=4 4+9=3
               ...
               63 Im m8=4 8+4=2 2+4=6
               answer 864

Why this shape. It is built like a reasoning trace whose working set stays small
while the trace grows: the statement (rules, values, the step count that ends the
solution) matters until the end, every step needs the steps just before it, some
need a milestone, and older steps are never needed again. Milestone and check lines
repeat earlier results, so the cache holds redundant copies of every live fact. A
policy that keeps the statement, the last three step lines and the latest check
line (under 200 tokens) can reproduce the solution at any length; one that keeps
only recent tokens loses the rules, one that keeps only what the last tokens
attend to loses the rules not used lately.

Made to be learnable by a small model from scratch: every lookup is keyed by a
rare token (a rule letter, a value name) and reads the token right after it, and
arithmetic comes one two-operand sum at a time. Shortcuts are designed out: there is no second
pass to copy, a step line never determines the next one (that needs the result
two steps back), and a draw whose chain would come back to an earlier state (and so
repeat itself) or whose last three results recur within 20 steps is drawn again.

Problem ``seed`` gives the same problem everywhere (``random.Random``). Held-out
problems use seeds from ``HELD_OUT_SEED`` up; training draws its seeds below it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

VALUE_NAMES = "abcdefgh"
RULE_KEYS = "ABCDEFGHIJ"  # the rule for digit d is lettered RULE_KEYS[d]
PERIOD_FREE = 20  # no three consecutive results come back within this many steps
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


def _draw_rules(rng: random.Random, names: str, milestone_share: float) -> list[str]:
    """The source of each digit's rule: a value name, "m" or "n"; both milestones appear at
    least once when milestones are drawn at all, so every solution reads an earlier milestone."""
    rules = [rng.choice("mn") if rng.random() < milestone_share else rng.choice(names) for _ in range(10)]
    if milestone_share > 0:
        for slot, source in zip(rng.sample(range(10), 2), "mn"):
            if source not in rules:
                rules[slot] = source
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
    results = [rng.randrange(10) for _ in range(3)]  # v_-2, v_-1, v_0
    num_steps = rng.randint(spec.min_steps, spec.max_steps)

    statement = "\n".join([
        " ".join(f"{name}={values[name]}" for name in names),
        "rules " + " ".join(f"{RULE_KEYS[digit]}{source}" for digit, source in enumerate(rules)),
        "start " + " ".join(str(v) for v in results),
        f"steps {num_steps}",
    ])
    milestones = results[1:]  # m1, m2: the last two start values
    lines = [f"check m1={milestones[0]} m2={milestones[1]}"]
    seen, recent = set(), {}
    for step in range(1, num_steps + 1):
        state = (step % spec.milestone_every, *results[-3:], milestones[-1], milestones[-2])
        triple = tuple(results[-3:])
        if state in seen or step - recent.get(triple, -PERIOD_FREE) < PERIOD_FREE:
            return None  # the chain would repeat itself, or go round a short loop
        seen.add(state)
        recent[triple] = step
        current, back = results[-1], results[-3]
        source = rules[current]
        if source in names:
            label, x = source, values[source]
        else:
            index = len(milestones) - (1 if source == "m" else 2)  # 0-based
            label, x = f"m{index + 1}", milestones[index]
        partial = (current + x) % 10
        result = (partial + back) % 10
        lines.append(f"{step} {RULE_KEYS[current]}{source} {label}={x} {current}+{x}={partial} "
                     f"{partial}+{back}={result}")
        results.append(result)
        if step % spec.milestone_every == 0 and step < num_steps:
            milestones.append(result)
            k = len(milestones)
            lines.append(f"m{k}={result}")
            lines.append(f"check m{k - 1}={milestones[-2]} m{k}={result}")
    answer = f"{results[-2]}{results[-1]}{milestones[-1]}"
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
