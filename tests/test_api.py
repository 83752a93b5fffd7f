"""The user-facing API: inputs, outputs, stop conditions, errors, the command line."""

from __future__ import annotations

import json

import pytest
import torch

from zipage import SamplingParams
from zipage.cli import main as cli_main
from tests.conftest import assert_pool_full, make_llm


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return make_llm(checkpoint_dir("qwen3"), block_size=16, max_num_seqs=4, max_model_len=256)


def test_outputs_in_input_order_with_metrics(llm):
    prompts = ["a b c", [5, 6, 7], "Let x = 12", [9] * 40]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 1, 20)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 9, 1, 20]
    assert outputs[0].prompt == "a b c" and outputs[1].prompt is None
    assert outputs[1].prompt_token_ids == [5, 6, 7]
    for out in outputs:
        m = out.metrics
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert m.time_to_first_token > 0 and m.decode_time >= 0
    assert_pool_full(llm)


def test_single_prompt_forms(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    by_text = llm.generate("hello world", params, use_tqdm=False)
    by_ids = llm.generate(llm.tokenizer.encode("hello world"), params, use_tqdm=False)
    assert len(by_text) == len(by_ids) == 1
    assert by_text[0].outputs[0].token_ids == by_ids[0].outputs[0].token_ids


def test_eos_and_stop_token_ids_and_min_tokens(llm):
    eos = llm.tokenizer.eos_token_id
    greedy = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop_id = greedy[5]
    first = greedy.index(stop_id)
    out = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == greedy[:first + 1]
    # min_tokens keeps a stop token from ending (or being chosen) before the minimum
    out = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=30, min_tokens=first + 2,
                                                   stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:first + 2]
    assert eos not in out.token_ids[:first + 2]
    assert_pool_full(llm)


