"""Train a small Qwen3 model on a synthetic task and save a HuggingFace checkpoint.

    python -m zipage.quality.train --out checkpoints/ledger-14m --max-minutes 11.5
    python -m zipage.quality.train --task tracing --out checkpoints/tracing-14m --max-minutes 6.25
    python -m zipage.quality.train --task retrieval --out checkpoints/retrieval-14m --max-minutes 9.2 --eval-reserve-s 60
    zipage train-synthetic --out DIR --tiny        # CPU smoke run, well under a minute

``--task`` names a variant of ``tasks.SPECS``: the ledger ("standard", the default),
register tracing ("tracing") or retrieval over many facts ("retrieval", long prompts:
``zipage.quality.retrieval``); ``--tiny`` trains on the CI-sized variant of the task given.

The model is ``transformers.Qwen3ForCausalLM`` (preset ``small``: 8 layers, hidden
384, 6 query heads and 2 KV heads of 64, 13.8M parameters) over the character
tokenizer of ``zipage.quality.tokenizer``. Problems are generated on the fly by
worker processes, so no example repeats; the loss counts the solution tokens only.
``--curriculum`` makes them grow from a small variant of the task to the task's own
over the first part of the training (``Curriculum``); by default the retrieval task's
do, from "retrieval-tiny" over the first half of the training after the warmup, and
the ledger's and tracing's do not.

Sizing for one GPU run of at most 15 minutes (an H200)
-----------------------------------------------------
Work per token: 6 * 13.8M = 83 MFLOP for the weights plus about 40 MFLOP for causal
attention over ~1,950 tokens (8 layers, width 384, forward and backward), so about
125 MFLOP. At hidden size 384 the matmuls are small and a step is dominated by the
memory-bound elementwise kernels of the eager model (norms, rotary, activations).
The estimate was ~75 ms per step of 65,536 padded tokens (~0.9M tokens/s); the first
H200 run (2026-11-30, eager, bf16) measured about 87 ms per step once warm, and
719K tokens/s over its whole training (2,250 steps, 141M tokens in 196 s), its first
steps being about twice as slow. At that speed a minute of training sees ~43M
tokens (~690 steps), so the ~400 s that ``--max-minutes 9.3`` leaves for training
would see ~290M (an extrapolation, not yet run). The batch is kept that small on purpose:
at a fixed token budget this kind of task gains more from optimizer steps than from
larger batches (a 0.8M model on the CPU learns its lookups in sudden drops of the
loss, each after some hundreds of steps), and 64K tokens still fill the GPU's
matmuls. Activation memory
of the eager model is about 25 KB per token and layer, ~13 GB for the batch, far
below the card's 139 GB. Data generation costs well under a millisecond of Python
per problem (redrawn ones included), so the worker processes (up to 6) keep ahead
of the ~350 problems per second the GPU consumes.

How it runs: one problem per row (every row starts at position 0, as at inference),
rows sorted by length within a pool and right-padded to a multiple of 64 tokens, so
flash attention runs with a plain causal mask and padding costs a few percent; bf16
autocast on CUDA (float32 on the CPU), fused AdamW, linear warmup then cosine decay.
Without ``--steps`` the schedule is driven by time (``Schedule``): after the warmup
steps the cosine's progress is the share of the training time elapsed, so it reaches
its floor when the time budget (``--max-minutes`` less the evaluation reserve) is
spent, whatever the speed does meanwhile. (Fixing the step count from the speed of
the first steps stopped the first GPU run after 196 s of a ~400 s budget: its first
steps were twice as slow as the rest.) ``--steps N`` counts steps instead and makes a
run repeatable; ``training.json`` records which schedule ran. The checkpoint is
saved before the held-out evaluation starts. The
seed fixes the initial weights and the problems (given the number of workers).
``--compile`` wraps the model in ``torch.compile`` (dynamic shapes); it is off by
default because it has not been tried on the GPU yet.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np
import torch
import torch.nn.functional as F

from zipage.quality import tasks
from zipage.quality.tokenizer import CharCodec, VOCAB, save_tokenizer

MODEL_SIZES = {
    "small": dict(hidden_size=384, intermediate_size=1152, num_hidden_layers=8, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=64),  # 13.8M parameters
    "mini": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),  # 0.8M, for CPU checks
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),  # CI
}
PAD_MULTIPLE = 64
IGNORE = -100


DEFAULT_LR = 1.5e-3
# Task family -> its peak learning rate, where the default does not suit it. Retrieval: with
# 1.5e-3 the lookup of a fact by its key never formed (an H200 run of the small model, and
# 20 CPU minutes of the mini one on the 12-fact variant, where it began only once the decay
# had brought the rate near 5e-4); at 5e-4 the mini model looked pointers up by step 700, and
# values too after more steps (100 of 100 tiny problems exact; docs/quality.md).
TASK_LR = {"retrieval": 5e-4}


@dataclass
class TrainConfig:
    out: str
    model_size: str = "small"
    task: str = "standard"
    seed: int = 0
    max_minutes: float = 11.5  # wall clock for the whole command, evaluation included
    steps: int | None = None  # None: as many as the time budget allows (time-based schedule)
    batch_tokens: int = 65536  # padded tokens per optimizer step
    lr: float | None = None  # peak learning rate; None: the task family's (TASK_LR)
    min_lr_ratio: float = 0.05
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    device: str | None = None
    compile: bool = False
    workers: int | None = None  # data worker processes (None: up to 6; 0: in this process)
    eval_problems: int = 200  # held-out problems decoded greedily at the end (0: none)
    eval_reserve_s: float = 150.0  # seconds of the budget kept for saving and evaluation
    log_every: int = 10
    max_position_embeddings: int = 4096
    init_from: str | None = None  # start from this checkpoint's weights (its shape wins over model_size)
    curriculum: str | None = "auto"  # the variant the problems grow from ("auto": AUTO_CURRICULA; None: none)
    curriculum_ramp: float = 0.5  # share of the training after the warmup over which they grow to the task's
    curriculum_mix: float = 0.2  # share of the problems drawn from the start variant throughout
    command: str = field(default="", repr=False)

    def __post_init__(self):
        if self.model_size not in MODEL_SIZES:
            raise ValueError(f"model_size must be one of {sorted(MODEL_SIZES)}, got {self.model_size!r}")
        tasks.get_spec(self.task)
        if self.lr is None:
            self.lr = TASK_LR.get(tasks.family(self.task), DEFAULT_LR)
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be in (0, 1), got {self.lr}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.max_minutes <= 0:
            raise ValueError(f"max_minutes must be > 0, got {self.max_minutes}")
        if self.batch_tokens < PAD_MULTIPLE:
            raise ValueError(f"batch_tokens must be >= {PAD_MULTIPLE}, got {self.batch_tokens}")
        curriculum_of(self)  # checks the curriculum's variant, ramp and mix


def tiny_config(out: str, task: str = "standard") -> TrainConfig:
    """The CPU smoke run: a 2-layer model on 3-6 step problems of ``task``'s kind, about 20 seconds."""
    return TrainConfig(out=out, model_size="tiny", task=tasks.tiny_variant(task), steps=80, batch_tokens=4096,
                       lr=3e-3, warmup_steps=10, device="cpu", workers=0, eval_problems=8, eval_reserve_s=20.0,
                       max_minutes=1.0, log_every=5, max_position_embeddings=512)


