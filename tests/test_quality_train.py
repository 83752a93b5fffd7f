"""Training the synthetic-task model: schedule, batches, and the CPU smoke run whose
checkpoint both transformers and the engine load."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random

import pytest
import torch

from zipage.quality import retrieval, tasks, train
from zipage.quality.tokenizer import VOCAB


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    config = train.TrainConfig(out="", lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    rates = [train.learning_rate(config, step, 110) for step in range(111)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))
    assert rates[60] == pytest.approx(0.55e-3) and rates[110] == pytest.approx(1e-4)
    assert train.learning_rate(config, 60, progress=0.5) == pytest.approx(0.55e-3)  # the time-based form
    assert train.learning_rate(config, 60, progress=1.5) == pytest.approx(1e-4)


def test_step_schedule_counts_steps_whatever_the_clock():
    config = train.TrainConfig(out="", lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, steps=110)
    schedule = train.Schedule(config, start=0.0, deadline=100.0)
    assert schedule.rate(60, now=1.0) == schedule.rate(60, now=99.0) == pytest.approx(0.55e-3)
    assert not schedule.finished(109, now=50.0) and schedule.finished(110, now=50.0)
    assert schedule.finished(5, now=100.5)  # the time budget still stops it
    assert schedule.describe() == dict(kind="steps", total_steps=110, warmup_steps=10)


def test_time_schedule_decays_over_the_time_left_after_the_warmup():
    """A slow start (here the warmup takes 20 s of a 100 s budget) only shortens the decay:
    the cosine runs from the end of the warmup to the deadline, whatever the step rate."""
    config = train.TrainConfig(out="", lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    schedule = train.Schedule(config, start=0.0, deadline=100.0)
    assert schedule.rate(0, now=0.0) == pytest.approx(1e-4) and schedule.rate(9, now=19.0) == pytest.approx(1e-3)
    assert schedule.describe()["decay_start_s"] is None
    assert schedule.rate(10, now=20.0) == pytest.approx(1e-3)  # the decay starts here
    assert schedule.rate(11, now=60.0) == pytest.approx(0.55e-3)  # half of the 80 s left
    assert schedule.rate(5000, now=60.0) == pytest.approx(0.55e-3)  # the step count does not matter
    assert schedule.rate(12, now=100.0) == pytest.approx(1e-4) and schedule.rate(13, now=150.0) == pytest.approx(1e-4)
    assert not schedule.finished(10 ** 6, now=99.0) and schedule.finished(3, now=100.5)
    assert schedule.describe() == dict(kind="time", warmup_steps=10, train_budget_s=100.0, decay_start_s=20.0)


def test_batches_are_padded_and_only_solutions_count():
    batches = train.batches_from(random.Random(0), tasks.get_spec("tiny"), batch_tokens=1024)
    eos = VOCAB.index("<|im_end|>")
    for _ in range(6):
        inputs, labels = next(batches)
        rows, width = inputs.shape
        assert width % train.PAD_MULTIPLE == 0 and (rows * width <= 1024 or rows == 1)
        for row, label in zip(inputs, labels):
            counted = (label != train.IGNORE).nonzero().flatten()
            start, stop = int(counted[0]), int(counted[-1]) + 1
            assert (label[start:stop] == row[start:stop]).all() and len(counted) == stop - start
            assert int(row[stop - 1]) == eos and (row[stop:] == 0).all()
            text = "".join(VOCAB[i] for i in row[:start].tolist())
            assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")


def test_config_checks_its_values():
    with pytest.raises(ValueError, match="model_size"):
        train.TrainConfig(out="x", model_size="huge")
    with pytest.raises(ValueError, match="unknown task spec"):
        train.TrainConfig(out="x", task="nope")
    with pytest.raises(ValueError, match=r"lr must be in \(0, 1\), got 0"):
        train.TrainConfig(out="x", lr=0)


def test_learning_rate_defaults_by_task_family():
    assert train.TrainConfig(out="x").lr == train.DEFAULT_LR == 1.5e-3
    assert train.TrainConfig(out="x", task="tracing").lr == train.DEFAULT_LR
    for task in ("retrieval", "retrieval-short", "retrieval-tiny"):
        assert train.TrainConfig(out="x", task=task).lr == 5e-4
    assert train.TrainConfig(out="x", task="retrieval", lr=1e-3).lr == 1e-3
    parser = argparse.ArgumentParser()
    train.add_train_args(parser)
    parser.set_defaults(from_module=True)
    assert train.config_from_args(parser.parse_args(["--out", "x", "--task", "retrieval"])).lr == 5e-4
    assert train.config_from_args(parser.parse_args(["--out", "x", "--lr", "2e-3"])).lr == 2e-3


def _fact_counts(inputs: torch.Tensor) -> list[int]:
    """The number of facts of each retrieval problem of a batch (read off its user turn)."""
    counts = []
    for row in inputs.tolist():
        text = "".join(VOCAB[i] for i in row)
        counts.append(retrieval.num_facts(text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]))
    return counts


def test_curriculum_grows_the_facts_from_the_tiny_variant_to_the_task():
    curriculum = train.curriculum_of(train.TrainConfig(out="", task="retrieval"))
    assert curriculum == train.Curriculum("retrieval-tiny", ramp=0.5, mix=0.2)
    target = tasks.get_spec("retrieval")
    assert curriculum.spec_at(target, 0.0) == tasks.get_spec("retrieval-tiny")
    middle = curriculum.spec_at(target, 0.25)  # half of the ramp: the geometric means, rounded
    assert (middle.min_facts, middle.max_facts) == (31, 54)  # 8 * 15 ** 0.5, 12 * 20 ** 0.5
    assert (middle.min_questions, middle.max_questions, middle.min_hops, middle.max_hops) == (3, 3, 2, 5)
    assert curriculum.spec_at(target, 0.5) == curriculum.spec_at(target, 1.0) == target
    ways = [curriculum.spec_at(target, i / 100) for i in range(101)]
    assert all(a.min_facts <= b.min_facts and a.max_facts <= b.max_facts for a, b in zip(ways, ways[1:]))

    rng = random.Random(0)  # a share mix of the problems comes from the start variant throughout
    drawn = [curriculum.draw_spec(rng, target, 1.0) for _ in range(2000)]
    assert set(drawn) == {target, tasks.get_spec("retrieval-tiny")}
    assert 0.17 < drawn.count(tasks.get_spec("retrieval-tiny")) / len(drawn) < 0.23
    again = random.Random(0)
    assert [curriculum.draw_spec(again, target, 1.0) for _ in range(2000)] == drawn


def test_curriculum_batches_follow_the_progress_and_are_seeded():
    curriculum = train.Curriculum("retrieval-tiny", ramp=0.5, mix=0.0)
    target = tasks.get_spec("retrieval-short")

    def first_batches(progress: float, seed: int = 0, count: int = 3):
        batches = train.batches_from(random.Random(seed), target, 2048, curriculum=curriculum,
                                     progress=lambda n: progress)
        return [next(batches) for _ in range(count)]

    start, end = first_batches(0.0), first_batches(1.0)
    assert all(8 <= n <= 12 for inputs, _ in start for n in _fact_counts(inputs))
    assert all(30 <= n <= 60 for inputs, _ in end for n in _fact_counts(inputs))
    for (a, la), (b, lb) in zip(first_batches(0.3), first_batches(0.3)):  # the same seed, the same batches
        assert torch.equal(a, b) and torch.equal(la, lb)
    assert not torch.equal(first_batches(0.3, seed=1, count=1)[0][0], first_batches(0.3, count=1)[0][0])

    # Counted steps: the stream's batch n is step n (one stream, no workers); its first pool is
    # drawn at step 0 and every later one after the ramp (the pools hold several batches).
    stream = train._Stream(0, target, 2048, curriculum, total_steps=2)
    counts = [_fact_counts(inputs) for inputs, _ in itertools.islice(iter(stream), 40)]
    assert all(n <= 12 for n in counts[0]) and all(30 <= n <= 60 for n in counts[-1])


def test_curriculum_progress_starts_after_the_warmup():
    config = train.TrainConfig(out="", task="retrieval", warmup_steps=10, steps=110)
    counted = train.Schedule(config, start=0.0, deadline=100.0)
    assert [counted.done(step, now=99.0) for step in (0, 10, 60, 110, 200)] == [0.0, 0.0, 0.5, 1.0, 1.0]
    assert train.counted_progress(35, 110, 10) == 0.25  # what a data worker computes for step 35
    config.steps = None
    timed = train.Schedule(config, start=0.0, deadline=100.0)
    assert timed.done(5, now=15.0) == 0.0  # the warmup: the start variant
    timed.rate(10, now=20.0)  # the decay (and the curriculum) starts at the first step after the warmup
    assert timed.done(11, now=60.0) == pytest.approx(0.5) and timed.done(12, now=120.0) == 1.0


def test_curriculum_reaches_data_workers_through_the_shared_progress():
    """Under the time-based schedule a worker process reads the progress the training loop writes."""
    config = train.TrainConfig(out="", task="retrieval-short", batch_tokens=2048, curriculum_mix=0.0)
    shared = torch.zeros(1).share_memory_()
    batches = train.data_loader(config, workers=1, shared_progress=shared)
    assert all(n <= 12 for n in _fact_counts(next(batches)[0]))
    shared[0] = 1.0
    for _ in range(200):  # the pools drawn before the change come first
        counts = _fact_counts(next(batches)[0])
        if min(counts) >= 30:
            break
    assert min(counts) >= 30 and max(counts) <= 60


def test_curriculum_option_defaults_and_checks():
    assert train.curriculum_of(train.TrainConfig(out="", task="standard")) is None  # the ledger: unchanged
    assert train.curriculum_of(train.TrainConfig(out="", task="tracing")) is None
    assert train.curriculum_of(train.tiny_config("", "retrieval")) is None  # it is the tiny variant
    assert train.curriculum_of(train.TrainConfig(out="", task="retrieval", curriculum=None)) is None
    assert train.curriculum_of(train.TrainConfig(out="", task="retrieval", curriculum="none")) is None
    short = train.TrainConfig(out="", task="retrieval", curriculum="retrieval-short", curriculum_ramp=0.3,
                              curriculum_mix=0.0)
    assert train.curriculum_of(short) == train.Curriculum("retrieval-short", 0.3, 0.0)
    ledger = train.TrainConfig(out="", task="standard", curriculum="tiny")  # any task can have one
    assert train.curriculum_of(ledger).spec_at(tasks.get_spec("standard"), 0.0) == tasks.get_spec("tiny")
    with pytest.raises(ValueError, match="not a variant of the task's family"):
        train.TrainConfig(out="", task="retrieval", curriculum="tiny")
    with pytest.raises(ValueError, match="unknown task spec"):
        train.TrainConfig(out="", task="retrieval", curriculum="retrieval-huge")
    with pytest.raises(ValueError, match="ramp"):
        train.TrainConfig(out="", task="retrieval", curriculum_ramp=1.5)
    with pytest.raises(ValueError, match="mix"):
        train.TrainConfig(out="", task="retrieval", curriculum_mix=-0.1)

    import argparse

    parser = argparse.ArgumentParser()
    train.add_train_args(parser)
    parser.set_defaults(from_module=True)
    for argv, expected in [([], "auto"), (["--curriculum", "none"], None),
                           (["--curriculum", "retrieval-short", "--curriculum-ramp", "0.3"], "retrieval-short")]:
        args = parser.parse_args(["--task", "retrieval", "--out", "x"] + argv)
        args.from_module = True
        config = train.config_from_args(args)
        assert config.curriculum == expected
    assert config.curriculum_ramp == 0.3 and config.curriculum_mix == 0.2


def test_a_time_scheduled_run_with_a_curriculum_records_it(tmp_path, one_thread):
    config = train.TrainConfig(out=str(tmp_path / "ckpt"), model_size="tiny", task="retrieval-short",
                               batch_tokens=2048, lr=3e-3, warmup_steps=5, device="cpu", workers=0, eval_problems=0,
                               max_minutes=(20.0 + 6.0) / 60, log_every=1, max_position_embeddings=1024)
    record = train.train(config)
    assert record["curriculum"]["start"] == "retrieval-tiny" and record["curriculum"]["ramp"] == 0.5
    assert record["curriculum"]["target_spec"]["max_facts"] == 60
    ways = [entry["curriculum"] for entry in record["loss_curve"]]
    assert len(ways) >= 2 and ways[0] < 0.5 and all(a <= b <= 1.0 for a, b in zip(ways, ways[1:])), ways


def test_tiny_training_run_saves_a_checkpoint_both_loaders_read(tmp_path, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zipage import LLM, SamplingParams

    out = str(tmp_path / "ckpt")
    record = train.train(train.tiny_config(out))
    curve = [entry["loss"] for entry in record["loss_curve"]]
    assert curve[-1] < 0.6 * curve[0], curve  # it learns
    assert record["steps"] == 80 and record["config"]["seed"] == 0
    assert record["schedule"] == dict(kind="steps", total_steps=80, warmup_steps=10)
    assert 0.0 <= record["held_out"]["accuracy"] <= 1.0
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "training.json", "loss_curve.png"):
        assert os.path.isfile(os.path.join(out, name)), name
    with open(os.path.join(out, "training.json")) as f:
        assert json.load(f)["loss_curve"] == record["loss_curve"]
    again = train.build_model(train.TrainConfig(out="", init_from=out))  # --init-from continues from it
    saved = dict(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).named_parameters())
    assert all(torch.equal(p, saved[name]) for name, p in again.named_parameters())

    problem = tasks.held_out_problems(1, "tiny")[0]
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = tokenizer.apply_chat_template(tasks.messages(problem), tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                               min_new_tokens=40, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(out, device="cpu", dtype="float32", block_size=16)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected


def test_without_steps_the_run_follows_the_time_schedule(tmp_path, one_thread):
    """A few seconds of training with no step count: the time-driven schedule runs to the
    deadline and is recorded (what it reaches depends on the machine, so little is asserted)."""
    config = train.tiny_config(str(tmp_path / "ckpt"))
    config.steps, config.eval_problems, config.log_every = None, 0, 1
    config.max_minutes = (20.0 + 4.0) / 60  # 20 s are kept for saving when nothing is evaluated
    record = train.train(config)
    assert record["schedule"]["kind"] == "time" and record["schedule"]["warmup_steps"] == 10
    assert record["schedule"]["train_budget_s"] <= 4.0 and "held_out" not in record
    rates = [entry["lr"] for entry in record["loss_curve"]]
    decay = rates[config.warmup_steps:]
    assert all(a >= b for a, b in zip(decay, decay[1:])) and all(r >= 0.05 * config.lr - 1e-12 for r in rates)
    assert os.path.isfile(os.path.join(config.out, "model.safetensors"))
