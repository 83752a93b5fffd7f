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
