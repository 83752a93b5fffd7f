"""Quality evaluation: metrics, the synthetic sweep on a tiny checkpoint (the CI run), and
math answer extraction and scoring."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from zipage.quality import eval as qeval
from zipage.quality import math_eval, tasks


def _output(text: str, token_ids: list[int]):
    return SimpleNamespace(outputs=[SimpleNamespace(text=text, token_ids=token_ids)])


def test_correct_prefix_and_score():
    assert qeval.correct_prefix([1, 2, 3, 9], [1, 2, 3, 4, 5]) == 3
    assert qeval.correct_prefix([], [1]) == 0
    assert qeval.correct_prefix([1, 2], [1, 2]) == 2
    problems = tasks.held_out_problems(2, "tiny")
    encoded = [qeval.Encoded(p, [0], [5, 6, 7, 8]) for p in problems]
    outputs = [_output(f"...\nanswer {problems[0].answer}", [5, 6, 7, 8]),
               _output("answer 999", [5, 9, 7, 8])]
    result = qeval.score(encoded, outputs)
    assert result["correct"] == [True, problems[1].answer == "999"]
    assert result["prefix"] == [1.0, 0.25]
    assert result["prefix_fraction"] == pytest.approx(0.625)


def test_budget_tokens_rounds_to_blocks_and_fits_the_window():
    assert qeval.budget_tokens(0.125, 2000, 32, 16) == 256
    assert qeval.budget_tokens(0.5, 2000, 32, 16) == 992
    assert qeval.budget_tokens(0.01, 2000, 16, 16) == 32  # window 16 + 4 sink tokens


def _record(full=0.9, zipage=(0.5, 0.88, 0.9), attention=(0.4, 0.8, 0.9)):
    runs = [dict(policy="full", budget_tokens=None, budget_fraction=1.0, accuracy=full, prefix_fraction=0.95)]
    for tokens, z, a in zip((256, 512, 1024), zipage, attention):
        runs.append(dict(policy="zipage", budget_tokens=tokens, budget_fraction=tokens / 2048, accuracy=z,
                         prefix_fraction=z))
        runs.append(dict(policy="attention", budget_tokens=tokens, budget_fraction=tokens / 2048, accuracy=a,
                         prefix_fraction=a - 0.1))
    record = dict(settings=dict(num_problems=10, mean_length=2048.0), runs=runs)
    record["summary"] = qeval.summarise(runs)
    return record


def test_summary_and_table():
    record = _record()
    summary = record["summary"]
    assert summary["zipage_keeps_95_from_tokens"] == 512  # 0.88 >= 0.95 * 0.9
    assert summary["zipage_beats_baselines"]["256"] == {"accuracy": True, "prefix_fraction": True}
    assert summary["zipage_beats_baselines"]["1024"]["accuracy"] is False  # a tie is not a win
    text = qeval.table(record)
    assert "| 256 | 0.125 | 0.500 / 0.500 | 0.400 / 0.300 |" in text
    assert "| full KV | 1 | 0.900 / 0.950 | 0.900 / 0.950 |" in text
    assert "512 tokens (0.250 of the mean sequence)" in text
    # A budget that keeps the accuracy only below a larger one that does not is not reported.
    assert qeval.summarise(_record(zipage=(0.9, 0.5, 0.9))["runs"])["zipage_keeps_95_from_tokens"] == 1024
    assert qeval.summarise(_record(full=0.0)["runs"])["zipage_keeps_95_from_tokens"] is None


@pytest.fixture(scope="module")
def tiny_synthetic_model(tmp_path_factory):
    """A random tiny Qwen3 with the task's tokenizer, saved the way training saves it."""
    from zipage.quality.train import TrainConfig, build_model, save_checkpoint
    path = str(tmp_path_factory.mktemp("synthetic-tiny"))
    config = TrainConfig(out=path, model_size="tiny", max_position_embeddings=512)
    save_checkpoint(build_model(config), path)
    return path


