"""Training the synthetic-task model: schedule, batches, and the CPU smoke run whose
checkpoint both transformers and the engine load."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from zipage.quality import tasks, train
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