# -- curriculum -------------------------------------------------------------------
AUTO_CURRICULA = {"retrieval": "retrieval-tiny"}  # task family -> the variant its problems grow from


@dataclass(frozen=True)
class Curriculum:
    """Problems that grow from a small variant of the task to the task's own.

    Why: a lookup by content among many lines is learnt late or not at all when every
    problem is long. Trained on the standard retrieval variant alone (120 to 240 facts,
    3,056 steps on an H200), the 13.8M model learnt every part of the solution that reads
    the lines just above (the line numbers, the key copied from the previous line's
    pointer, the sums, the result and answer lines: all at a loss of 0.000), but the
    values and pointers it copies from the facts and the start keys it copies from the
    questions stayed at chance (2.30 nats a digit, 3.26 a letter: ln 10 and ln 26), and
    those tokens made up the whole plateau loss of 0.51. Among a dozen lines a head that
    attends by content gets a useful gradient from its first, nearly uniform attention (a
    twelfth of it on the right line, not a two-hundredth), so lookup (induction) heads
    form far sooner on short contexts; once formed, a head that matches the key finds it
    among more lines too, as long as the match is sharp enough, which the growing
    problems train.

    At a training progress ``p`` (the share of the training after the warmup that is
    done, in steps or in time as the learning rate's decay counts it; 0 during the
    warmup, which so trains on the start variant alone) a problem is drawn from the spec
    between ``start`` and the task's variant at ``min(1, p / ramp)`` of the way, field by
    field: the integer fields (counts and lengths: facts, questions, hops) geometrically,
    so each doubling of the prompt gets the same share of the ramp, the others linearly.
    After the ramp the problems are the task's own, except that a share ``mix`` of them
    is drawn from ``start`` throughout, which keeps short lookups in the training
    cheaply (a retrieval-tiny problem has an eighth of a standard one's tokens, so a
    fifth of the problems is about 3% of the tokens). The held-out evaluation is on the
    task's variant whatever the curriculum.
    """

    start: str  # a variant of tasks.SPECS of the same family as the task
    ramp: float = 0.5
    mix: float = 0.2

    def __post_init__(self):
        tasks.get_spec(self.start)
        if not 0.0 <= self.ramp <= 1.0:
            raise ValueError(f"curriculum ramp must be in [0, 1], got {self.ramp}")
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"curriculum mix must be in [0, 1], got {self.mix}")

    def check(self, target: tasks.AnySpec) -> None:
        """Raises ValueError unless every spec on the way from ``start`` to ``target`` is valid."""
        start = tasks.get_spec(self.start)
        if type(start) is not type(target):
            raise ValueError(f"curriculum start {self.start!r} is not a variant of the task's family "
                             f"({tasks.family(target)})")
        for i in range(65):
            try:
                self.spec_at(target, i / 64 * self.ramp)
            except ValueError as error:
                raise ValueError(f"the curriculum from {self.start!r} passes through an invalid spec "
                                 f"{i / 64:.0%} of the way: {error}") from None

    def spec_at(self, target: tasks.AnySpec, progress: float) -> tasks.AnySpec:
        """The spec of the problems drawn at ``progress`` (the mixed-in share aside)."""
        start = tasks.get_spec(self.start)
        way = 1.0 if self.ramp <= 0 else min(1.0, max(0.0, progress / self.ramp))
        if way >= 1.0 or start == target:
            return target
        if way <= 0.0:
            return start
        return replace(target, **{f.name: _between(getattr(start, f.name), getattr(target, f.name), way)
                                  for f in fields(target)})

    def draw_spec(self, rng: random.Random, target: tasks.AnySpec, progress: float) -> tasks.AnySpec:
        """The spec of one problem: the start variant's with probability ``mix``, else ``spec_at``'s."""
        if self.mix > 0 and rng.random() < self.mix:
            return tasks.get_spec(self.start)
        return self.spec_at(target, progress)

    def describe(self, target: tasks.AnySpec) -> dict:
        return dict(start=self.start, ramp=self.ramp, mix=self.mix, start_spec=asdict(tasks.get_spec(self.start)),
                    target_spec=asdict(target))