@pytest.fixture
def one_thread():
    """Tiny models decode far faster on one thread (no thread hand-offs on a busy CPU)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_synthetic_eval_end_to_end(tiny_synthetic_model, tmp_path, one_thread):
    """The CI run: every policy at one budget on three tiny problems, table, JSON and plot."""
    task = tasks.TaskSpec(min_steps=2, max_steps=3, milestone_every=2, num_values=3)  # ~200 tokens in all
    record = qeval.run_synthetic(tiny_synthetic_model, num_problems=3, budgets=[0.4], task=task,
                                 device="cpu", block_size=16, window=8, log=lambda *_: None)
    policies = [r["policy"] for r in record["runs"]]
    assert policies == ["full", "zipage", "attention", "recency", "random"]
    for run in record["runs"]:
        assert 0.0 <= run["accuracy"] <= 1.0 and 0.0 <= run["prefix_fraction"] <= 1.0
        assert len(run["correct"]) == 3 and run["generated_tokens"] > 0
    compressed = record["runs"][1:]
    assert all(r["budget_tokens"] == compressed[0]["budget_tokens"] for r in compressed)
    assert all(r["compressions"] > 0 for r in compressed)  # a random model writes past the budget
    assert all(r["peak_kv_bytes_max"] < record["runs"][0]["peak_kv_bytes_max"] for r in compressed)
    qeval.write(record, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["synthetic.json", "synthetic.md", "synthetic.png"]
    with open(tmp_path / "synthetic.json") as f:
        assert json.load(f)["settings"]["num_problems"] == 3


def test_token_agreement():
    assert qeval.token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, 1.0)
    assert qeval.token_agreement([1, 9, 3, 4], [1, 2, 3, 4]) == (0.25, 0.75)  # re-converges after a flip
    assert qeval.token_agreement([1, 2], [1, 2, 3, 4]) == (0.5, 0.5)  # positions past the shorter end disagree
    assert qeval.token_agreement([1, 2, 3, 4], [1, 2]) == (1.0, 0.5)
    assert qeval.token_agreement([], []) == (1.0, 1.0)
    assert qeval.agreement([[1, 2], [5]], [[1, 3], [5]]) == dict(agreement_prefix=0.75, token_agreement=0.75)


def test_synthetic_eval_fp8_weights_scores_agreement(tiny_synthetic_model, tmp_path, one_thread):
    """FP8 runs carry their agreement with the unquantized run of the same configuration, run here
    or read from a saved reference (full KV only, to stay cheap: the budgets' runs go the same way)."""
    task = tasks.TaskSpec(min_steps=2, max_steps=3, milestone_every=2, num_values=3)
    options = dict(num_problems=2, budgets=[], policies=["zipage"], task=task, device="cpu", block_size=16,
                   window=8, log=lambda *_: None)
    record = qeval.run_synthetic(tiny_synthetic_model, quantization="fp8", keep_tokens=True, **options)
    assert record["settings"]["quantization"] == "fp8" and list(record["tokens"]) == ["full"]
    (full,) = record["runs"]
    assert 0.0 <= full["agreement_prefix"] <= 1.0 and 0.0 <= full["token_agreement"] <= 1.0
    assert "Agreement: greedy-token agreement" in qeval.table(record) and qeval._cell(full).count(" / ") == 2
    assert qeval.run_key("zipage", 80) == "zipage@80" and qeval.run_key("full", None) == "full"
    again = qeval.run_synthetic(tiny_synthetic_model, quantization="fp8", reference=record["tokens"], **options)
    assert again["runs"][0]["token_agreement"] == again["runs"][0]["agreement_prefix"] == 1.0  # deterministic
    qeval.write(record, str(tmp_path), plot_too=False)
    with open(tmp_path / "tokens.json") as f:
        assert json.load(f) == record["tokens"]


def test_eval_command_rejects_unknown_policies(tiny_synthetic_model, capsys):
    from zipage.cli import main
    assert main(["eval", "synthetic", "--model", tiny_synthetic_model, "--policies", "zipage,h2o"]) == 2
    assert "--policies" in capsys.readouterr().err


# ---------------------------------------------------------------- math


@pytest.mark.parametrize("text, boxed", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} first, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("nested \\boxed{\\{1, \\sqrt{2}\\}}", "\\{1, \\sqrt{2}\\}"),
    ("\\fbox{7}", "7"),
    ("\\boxed 5.", "5"),
    ("\\boxed{3} and a cut-off \\boxed{12", "3"),
    ("no box at all: 12", None),
])
def test_extract_boxed(text, boxed):
    assert math_eval.extract_boxed(text) == boxed


@pytest.mark.parametrize("completion, answer, correct", [
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", True),
    ("\\boxed{12}", 12, True),
    ("\\boxed{12}", "$12$", True),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", True),
    ("\\boxed{13}", "12", False),
    ("the answer is 12", "12", False),  # not boxed
    ("\\boxed{}", "12", False),
])
def test_is_correct(completion, answer, correct):
    assert math_eval.is_correct(completion, answer) is correct


