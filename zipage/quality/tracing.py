"""Seeded register-tracing problems with exact answers: the "tracing" task.

A problem statement gives the starting values of a few registers (single digits), a
short program of lettered instructions and a step count N; the worked solution
executes the program one instruction per line and restates every register in a state
line every few lines. An instruction either sets a register to the sum or difference
(modulo 10) of two registers, or jumps when a register is high (5 to 9). The problem
of seed 2 (``tasks.make_problem(2, "tracing")``):

    user:      a=5 b=8 c=8 d=2 e=7
               A c:e-c
               B b:d-c
               C a:d-b
               D if a high go G
               E d:b-c
               F e:c-e
               G if e high go F
               steps 29
    assistant: state a=5 b=8 c=8 d=2 e=7
               29 A c:e-c e=7 c=8 7-8=9 c=9
               28 B b:d-c d=2 c=9 2-9=3 b=3
               27 C a:d-b d=2 b=3 2-3=9 a=9
               26 D if a high go G a=9 high go G
               25 G if e high go F e=7 high go F
               state a=9 b=3 c=9 d=2 e=7
               24 F e:c-e c=9 e=7 9-7=2 e=2
               23 G if e high go F e=2 low go A
               ...
               2 B b:d-c d=0 c=9 0-9=1 b=1
               1 C a:d-b d=0 b=1 0-1=9 a=9
               state a=9 b=1 c=9 d=0 e=2
               answer 91902

Execution starts at instruction A; after the last instruction comes A again. A step
line names the instruction, copies it from the program and reads its operands
(``x=v``: register ``x`` holds ``v``). A set line then computes the result and writes
it (``c=9``); a jump line says whether the register is high or low and names the next
instruction after ``go``: the target when high, the instruction after the jump when
low. Step lines are numbered by the steps left, counting down from N (copied from the
statement) to 1, as in the ledger task. After every step line whose number is a
multiple of ``dump_every`` (5: the last digit is 0 or 5), and after line 1, a state
line restates every register; the answer is the final state's digits.

Why this shape. It differs from the ledger in where the facts live. The program is
read at every step, and which instruction comes next depends on the values (a jump
goes one way or the other), so any instruction may be needed at any time. The values,
on the other hand, change: a register's starting value in the statement goes stale at
its first write, and the latest state line with the step lines after it carries every
current value. A policy that keeps the program, the latest state line and the lines
since (under 250 tokens) can reproduce the solution at any length; the statement's
first line is needed once, for the solution's first line, and its step count once, for
the first step line. Old step lines and state lines hold only stale values.

Made to be learnable by a small model from scratch, by the ledger's rules: an
instruction is looked up by its label (a capital letter, rare) and copied into the
step line, so its operands sit at fixed places in the line being written; a value is
read after ``x=`` (``x`` a register's name), and every ``x=`` followed by a digit
states ``x``'s value at that point (assignments are written ``c:e-c``, so no letter
ever follows ``x=``), the latest one at most ``dump_every`` lines back; arithmetic is
one two-operand sum or difference at a time; when to write a state line and when to
stop are read off the line number just written. The jump tests a threshold, not the
parity: modulo 10 the parity of a sum or difference is fixed by its operands' parities,
so the registers' parities evolve on their own, often into a cycle in which a jump
always goes the same way. Shortcuts are designed out: the next line depends on register
values that the previous line does not show; every register is written somewhere in
the program (when it has at least as many set instructions as registers); a jump tests
a register written on the way from its target back to it (so a taken jump cannot loop
forever with the register unchanged); and a draw whose execution comes back to a state
it was in (same instruction and registers: its step lines would repeat from there on),
leaves an instruction unexecuted or has a jump that goes only one way is drawn again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

REGISTER_NAMES = "abcdef"
LABELS = "ABCDEFGHIJKL"  # instruction i is labelled LABELS[i]
HIGH = 5  # a jump is taken when its register is "high" (5 to 9), not when "low" (0 to 4)


@dataclass(frozen=True)
class TracingSpec:
    """How long the traces are and how the programs are drawn."""

    min_steps: int = 16  # about 740 tokens with the prompt
    max_steps: int = 48  # about 1,900 tokens (1,360 on average)
    dump_every: int = 5  # a state line after every step line numbered by a multiple of this
    num_registers: int = 5  # a, b, c, ...
    num_instructions: int = 7  # A, B, C, ...
    num_jumps: int = 2  # instructions that jump when a register is high (the others set a register)

    def __post_init__(self):
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.dump_every < 1:
            raise ValueError(f"dump_every must be >= 1, got {self.dump_every}")
        if not 2 <= self.num_registers <= len(REGISTER_NAMES):
            raise ValueError(f"num_registers must be in [2, {len(REGISTER_NAMES)}], got {self.num_registers}")
        if not 1 <= self.num_instructions <= len(LABELS):
            raise ValueError(f"num_instructions must be in [1, {len(LABELS)}], got {self.num_instructions}")
        most = max(0, self.num_instructions - 2)  # at least two set instructions when there is a jump
        if not 0 <= self.num_jumps <= most:
            raise ValueError(f"num_jumps must be in [0, {most}] for {self.num_instructions} instructions, "
                             f"got {self.num_jumps}")


# Named variants, registered with the ledger's in ``tasks.SPECS``.
SPECS = {
    "tracing": TracingSpec(),
    "tracing-short": TracingSpec(min_steps=6, max_steps=14, num_registers=4, num_instructions=5,
                                 num_jumps=1),
    "tracing-tiny": TracingSpec(min_steps=3, max_steps=6, dump_every=2, num_registers=3, num_instructions=3,
                                num_jumps=0),
}


def _draw_program(rng: random.Random, spec: TracingSpec) -> list[tuple]:
    """Instructions as ``("set", dst, x, op, y)`` or ``("jump", register, target)``.

    A set instruction reads two different registers; every register is written by some
    set instruction when there are enough of them. A jump goes neither to itself nor to
    the instruction after it (where it goes anyway when not taken), and tests a register
    that some set instruction from its target round to the jump writes: otherwise a
    taken jump would loop back to itself with the register unchanged, forever.
    """
    n, count = spec.num_registers, spec.num_instructions
    jumps = sorted(rng.sample(range(count), spec.num_jumps))
    num_sets = count - len(jumps)
    destinations = (rng.sample(range(n), n) + [rng.randrange(n) for _ in range(num_sets)])[:num_sets]
    rng.shuffle(destinations)
    program: list[tuple] = []
    for i in range(count):
        if i in jumps:
            program.append(("jump", None, None))  # filled in below, once every set is drawn
        else:
            x, y = rng.sample(range(n), 2)
            program.append(("set", destinations.pop(), x, rng.choice("+-"), y))
    for i in jumps:
        choices = []
        for target in range(count):
            if target in (i, (i + 1) % count):
                continue
            body = [program[k % count] for k in range(target, i if i > target else i + count)]
            choices += [(register, target) for register in {ins[1] for ins in body if ins[0] == "set"}]
        register, target = rng.choice(sorted(choices))
        program[i] = ("jump", register, target)
    return program


def instruction_text(instruction: tuple) -> str:
    """``c:a+e`` or ``if c high go F``, as the statement and the step lines write it."""
    if instruction[0] == "jump":
        _, register, target = instruction
        return f"if {REGISTER_NAMES[register]} high go {LABELS[target]}"
    _, dst, x, op, y = instruction
    return f"{REGISTER_NAMES[dst]}:{REGISTER_NAMES[x]}{op}{REGISTER_NAMES[y]}"


def _state_line(names: str, registers: list[int]) -> str:
    return "state " + " ".join(f"{name}={v}" for name, v in zip(names, registers))


def draw(rng: random.Random, spec: TracingSpec) -> dict | None:
    """One draw: the fields of a ``tasks.Problem`` (statement, solution, answer, num_steps),
    or None when the draw is rejected (see the module's docstring)."""
    names = REGISTER_NAMES[:spec.num_registers]
    registers = [rng.randrange(10) for _ in names]
    program = _draw_program(rng, spec)
    num_steps = rng.randint(spec.min_steps, spec.max_steps)
    statement = "\n".join([" ".join(f"{name}={v}" for name, v in zip(names, registers))]
                          + [f"{LABELS[i]} {instruction_text(ins)}" for i, ins in enumerate(program)]
                          + [f"steps {num_steps}"])
    lines = [_state_line(names, registers)]
    seen, executed, jumped = set(), set(), {}  # jumped: instruction -> the ways it went
    at = 0
    for left in range(num_steps, 0, -1):  # steps left, this one included: the line's number
        state = (at, tuple(registers))
        if state in seen:
            return None  # the step lines would repeat themselves from here on
        seen.add(state)
        executed.add(at)
        instruction = program[at]
        head = f"{left} {LABELS[at]} {instruction_text(instruction)}"
        if instruction[0] == "jump":
            _, register, target = instruction
            value = registers[register]
            high = value >= HIGH
            jumped.setdefault(at, set()).add(high)
            following = target if high else (at + 1) % len(program)
            lines.append(f"{head} {names[register]}={value} {'high' if high else 'low'} go {LABELS[following]}")
        else:
            _, dst, x, op, y = instruction
            u, v = registers[x], registers[y]
            result = (u + v) % 10 if op == "+" else (u - v) % 10
            registers[dst] = result
            lines.append(f"{head} {names[x]}={u} {names[y]}={v} {u}{op}{v}={result} {names[dst]}={result}")
            following = (at + 1) % len(program)
        if left % spec.dump_every == 0 or left == 1:
            lines.append(_state_line(names, registers))
        at = following
    if len(executed) < len(program) or any(len(ways) < 2 for ways in jumped.values()):
        return None  # every instruction runs, and every jump goes both ways
    answer = "".join(str(v) for v in registers)
    lines.append(f"answer {answer}")
    return dict(statement=statement, solution="\n".join(lines), answer=answer, num_steps=num_steps)