def _between(a, b, way: float):
    if isinstance(a, bool) or a == b:
        return a
    if isinstance(a, int) and isinstance(b, int):
        return round(a * (b / a) ** way) if a > 0 and b > 0 else round(a + (b - a) * way)
    return a + (b - a) * way


def curriculum_of(config: TrainConfig) -> Curriculum | None:
    """The run's curriculum: ``config.curriculum`` names its start variant; "auto" is the
    task family's entry of ``AUTO_CURRICULA`` (none for the ledger and tracing, and none
    when the task is that variant itself, as the ``--tiny`` runs are)."""
    name = config.curriculum
    if name == "auto":
        name = AUTO_CURRICULA.get(tasks.family(config.task))
        if name == config.task:
            name = None
    if name is None or name == "none":
        return None
    curriculum = Curriculum(name, config.curriculum_ramp, config.curriculum_mix)
    curriculum.check(tasks.get_spec(config.task))
    return curriculum


# -- data -----------------------------------------------------------------------
def encode_problem(codec: CharCodec, problem: tasks.Problem) -> tuple[np.ndarray, int]:
    return codec.encode_chat(tasks.messages(problem), problem.solution)


def batches_from(rng: random.Random, spec: tasks.AnySpec, batch_tokens: int, pool_batches: int = 8,
                 curriculum: Curriculum | None = None, progress: Callable[[int], float] | None = None):
    """Endless padded batches ``(input_ids int64 [B, T], labels int64 [B, T])``.

    A pool of problems is sorted by length and cut into batches of at most
    ``batch_tokens`` padded tokens, which are then yielded in random order. With a
    curriculum, the problems of a pool are drawn from its specs on the way to ``spec``
    at the training's progress when the pool is drawn: ``progress(n)``, n the number of
    batches this stream has yielded so far (0 when not given).
    """
    codec = CharCodec()
    yielded = 0
    while True:
        pool, total = [], 0
        at = 0.0 if progress is None else progress(yielded)
        while total < pool_batches * batch_tokens:
            problem_spec = spec if curriculum is None else curriculum.draw_spec(rng, spec, at)
            ids, prompt_len = encode_problem(codec, tasks.make_problem(tasks.training_seed(rng), problem_spec))
            pool.append((ids, prompt_len))
            total += len(ids)
        pool.sort(key=lambda item: len(item[0]))
        batches, start = [], 0
        while start < len(pool):
            stop = start + 1
            while stop < len(pool) and (stop + 1 - start) * _padded(len(pool[stop][0])) <= batch_tokens:
                stop += 1
            batches.append(pool[start:stop])
            start = stop
        rng.shuffle(batches)
        for rows in batches:
            yield _collate(rows)
            yielded += 1