def test_load_problems_and_pass_at_1(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n\n{"problem": "2+2?", "answer": 4}\n')
    assert math_eval.load_problems(str(path)) == [{"question": "1+1?", "answer": "2"},
                                                  {"question": "2+2?", "answer": 4}]
    assert len(math_eval.load_problems(str(path), limit=1)) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        math_eval.load_problems(str(bad))
    assert math_eval.pass_at_1([[True, False], [True, True]]) == pytest.approx(0.75)


def test_math_command_end_to_end(checkpoint_dir, tmp_path, one_thread):
    """Full KV and Zipage on a random chat checkpoint: the command runs and writes its record."""
    from zipage.cli import main
    data = tmp_path / "problems.jsonl"
    data.write_text('{"question": "What is 1+1?", "answer": "2"}\n{"problem": "What is 2+2?", "answer": 4}\n')
    out = tmp_path / "out"
    assert main(["eval", "math", "--model", checkpoint_dir("qwen3"), "--data", str(data), "--n", "2",
                 "--max-tokens", "40", "--device", "cpu", "--block-size", "16", "--kv-budget-tokens", "32",
                 "--out", str(out)]) == 0
    with open(out / "math.json") as f:
        record = json.load(f)
    assert [r["mode"] for r in record["runs"]] == ["full", "zipage"]
    for run in record["runs"]:
        assert 0.0 <= run["pass_at_1"] <= 1.0 and len(run["correct"]) == 2 and len(run["correct"][0]) == 2
    assert record["settings"]["system_prompt"] == math_eval.SYSTEM_PROMPT


def test_demo_runs_the_trained_model(one_thread, capsys):
    """`zipage demo` on two problems: the committed checkpoint solves them with full KV, both
    compressed runs hold their KV under the full run's, the output explains the task, the
    columns and the budget's unit, ends with a verdict, and the engine equals transformers."""
    from zipage.cli import main
    from zipage.demo import CHECKPOINT

    assert main(["demo", "--num-problems", "2", "--check", "1", "--check-tokens", "16", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| full KV | 1.000 | 1.000 |" in out  # the trained model solves both
    peak = {line.split("|")[1].strip(): float(line.split("|")[4].split()[0])
            for line in out.splitlines() if line.startswith("| full KV |") or line.startswith("| Zipage, ")}
    assert set(peak) == {"full KV", "Zipage, published defaults", "Zipage, tuned for this task"}
    assert max(peak["Zipage, published defaults"], peak["Zipage, tuned for this task"]) < peak["full KV"]
    assert "tokens per layer and KV head" in out and "Task:" in out and "correct prefix:" in out
    assert "greedy tokens equal to transformers' generate: 1/1" in out
    verdict = [line for line in out.splitlines() if line.startswith("Verdict: with ")]
    assert len(verdict) == 1 and "less KV memory per request" in verdict[0] and "(full KV: 2/2)" in verdict[0]
    with open(os.path.join(CHECKPOINT, "training.json")) as f:
        assert json.load(f)["held_out"]["accuracy"] >= 0.9


def test_prompt_whole_against_compressed_between_chunks(tiny_synthetic_model, one_thread):
    """The settings of how a prompt meets the budget, on tiny retrieval problems prefilled in
    chunks of 16 tokens: cached whole then compressed, or compressed between chunks."""
    record = qeval.run_synthetic(tiny_synthetic_model, num_problems=2, budgets=[0.25], task="retrieval-tiny",
                                 device="cpu", block_size=16, window=8, log=lambda *_: None,
                                 settings=["prompt_whole", "prefill"], max_num_batched_tokens=16)
    assert [r.get("setting", r["policy"]) for r in record["runs"]] == ["full", "prompt_whole", "prefill"]
    assert record["settings"]["compared"]["prefill"]["prefill_compression"] == "always"
    assert record["settings"]["max_num_batched_tokens"] == 16
    whole, prefill = record["runs"][1:]
    budget = whole["budget_tokens"]
    assert record["settings"]["min_length"] > 2 * budget  # prompts well beyond the budget
    # Prefilled whole, a prompt holds all its blocks until its first decode step; compressed
    # between chunks, never more than the budget's blocks plus one chunk and the working block.
    assert prefill["peak_kv_bytes_max"] <= whole["peak_kv_bytes_max"]
    assert prefill["compressions"] > whole["compressions"] > 0
