"""Seeded retrieval problems over many facts with exact answers: the "retrieval" task.

A problem statement is a long list of facts followed by a few questions. A fact is a
line ``KM 7 AB``: a key (two capital letters, each key once), a value (a digit) and a
pointer (the key of another fact). A question ``q2 HP 4`` asks for the chain of 4 facts
that starts at fact HP and follows the pointers, and for the sum of their values
modulo 10. The worked solution answers the questions in order: it copies the question,
then writes one line per fact of the chain, copying the fact it looked up and adding
its value to the running sum, then a result line. The problem of seed 1 of the CI-sized
variant (``tasks.make_problem(1, "retrieval-tiny")``; the standard variant's problems are
built the same way, with 120 to 240 facts and 4 to 6 questions of 3 to 7 facts each):

    user:      ZH 4 DY
               AW 8 QK
               LK 6 IQ
               HI 7 ET
               IQ 5 SC
               QK 3 HI
               YU 8 LK
               DY 9 ZH
               SC 8 LK
               VX 4 AW
               LR 6 VX
               ET 9 HI
               q2 IQ 3
               q1 AW 2
    assistant: q2 IQ 3
               3 IQ 5 SC 0+5=5
               2 SC 8 LK 5+8=3
               1 LK 6 IQ 3+6=9
               a2=9 9
               q1 AW 2
               2 AW 8 QK 0+8=8
               1 QK 3 HI 8+3=1
               a1=1 91
               answer 91

Questions are numbered by the questions left, counting down to q1 (as the ledger's step
lines count down its steps). A fact line of the solution is numbered by the facts left
in its chain, from the question's length (copied from the question) down to 1; its key
is the question's start key on the chain's first line and the previous line's pointer
after that; then come the value and the pointer copied from the fact of that key, and
``s+v=t``: the running sum before (0 on a chain's first line), the value, and the sum
after. After line 1 of a chain, a result line ``aN=t R`` gives question N's result t and
R, the results so far in question order; after a1 the answer repeats R (exact match).

Why this shape. The ledger and register tracing have short statements and long
solutions: their tests are about what a policy keeps of the reasoning written so far.
Here the statement is long (about 1,000 to 2,000 tokens in the standard variant) and the
solution a few hundred tokens, and what matters is which prompt tokens a policy keeps,
in particular under compression during (chunked) prefill: the questions come after the
facts, so while the facts are read nothing tells which of them will be needed. Each
solution needs a few dozen facts (the chains of all questions, 12 to 42 of the 120 to
240 facts in the standard variant) and no other; every needed fact is read exactly once
(the chains of a problem share no fact), at the line that copies it, and exists only in
the prompt until then, so evicting it before that line breaks the solution at that
line, and evicting any other fact changes nothing. Which facts are needed beyond the
questions' start keys is found only by following the chains, so a policy cannot tell
them from the questions alone (by the attention the questions pay them, say). The
tokens a policy must keep to reproduce the solution, when writing a line: the facts of
the chains not yet walked (8 tokens each, the fact being read included), the questions
not yet copied, the current question's line, the latest result line and the previous
line: at most 384 tokens in the standard variant (245 on average), fewer as the
solution goes (``tests/test_quality_retrieval.py`` recomputes every line from exactly
that text). A policy that keeps only recent tokens fails: every question needs a fact
from the first half of the fact list (see below), so a window of half the prompt loses
every problem, and one as long as the whole prompt still loses 98 of 100 (the solution
pushes it past an early needed fact). A policy that keeps the statement whole, or just
the needed facts and the questions, loses nothing. The number of facts is the knob of
the prompt's length (``min_facts``, ``max_facts``; ``num_facts`` reads it back from a
statement), so accuracy can be reported against it.

Made to be learnable by a small model from scratch, by the ledger's rules: a fact is
looked up by its key, a pair of capital letters that starts exactly one line of the
statement (elsewhere it occurs only as a pointer, at a line's end: followed by a newline,
not by a space), and copied into the solution line, where its value and pointer sit at
fixed places; the key to look up is the previous line's last field but one (or the
question's start key), copied from the line just above; arithmetic is one two-operand
sum at a time; when a chain ends is read off the number of the line just written (its
facts left), when the solution ends off the result line just written (a1); the next
question is looked up by its label (``q`` and a digit) and the results so far are
copied from the latest result line, so no step of the solution reaches further back
than one question (the lookups aside); its first line copies the first question, the line
after the last fact.
Shortcuts are designed out: keys are distinct and drawn at random from the 676 pairs;
every pointer names an existing fact (a chain's end is not marked) and never the fact
itself; the chains are disjoint, so no fact is copied twice and a lookup can never be
served by an earlier line of the solution; the facts are shuffled, so the chains visit
the prompt in no particular order; and a draw in which a chain's next fact is the line
right after the previous one (where continuing to copy would be right by chance) or in
which some question needs no fact from the first half of the fact list (the lines
before ``num_facts // 2``) is drawn again.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

KEY_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
KEYS = [a + b for a in KEY_LETTERS for b in KEY_LETTERS]  # 676 two-letter keys
FACT = re.compile(r"^([A-Z]{2}) (\d) ([A-Z]{2})$")
QUESTION = re.compile(r"^q(\d) ([A-Z]{2}) (\d)$")


@dataclass(frozen=True)
class RetrievalSpec:
    """How many facts the statement lists (the prompt's length) and what the questions ask."""

    min_facts: int = 120  # about 1,040 prompt tokens
    max_facts: int = 240  # about 2,000 prompt tokens (a fact line is 8 tokens)
    min_questions: int = 4
    max_questions: int = 6
    min_hops: int = 3  # facts per chain (question)
    max_hops: int = 7

    def __post_init__(self):
        if not 2 <= self.min_facts <= self.max_facts <= len(KEYS):
            raise ValueError(f"need 2 <= min_facts <= max_facts <= {len(KEYS)}, "
                             f"got {self.min_facts}, {self.max_facts}")
        if not 1 <= self.min_questions <= self.max_questions <= 9:
            raise ValueError(f"need 1 <= min_questions <= max_questions <= 9, "
                             f"got {self.min_questions}, {self.max_questions}")
        if not 1 <= self.min_hops <= self.max_hops <= 9:
            raise ValueError(f"need 1 <= min_hops <= max_hops <= 9, got {self.min_hops}, {self.max_hops}")
        if self.max_questions * self.max_hops > self.min_facts:
            raise ValueError(f"max_questions * max_hops ({self.max_questions * self.max_hops}) must not exceed "
                             f"min_facts ({self.min_facts}): the chains are disjoint")
        if self.max_questions > self.min_facts // 2:
            raise ValueError(f"max_questions ({self.max_questions}) must not exceed min_facts // 2 "
                             f"({self.min_facts // 2}): each question needs its own fact from the first half")


# Named variants, registered with the ledger's in ``tasks.SPECS``.
SPECS = {
    "retrieval": RetrievalSpec(),
    "retrieval-short": RetrievalSpec(min_facts=30, max_facts=60, min_questions=2, max_questions=4,
                                     min_hops=2, max_hops=4),
    "retrieval-tiny": RetrievalSpec(min_facts=8, max_facts=12, min_questions=2, max_questions=2,
                                    min_hops=2, max_hops=3),
}


def draw(rng: random.Random, spec: RetrievalSpec) -> dict | None:
    """One draw: the fields of a ``tasks.Problem`` (statement, solution, answer, num_steps:
    the number of fact lines of the solution), or None when the draw is rejected (see the
    module's docstring)."""
    num_facts = rng.randint(spec.min_facts, spec.max_facts)
    hops = [rng.randint(spec.min_hops, spec.max_hops) for _ in range(rng.randint(spec.min_questions,
                                                                                 spec.max_questions))]
    keys = rng.sample(KEYS, num_facts)
    values = [rng.randrange(10) for _ in range(num_facts)]
    pointers: list[int | None] = [None] * num_facts
    chains, start = [], 0
    for length in hops:  # facts 0, 1, ... form the chains; the rest are distractors
        chain = list(range(start, start + length))
        for fact, following in zip(chain, chain[1:]):
            pointers[fact] = following
        chains.append(chain)
        start += length
    for fact in range(num_facts):
        if pointers[fact] is None:  # a chain's last fact or a distractor: any other fact
            other = rng.randrange(num_facts - 1)
            pointers[fact] = other + (other >= fact)
    order = list(range(num_facts))
    rng.shuffle(order)  # order[line] is the fact written on that line
    line_of = {fact: line for line, fact in enumerate(order)}
    for chain in chains:
        if min(line_of[fact] for fact in chain) >= num_facts // 2:
            return None  # every question needs a fact from the first half
        if any(line_of[b] == line_of[a] + 1 for a, b in zip(chain, chain[1:])):
            return None  # following a pointer never means reading the next line

    count = len(chains)
    questions = [f"q{count - k} {keys[chain[0]]} {len(chain)}" for k, chain in enumerate(chains)]
    statement = "\n".join([f"{keys[f]} {values[f]} {keys[pointers[f]]}" for f in order] + questions)
    lines, results = [], ""
    for k, chain in enumerate(chains):
        lines.append(questions[k])
        total = 0
        for left, fact in zip(range(len(chain), 0, -1), chain):
            value = values[fact]
            lines.append(f"{left} {keys[fact]} {value} {keys[pointers[fact]]} {total}+{value}={(total + value) % 10}")
            total = (total + value) % 10
        results += str(total)
        lines.append(f"a{count - k}={total} {results}")
    lines.append(f"answer {results}")
    return dict(statement=statement, solution="\n".join(lines), answer=results, num_steps=sum(hops))


def parse_statement(statement: str) -> tuple[list[tuple[str, int, str]], list[tuple[int, str, int]]]:
    """The facts (key, value, pointer) in the statement's order and the questions
    (number, start key, length) in theirs."""
    facts, questions = [], []
    for line in statement.split("\n"):
        if fact := FACT.match(line):
            facts.append((fact.group(1), int(fact.group(2)), fact.group(3)))
        elif question := QUESTION.match(line):
            questions.append((int(question.group(1)), question.group(2), int(question.group(3))))
        else:
            raise ValueError(f"not a fact or a question: {line!r}")
    return facts, questions


def num_facts(statement: str) -> int:
    """The number of facts of a statement (the knob of the prompt's length)."""
    return sum(1 for line in statement.split("\n") if FACT.match(line))


def needed_facts(statement: str) -> list[int]:
    """The fact lines (0-based, in the statement) that the solution reads, in the order it
    reads them: the chains of the questions, one after another."""
    facts, questions = parse_statement(statement)
    line_of = {key: i for i, (key, _, _) in enumerate(facts)}
    needed = []
    for _, key, length in questions:
        for _ in range(length):
            needed.append(line_of[key])
            key = facts[line_of[key]][2]
    return needed


def solve(statement: str) -> str:
    """The solution, re-derived from the statement's text alone (a checker for the writer
    of ``draw``: the tests compare the two)."""
    facts, questions = parse_statement(statement)
    table = {key: (value, pointer) for key, value, pointer in facts}
    lines, results = [], ""
    for number, key, length in questions:
        lines.append(f"q{number} {key} {length}")
        total = 0
        for left in range(length, 0, -1):
            value, pointer = table[key]
            lines.append(f"{left} {key} {value} {pointer} {total}+{value}={(total + value) % 10}")
            total, key = (total + value) % 10, pointer
        results += str(total)
        lines.append(f"a{number}={total} {results}")
    return "\n".join(lines + [f"answer {results}"])