def _padded(n: int) -> int:
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def _collate(rows) -> tuple[torch.Tensor, torch.Tensor]:
    width = _padded(max(len(ids) for ids, _ in rows))
    inputs = torch.zeros(len(rows), width, dtype=torch.int64)  # 0 is <|endoftext|>, the padding
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.int64)
    for i, (ids, prompt_len) in enumerate(rows):
        row = torch.from_numpy(ids.astype(np.int64))
        inputs[i, :len(row)] = row
        labels[i, prompt_len:len(row)] = row[prompt_len:]  # the solution and its closing <|im_end|>
    return inputs, labels


class _Stream(torch.utils.data.IterableDataset):
    """The batches of one worker (or of the training process itself, without workers).

    A curriculum needs the training's progress on the workers' side. With ``total_steps``
    it is counted: batch n of worker w of W is the training's step n * W + w (the data
    loader takes the workers' batches in turn), so the problems are the same whatever the
    machine's speed. Under the time-based schedule the training loop writes it to
    ``shared_progress`` (a shared tensor), which a worker reads when it draws a pool: the
    problems' seeds are the same, their specs follow the clock as the learning rate does
    (running some batches ahead of the step that takes them: the pool and the loader's
    prefetch)."""

    def __init__(self, seed: int, spec: tasks.AnySpec, batch_tokens: int, curriculum: Curriculum | None = None,
                 total_steps: int | None = None, warmup_steps: int = 0, shared_progress: torch.Tensor | None = None):
        self.seed, self.spec, self.batch_tokens = seed, spec, batch_tokens
        self.curriculum, self.total_steps, self.warmup_steps = curriculum, total_steps, warmup_steps
        self.shared_progress = shared_progress

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rng = random.Random(f"{self.seed}-{worker}")
        if self.curriculum is None:
            return batches_from(rng, self.spec, self.batch_tokens)
        progress = None  # no schedule to follow: the curriculum's start
        if self.total_steps is not None:
            def progress(n: int) -> float:
                return counted_progress(n * workers + worker, self.total_steps, self.warmup_steps)
        elif self.shared_progress is not None:
            def progress(n: int) -> float:
                return float(self.shared_progress[0])
        return batches_from(rng, self.spec, self.batch_tokens, curriculum=self.curriculum, progress=progress)