def test_stop_strings_trim_text(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(["The quick brown fox"], params, use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    at = text.find(stop)
    out = llm.generate(["The quick brown fox"],
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "\x00never"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:at]
    kept = llm.generate(["The quick brown fox"],
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
                                       include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:at + len(stop)]
    assert_pool_full(llm)


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate([[3] * 250], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_seeded_sampling_is_reproducible_across_batches(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate(["Let x = 12"], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.7, max_tokens=10, ignore_eos=True)
    mixed = llm.generate(["The quick", "Let x = 12", [4, 5, 6, 7]], [others, params, others],
                         use_tqdm=False)[1].outputs[0].token_ids
    assert alone == mixed
    different = llm.generate(["Let x = 12"], SamplingParams(temperature=1.0, max_tokens=24, seed=99,
                                                            ignore_eos=True), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is 2 + 2?"}],
                   SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1
    assert out[0].prompt.startswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>")
    assert out[0].prompt.endswith("<|im_start|>assistant\n")
    two = llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]],
                   SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(two) == 2


@pytest.mark.parametrize("prompt, params, message", [
    ("", None, "prompt is empty"),
    ([], None, "prompt is empty"),
    ([1] * 256, None, "max_model_len=256"),
    ([10 ** 6], None, "token ids must be in"),
    (3.5, None, "must be a string or a list of token ids"),
])
def test_bad_requests_raise_and_leave_the_engine_clean(llm, prompt, params, message):
    good = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine prompt", prompt], [good, params or good], use_tqdm=False)
    assert_pool_full(llm)  # the good request was not queued either
    assert len(llm.generate(["fine prompt"], good, use_tqdm=False)) == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(bogus=1), "unknown sampling parameter"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("seed", [2**63, -2**63 - 1, 10**30])
def test_seeds_outside_int64_are_rejected(seed):
    with pytest.raises(ValueError, match=rf"seed must be None or an integer in \[-2\*\*63, 2\*\*63 - 1\] "
                                         rf"\(int64\), got {seed}"):
        SamplingParams(seed=seed)


def test_seeds_at_the_int64_limits_sample_reproducibly(llm):
    runs = {}
    for seed in (2**63 - 1, -2**63, 2**63 - 1):
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True)
        tokens = llm.generate(["Let x = 12"], params, use_tqdm=False)[0].outputs[0].token_ids
        assert runs.setdefault(seed, tokens) == tokens and len(tokens) == 12
    assert runs[2**63 - 1] != runs[-2**63]
    assert_pool_full(llm)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_a_clear_error(checkpoint_dir, device):
    with pytest.raises(ValueError, match=f"device='{device}', but CUDA is not available here"):
        make_llm(checkpoint_dir("qwen3"), device=device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_index_beyond_the_visible_ones_is_named(checkpoint_dir):
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"device='cuda:{count}': the GPU index must be an integer in "
                                         rf"\[0, {count - 1}\] \({count} visible\)"):
        make_llm(checkpoint_dir("qwen3"), device=f"cuda:{count}")


def test_a_budget_the_context_never_outgrows_is_rejected(checkpoint_dir):
    """A request is compressed once it outgrows the budget and the working block: at 16-token
    blocks and a budget of 32, the first context that compresses is 50 tokens long."""
    from zipage import CompressionConfig

    model_dir = checkpoint_dir("qwen3")
    budget = CompressionConfig(kv_budget_tokens=32, window=8)
    for max_model_len in (32, 49):
        with pytest.raises(ValueError, match=rf"kv_budget_tokens=32 with max_model_len={max_model_len}: nothing "
                                             rf"would ever be compressed.*max_model_len must be >= 50 "
                                             rf"\(or kv_budget_tokens <= {max_model_len - 18}\)"):
            make_llm(model_dir, block_size=16, max_model_len=max_model_len, compression=budget)
    # max_model_len from the model (4096 for the tiny checkpoint), budget from max_blocks_per_seq
    with pytest.raises(ValueError, match="kv_budget_tokens=4096 with max_model_len=4096"):
        make_llm(model_dir, block_size=16, compression=CompressionConfig(max_blocks_per_seq=257))
    with make_llm(model_dir, block_size=16, max_model_len=50, compression=budget) as llm:
        out = llm.generate([[5]], SamplingParams(max_tokens=49, ignore_eos=True, temperature=0), use_tqdm=False)[0]
    assert out.metrics.num_compressions == 1 and out.metrics.evicted_tokens > 0


def test_bad_engine_arguments(checkpoint_dir, tmp_path):
    model_dir = checkpoint_dir("qwen3")
    with pytest.raises(ValueError, match="unknown engine argument 'tensor_paralel_size'"):
        make_llm(model_dir, tensor_paralel_size=2)
    with pytest.raises(ValueError, match="block_size"):
        make_llm(model_dir, block_size=24)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_llm(model_dir, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="max_model_len=99999 exceeds"):
        make_llm(model_dir, max_model_len=99999)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_llm(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        make_llm(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        make_llm(str(tmp_path))


def test_missing_weights_are_named(checkpoint_dir, tmp_path):
    import shutil
    from safetensors.torch import load_file, save_file
    src = checkpoint_dir("qwen2")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", tmp_path / name)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        make_llm(str(tmp_path))
    weights = load_file(f"{src}/model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.qkv_proj.bias \\(k\\)"):
        make_llm(str(tmp_path))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs(checkpoint_dir, dtype):
    llm = make_llm(checkpoint_dir("qwen3"), dtype=dtype, block_size=16)
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert_pool_full(llm)


def test_cli_generate(checkpoint_dir, capsys):
    code = cli_main(["generate", "--model", checkpoint_dir("qwen3"), "--prompt", "hello", "--prompt", "world",
                     "--max-tokens", "5", "--ignore-eos", "--json", "--block-size", "16",
                     "--kv-cache-memory-bytes", str(1 << 28), "--max-num-seqs", "8"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [len(line["token_ids"]) for line in lines] == [5, 5]
    assert all(line["metrics"]["num_compressions"] == 0 == line["metrics"]["evicted_tokens"] for line in lines)
    assert cli_main(["generate", "--model", "/nonexistent/dir", "--prompt", "x"]) == 2


def test_cli_generate_json_carries_the_compression_metrics(checkpoint_dir, capsys):
    """The counters of ``generate --json`` are those ``LLM.generate`` reports for the same run."""
    from zipage import CompressionConfig

    model_dir = checkpoint_dir("qwen3")
    prompts = ["hello", "Let x = 12 and y = 30. Then"]
    engine = dict(block_size=16, max_model_len=256, max_num_seqs=4, kv_cache_memory_bytes=1 << 26)
    code = cli_main(["generate", "--model", model_dir, *(a for p in prompts for a in ("--prompt", p)),
                     "--max-tokens", "90", "--ignore-eos", "--json", "--device", "cpu", "--dtype", "float32",
                     "--block-size", "16", "--max-model-len", "256", "--max-num-seqs", "4",
                     "--kv-cache-memory-bytes", str(1 << 26), "--kv-budget-tokens", "32", "--compression-window", "8"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    with make_llm(model_dir, compression=CompressionConfig(kv_budget_tokens=32, window=8), **engine) as llm:
        reference = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=90, ignore_eos=True),
                                 use_tqdm=False)
    for line, out in zip(lines, reference):
        m = out.metrics
        assert line["token_ids"] == out.outputs[0].token_ids
        assert (line["metrics"]["num_compressions"], line["metrics"]["evicted_tokens"], line["metrics"]["peak_blocks"],
                line["metrics"]["prompt_tokens"]) == (m.num_compressions, m.evicted_tokens, m.peak_blocks,
                                                      len(out.prompt_token_ids))
        assert m.num_compressions >= 2 and m.evicted_tokens > 0 and m.peak_blocks <= 3  # N = 32 / 16 + 1
        assert line["metrics"]["time_to_first_token_s"] > 0


def test_detokenizer_passes_over_tokens_without_text(checkpoint_dir):
    """Ids that decode to nothing (here: beyond the tokenizer's vocabulary) must not make the
    decoded tail grow step after step; the text is still that of the whole output."""
    from zipage.engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
    from zipage.utils.loader import load_tokenizer

    tokenizer = load_tokenizer(checkpoint_dir("qwen3"))
    words = tokenizer.encode(" hello world", add_special_tokens=False)
    unknown = len(tokenizer) + 1000
    assert tokenizer.decode([unknown]) == ""
    detok = IncrementalDetokenizer(tokenizer, [], False, True)
    ids = []
    for token in [words[0]] + [unknown] * 50 + words[1:]:
        ids.append(token)
        detok.update(token)
        assert len(detok._tail) <= CONTEXT_TOKENS + 1  # the tokens it decodes each step
    assert detok.text == tokenizer.decode(ids) == " hello world"


def test_detokenizer_decodes_as_the_tokenizer_does(checkpoint_dir):
    """The detokenizer calls a transformers tokenizer past its input conversion; same text."""
    import random

    from zipage.engine.detokenizer import decode_function
    from zipage.utils.loader import load_tokenizer

    tokenizer = load_tokenizer(checkpoint_dir("qwen3"))
    fast = decode_function(tokenizer)
    assert fast != tokenizer.decode
    rng = random.Random(0)
    special = sorted(tokenizer.all_special_ids)
    for n in (0, 1, 7, 40):
        ids = [rng.randrange(len(tokenizer) + 10) for _ in range(n)] + special
        rng.shuffle(ids)
        for skip in (False, True):
            assert fast(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)

    class Custom(type(tokenizer)):  # a tokenizer with its own decode keeps it
        def decode(self, token_ids, **kwargs):
            return "custom"

    tokenizer.__class__ = Custom
    assert decode_function(tokenizer)([1], skip_special_tokens=True) == "custom"

    class Plain:  # not a transformers tokenizer
        def decode(self, token_ids, skip_special_tokens=False):
            return "plain"

    assert decode_function(Plain())([1], skip_special_tokens=False) == "plain"
