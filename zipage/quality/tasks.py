"""Seeded synthetic reasoning problems with exact answers: the "ledger" task.

A problem statement defines five values, a rule for each digit and a step count N;
the worked solution walks a chain of single-digit results, one step per line. Step
lines are numbered by the steps left, counting down from N (copied from the
statement) to 1. A step starts from the previous result u, names the rule for u
(rules are lettered, A for 0 to J for 9), fetches the value the rule points to and
computes

    s = (u + x) mod 10,    v = (s + r) mod 10

where ``x`` is a value of the statement (a..e) or a milestone (``m``: the latest,
``n``: the one before it) and ``r`` is the result three steps back. After every step
line whose number is a multiple of ``milestone_every`` (but not after line 1), its
result becomes a milestone and a check line restates the two live milestones. After
line 1 the answer gives the last two results and the latest milestone.

    user:      a=9 b=4 c=5 d=8 e=0
               rules Ab Bb Cn Dd Ee Fm Gb Hd Im Jn
               start 0 0 3
               steps 63
    assistant: check m1=0 m2=3
               63 Dd d=8 3+8=1 1+0=1
               62 Bb b=4 1+4=5 5+0=5
               61 Fm m2=3 5+3=8 8+3=1
               60 Bb b=4 1+4=5 5+1=6
               m3=6
               check m2=3 m3=6
               59 Gb b=4 6+4=0 0+5=5
               ...
               10 Bb b=4 1+4=5 5+6=1
               m8=1
               check m7=6 m8=1
               9 Bb b=4 1+4=5 5+5=0
               ...
               2 Dd d=8 3+8=1 1+1=2
               1 Cn m7=6 2+6=8 8+2=0
               answer 201

Why this shape. It is built like a reasoning trace whose working set stays small
while the trace grows: the statement's rules and values matter until the end, every
step needs the steps just before it, some need a milestone, and older steps are
never needed again. The step count is read once, for the first line; from then on
the line numbers carry it, so when to write a milestone (the number's last digit)
and when to stop (after line 1) are decided from the line just written, not by
matching a counter against the statement far back. (Numbered upwards, the stop
needed exactly that match, multi-digit and keyed by digits that occur everywhere: a
13.8M model trained on that design reproduced every step and then ran past the
last.) Milestone and check lines repeat earlier results, so the cache holds
redundant copies of every live fact. A policy that keeps the statement, the last
three step lines and the latest check line (under 200 tokens) can reproduce the
solution at any length; one that keeps only recent tokens loses the rules, one that
keeps only what the last tokens attend to loses the rules not used lately.

Made to be learnable by a small model from scratch: every lookup is keyed by a
rare token (a rule letter, a value name) and reads the token right after it,
arithmetic comes one two-operand sum at a time, and a line's number is the last step
line's number minus one. Shortcuts are designed out: there is no second
pass to copy, a step line never determines the next one (that needs the result
two steps back), and a draw whose chain would come back to an earlier state (and so
repeat itself) or whose last three results recur within 20 steps is drawn again (as
is one whose chain never reads a milestone).

Problem ``seed`` gives the same problem everywhere (``random.Random``). Held-out
problems use seeds from ``HELD_OUT_SEED`` up; training draws its seeds below it.

A second task of a different structure, register tracing (``zipage.quality.tracing``),
is registered in ``SPECS`` beside the ledger's variants ("tracing", "tracing-short",
"tracing-tiny"), and so is a third with long prompts, retrieval over many facts
(``zipage.quality.retrieval``: "retrieval", "retrieval-short", "retrieval-tiny");
``make_problem``, ``held_out_problems`` and the rest serve all three.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from zipage.quality import retrieval, tracing

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


# Named variants: "standard" is the trained ledger task; "short" and "tiny" serve CPU checks and CI.
# The register-tracing and retrieval variants follow the same pattern ("tracing", "tracing-short",
# "tracing-tiny"; "retrieval", "retrieval-short", "retrieval-tiny").
SPECS = {
    "standard": TaskSpec(),
    "short": TaskSpec(min_steps=10, max_steps=24, milestone_every=5),
    "tiny": TaskSpec(min_steps=3, max_steps=6, milestone_every=2, num_values=3),
    **tracing.SPECS,
    **retrieval.SPECS,
}
AnySpec = TaskSpec | tracing.TracingSpec | retrieval.RetrievalSpec
TINY_VARIANTS = {"ledger": "tiny", "tracing": "tracing-tiny", "retrieval": "retrieval-tiny"}


@dataclass(frozen=True)
class Problem:
    seed: int
    statement: str  # the user message
    solution: str  # the worked solution, ending with the answer line
    answer: str  # digits: ledger, the last two results and the latest milestone; tracing, the final
    # registers; retrieval, each question's result
    num_steps: int  # N: the first step line is numbered N, the last 1 (retrieval: the fact lines, all chains)


def get_spec(spec: AnySpec | str) -> AnySpec:
    if isinstance(spec, AnySpec):
        return spec
    if spec not in SPECS:
        raise ValueError(f"unknown task spec {spec!r}; choose from {sorted(SPECS)}")
    return SPECS[spec]


def family(spec: AnySpec | str) -> str:
    """Which task ``spec`` is a variant of: "ledger", "tracing" or "retrieval"."""
    spec = get_spec(spec)
    if isinstance(spec, tracing.TracingSpec):
        return "tracing"
    return "retrieval" if isinstance(spec, retrieval.RetrievalSpec) else "ledger"


def tiny_variant(spec: AnySpec | str) -> str:
    """The CI-sized variant of ``spec``'s task: "tiny", "tracing-tiny" or "retrieval-tiny"."""
    return TINY_VARIANTS[family(spec)]