def data_loader(config: TrainConfig, workers: int, shared_progress: torch.Tensor | None = None):
    """The training batches; ``shared_progress`` carries the time-based schedule's progress
    to a curriculum (see ``_Stream``)."""
    stream = _Stream(config.seed, tasks.get_spec(config.task), config.batch_tokens, curriculum_of(config),
                     config.steps, config.warmup_steps, shared_progress)
    if workers == 0:
        return iter(stream)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers, prefetch_factor=4,
                                         pin_memory=torch.cuda.is_available(), persistent_workers=True)
    return iter(loader)


# -- model and optimiser -------------------------------------------------------------
def build_model(config: TrainConfig):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if config.init_from is not None:  # continue training a checkpoint (master weights in float32)
        return Qwen3ForCausalLM.from_pretrained(config.init_from, dtype=torch.float32).to(torch.float32)
    hf = Qwen3Config(vocab_size=len(VOCAB), max_position_embeddings=config.max_position_embeddings,
                     tie_word_embeddings=True, rms_norm_eps=1e-6, eos_token_id=VOCAB.index("<|im_end|>"),
                     pad_token_id=0, bos_token_id=None, **MODEL_SIZES[config.model_size])
    hf.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(config.seed)
    return Qwen3ForCausalLM(hf)


def make_optimizer(model, config: TrainConfig, fused: bool):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def learning_rate(config: TrainConfig, step: int, total: int | None = None, progress: float | None = None) -> float:
    """Linear warmup over ``warmup_steps``, then cosine down to ``min_lr_ratio * lr``.

    The decay's progress (0 at the end of the warmup, 1 at the floor) is either counted in
    steps towards ``total`` or given as ``progress`` (the time-based schedule)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if progress is None:
        progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
    progress = min(1.0, max(0.0, progress))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Schedule:
    """The learning rate of each step and when training ends.

    With ``steps`` set the schedule counts steps (repeatable: the same steps see the same
    rates whatever the machine's speed). Without it, it is driven by time: the warmup
    still counts steps, then the cosine's progress is the share of the time left at the
    end of the warmup that has passed, so the floor is reached when the training time
    is up, however the speed changes along the way (compilation, a slow start)."""

    def __init__(self, config: TrainConfig, start: float, deadline: float):
        self.config, self.start, self.deadline = config, start, deadline
        self.total = config.steps
        self.decay_start: float | None = None  # when the warmup ended (time-based schedule)

    def finished(self, step: int, now: float) -> bool:
        return (self.total is not None and step >= self.total) or now > self.deadline

    def progress(self, step: int, now: float) -> float | None:
        """The time-based decay's progress at ``now`` (None for a step-counted schedule)."""
        if self.total is not None or step < self.config.warmup_steps:
            return None
        if self.decay_start is None:
            self.decay_start = now
        return (now - self.decay_start) / max(1e-9, self.deadline - self.decay_start)

    def rate(self, step: int, now: float) -> float:
        return learning_rate(self.config, step, self.total, self.progress(step, now))

    def done(self, step: int, now: float) -> float:
        """A curriculum's progress: the share of the training after the warmup that is done,
        steps counted (``counted_progress``) or time elapsed; 0 during the warmup."""
        if self.total is not None:
            return counted_progress(step, self.total, self.config.warmup_steps)
        if step < self.config.warmup_steps or self.decay_start is None:
            return 0.0
        return min(1.0, (now - self.decay_start) / max(1e-9, self.deadline - self.decay_start))

    def describe(self) -> dict:
        if self.total is not None:
            return dict(kind="steps", total_steps=self.total, warmup_steps=self.config.warmup_steps)
        decay_start = None if self.decay_start is None else round(self.decay_start - self.start, 1)
        return dict(kind="time", warmup_steps=self.config.warmup_steps,
                    train_budget_s=round(self.deadline - self.start, 1), decay_start_s=decay_start)


def counted_progress(step: int, total: int, warmup_steps: int) -> float:
    """The share of the steps after the warmup taken before ``step`` (0 during the warmup)."""
    return min(1.0, max(0.0, (step - warmup_steps) / max(1, total - warmup_steps)))


def loss_of(model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=inputs).logits  # no attention mask: causal, padding only at the end
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE)


# -- the run ---------------------------------------------------------------------
def train(config: TrainConfig) -> dict:
    """Train, save the checkpoint (and tokenizer, log, loss curve) to ``config.out``, then
    evaluate on held-out problems. Returns the run's record (also ``training.json``)."""
    started = time.perf_counter()
    deadline = started + config.max_minutes * 60
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    workers = config.workers if config.workers is not None else min(6, max(1, (os.cpu_count() or 2) - 2))
    os.makedirs(config.out, exist_ok=True)

    model = build_model(config).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    forward = torch.compile(model, dynamic=True) if config.compile else model
    optimizer = make_optimizer(model, config, fused=on_cuda)
    curriculum = curriculum_of(config)
    shared_progress = torch.zeros(1).share_memory_() if curriculum is not None and config.steps is None else None
    batches = data_loader(config, workers, shared_progress)
    origin = f"from {config.init_from}" if config.init_from else config.model_size
    grows = "" if curriculum is None else (f", growing from {curriculum.start} over {curriculum.ramp:.0%} of the "
                                           f"training ({curriculum.mix:.0%} of the problems from it throughout)")
    print(f"model {origin}: {num_params / 1e6:.2f}M parameters on {device}; task {config.task}{grows}; "
          f"{workers} data workers", flush=True)

    train_deadline = deadline - (config.eval_reserve_s if config.eval_problems else 20.0)
    log, step, tokens, loss_tokens = [], 0, 0, 0
    running, running_steps = torch.zeros((), device=device), 0  # summed on the device: no sync per step
    loop_start = time.perf_counter()
    schedule = Schedule(config, loop_start, train_deadline)
    while True:
        now = time.perf_counter()
        if schedule.finished(step, now):
            if schedule.total is None or step < schedule.total:
                print(f"time budget reached at step {step}", flush=True)
            break
        if shared_progress is not None:
            shared_progress[0] = schedule.done(step, now)
        inputs, labels = next(batches)
        loss_tokens += int((labels != IGNORE).sum())  # on the host, before the copy
        inputs = inputs.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        lr = schedule.rate(step, now)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_cuda):
            loss = loss_of(forward, inputs, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        step += 1
        tokens += inputs.numel()
        running += loss.detach()
        running_steps += 1
        if step % config.log_every == 0:
            mean_loss = running.item() / running_steps  # since the last entry; syncs, so finished steps are timed
            elapsed = time.perf_counter() - loop_start
            entry = dict(step=step, tokens=tokens, seconds=round(elapsed, 2), loss=round(mean_loss, 5), lr=lr)
            grown = ""
            if curriculum is not None:  # the loss is over longer problems as the curriculum goes
                entry["curriculum"] = round(min(1.0, schedule.done(step, now) / max(curriculum.ramp, 1e-9)), 3)
                grown = f" curriculum {entry['curriculum']:.2f}"
            running.zero_()
            running_steps = 0
            log.append(entry)
            print(f"step {step}/{schedule.total or '?'} loss {entry['loss']:.4f} lr {lr:.2e}{grown} "
                  f"{tokens / elapsed / 1000:.0f}K tokens/s", flush=True)
    if on_cuda:
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - loop_start

    record = dict(config={k: v for k, v in asdict(config).items()}, num_parameters=num_params,
                  device=str(device), torch=torch.__version__, workers=workers,
                  schedule=schedule.describe(), steps=step,
                  curriculum=None if curriculum is None else curriculum.describe(tasks.get_spec(config.task)),
                  tokens=tokens, loss_tokens=loss_tokens, train_seconds=round(train_seconds, 1),
                  tokens_per_second=round(tokens / max(train_seconds, 1e-9)),
                  final_loss=log[-1]["loss"] if log else None, loss_curve=log)
    save_checkpoint(model, config.out)
    _write_record(config.out, record)
    plot_loss(log, os.path.join(config.out, "loss_curve.png"))
    print(f"saved the checkpoint to {config.out} after {step} steps ({tokens / 1e6:.1f}M tokens, "
          f"{train_seconds:.0f} s)", flush=True)

    if config.eval_problems:
        del optimizer, forward, batches
        model.to("cpu")
        if on_cuda:
            torch.cuda.empty_cache()
        from zipage.quality.eval import evaluate_full_kv
        result = evaluate_full_kv(config.out, tasks.held_out_problems(config.eval_problems, config.task),
                                  device=str(device))
        record["held_out"] = result
        _write_record(config.out, record)
        print(f"held-out greedy accuracy {result['accuracy']:.3f}, correct-prefix fraction "
              f"{result['prefix_fraction']:.3f} on {config.eval_problems} problems", flush=True)
    record["total_seconds"] = round(time.perf_counter() - started, 1)
    _write_record(config.out, record)
    return record


def save_checkpoint(model, out: str) -> None:
    """bf16 safetensors (13.8M parameters: 28 MB), config, generation config and tokenizer."""
    from transformers import GenerationConfig

    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)  # records the dtype
    model.to(torch.float32)
    eos = VOCAB.index("<|im_end|>")
    GenerationConfig(eos_token_id=eos, pad_token_id=0, bos_token_id=None).save_pretrained(out)
    save_tokenizer(out)