def _draw_rules(rng: random.Random, names: str, milestone_share: float) -> list[str]:
    """The source of each digit's rule: a value name, "m" or "n"; both milestones appear at
    least once when milestones are drawn at all (a draw whose chain reads none is drawn again)."""
    rules = [rng.choice("mn") if rng.random() < milestone_share else rng.choice(names) for _ in range(10)]
    if milestone_share > 0:
        for slot, source in zip(rng.sample(range(10), 2), "mn"):
            if source not in rules:
                rules[slot] = source
    return rules


def make_problem(seed: int, spec: AnySpec | str = "standard") -> Problem:
    """The problem of ``seed``: statement, worked solution and answer.

    Ledger: a draw whose chain comes back to a state it was in (same results, milestones
    and place in the step cycle) would repeat itself from there on, so it is drawn again;
    so is one whose chain never reads a milestone. Tracing and retrieval: ``tracing.draw``
    and ``retrieval.draw`` say which draws they reject.
    """
    spec = get_spec(spec)
    rng = random.Random(seed)
    while True:
        if isinstance(spec, (tracing.TracingSpec, retrieval.RetrievalSpec)):
            module = tracing if isinstance(spec, tracing.TracingSpec) else retrieval
            fields = module.draw(rng, spec)
            problem = None if fields is None else Problem(seed=seed, **fields)
        else:
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
    seen, recent, reads_milestone = set(), {}, False
    for left in range(num_steps, 0, -1):  # steps left, this one included: the line's number
        state = (left % spec.milestone_every, *results[-3:], milestones[-1], milestones[-2])
        triple = tuple(results[-3:])
        if state in seen or recent.get(triple, left + PERIOD_FREE) - left < PERIOD_FREE:
            return None  # the chain would repeat itself, or go round a short loop
        seen.add(state)
        recent[triple] = left
        current, back = results[-1], results[-3]
        source = rules[current]
        if source in names:
            label, x = source, values[source]
        else:
            index = len(milestones) - (1 if source == "m" else 2)  # 0-based
            label, x = f"m{index + 1}", milestones[index]
            reads_milestone = True
        partial = (current + x) % 10
        result = (partial + back) % 10
        lines.append(f"{left} {RULE_KEYS[current]}{source} {label}={x} {current}+{x}={partial} "
                     f"{partial}+{back}={result}")
        results.append(result)
        if left % spec.milestone_every == 0 and left > 1:
            milestones.append(result)
            k = len(milestones)
            lines.append(f"m{k}={result}")
            lines.append(f"check m{k - 1}={milestones[-2]} m{k}={result}")
    if spec.milestone_rules > 0 and not reads_milestone:
        return None  # every solution needs an earlier milestone somewhere
    answer = f"{results[-2]}{results[-1]}{milestones[-1]}"
    lines.append(f"answer {answer}")
    return Problem(seed=seed, statement=statement, solution="\n".join(lines), answer=answer, num_steps=num_steps)


def held_out_problems(count: int, spec: AnySpec | str = "standard", start: int = 0) -> list[Problem]:
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