def _write_record(out: str, record: dict) -> None:
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(record, f, indent=1)


def plot_loss(log: list[dict], path: str) -> bool:
    """The loss curve as a PNG; False (and no file) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not log:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([e["tokens"] / 1e6 for e in log], [e["loss"] for e in log])
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("loss (nats per solution token)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- command line -----------------------------------------------------------------
def add_train_parser(sub) -> None:
    p = sub.add_parser("train-synthetic", help="train the small reasoning model on the synthetic task")
    add_train_args(p)
    p.set_defaults(func=_run, from_module=False)


def add_train_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig(out="")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke run (tiny model, the tiny variant of --task's task, ~20 s)")
    p.add_argument("--model-size", default=d.model_size, choices=sorted(MODEL_SIZES))
    p.add_argument("--task", default=d.task, choices=sorted(tasks.SPECS),
                   help="task variant: the ledger (standard, short, tiny), register tracing (tracing, ...) "
                        "or retrieval over many facts (retrieval, ...)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-minutes", type=float, default=d.max_minutes,
                   help="wall-clock budget of the whole command, evaluation included")
    p.add_argument("--steps", type=int, default=None, help="fixed number of optimizer steps")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens)
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default {DEFAULT_LR:g}; "
                        + ", ".join(f"{lr:g} for {family}" for family, lr in TASK_LR.items()) + ")")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--device", default=None)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (untested on a GPU)")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--eval-problems", type=int, default=d.eval_problems)
    p.add_argument("--eval-reserve-s", type=float, default=d.eval_reserve_s)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--init-from", default=None, help="start from this checkpoint's weights")
    p.add_argument("--curriculum", default=d.curriculum,
                   help="the variant the training problems grow from to --task's (auto: retrieval-tiny for the "
                        "retrieval tasks, none for the others; none: the task's problems from the start)")
    p.add_argument("--curriculum-ramp", type=float, default=d.curriculum_ramp,
                   help="share of the training after the warmup (steps, or time) over which the problems grow "
                        "to the task's")
    p.add_argument("--curriculum-mix", type=float, default=d.curriculum_mix,
                   help="share of the problems drawn from the curriculum's start variant throughout")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    command = " ".join(["python -m zipage.quality.train"] + sys.argv[1:]) if args.from_module else " ".join(
        ["zipage"] + sys.argv[1:])
    if args.tiny:
        config = tiny_config(args.out, args.task)
        config.command = command
        return config
    return TrainConfig(out=args.out, model_size=args.model_size, task=args.task, seed=args.seed,
                       max_minutes=args.max_minutes, steps=args.steps, batch_tokens=args.batch_tokens,
                       lr=args.lr, warmup_steps=args.warmup_steps, device=args.device, compile=args.compile,
                       workers=args.workers, eval_problems=args.eval_problems,
                       eval_reserve_s=args.eval_reserve_s, log_every=args.log_every, init_from=args.init_from,
                       curriculum=None if args.curriculum == "none" else args.curriculum,
                       curriculum_ramp=args.curriculum_ramp, curriculum_mix=args.curriculum_mix, command=command)


def _run(args: argparse.Namespace) -> int:
    train(config_from_args(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zipage.quality.train", description=__doc__.split("\n")[0])
    add_train_args(parser)
    parser.set_defaults(from_module=True)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
