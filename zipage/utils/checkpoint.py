"""Build HuggingFace checkpoints locally: a small byte-level BPE tokenizer and
random-weight models, either tiny (tests, CPU demo) or in real shapes (benchmarks).

Nothing is downloaded: the tokenizer is trained here on a built-in text, and the
model is written by ``transformers`` itself, so it loads exactly as a real one does.
"""

from __future__ import annotations

import os

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML with Qwen3's think blocks: an assistant turn after the last user turn (a tool-calling
# round) carries its ``reasoning_content``; enable_thinking=false closes an empty block at once.
QWEN3_THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content or '' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and reasoning_content %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)

# ChatML as DeepSeek-R1 distills render it: earlier answers lose their thinking, and the
# generation prompt opens <think>, so the output starts inside it.
R1_THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{%- set content = message.content or '' %}"
    "{{- '<|im_start|>assistant\n' + content.split('</think>')[-1] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n' }}{%- endif %}"
)

# Tokenizers with think blocks: (chat template, how <think> and </think> are tokens: "added" as
# real Qwen3 and R1 have them, "special" (skip_special_tokens drops them) or "text" (plain BPE)).
THINKING = {
    "qwen3": (QWEN3_THINKING_TEMPLATE, "added"),
    "qwen3_special": (QWEN3_THINKING_TEMPLATE, "special"),
    "r1": (R1_THINKING_TEMPLATE, "added"),
    "r1_text": (R1_THINKING_TEMPLATE, "text"),
}

_CORPUS = """
A request decodes thousands of tokens while it reasons about a problem. Each step
depends on the steps before it: first we read the statement, then we compute the
intermediate results, check them again, and finally state the answer.
Let x = 12 and y = 30. Then x + y = 42, x * y = 360, and y - x = 18.
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 100 1000.
Question: what is the sum of the first ten positive integers? Answer: 55.
We check the result once more: 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 9 + 10 = 55.
Therefore the final answer is 55. Please reason step by step.
"""

# Real model shapes for benchmarks (weights are random; load with load_format="dummy").
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False),
    # 64 GB of bf16 weights: tensor parallelism's case (about 32 GB a GPU at TP=2)
    "qwen3-32b": dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      rope_theta=500000.0, tie_word_embeddings=False,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Mixture of experts (arch qwen3_moe): 128 experts, 8 per token, ~3B of 30.5B parameters active
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False),
}
# The tiny shape's experts, for arch qwen3_moe: 8 experts, 2 per token, the last layer dense
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[1])


def _synthetic_merges(vocab_size: int, seed: int = 0) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of ``vocab_size`` entries built by merging random pairs: words
    and word pieces (most with a leading space, as real vocabularies), digits, punctuation and
    JSON-like runs, of lengths like a real tokenizer's. Not trained on any text: for benchmarks
    whose cost depends on the vocabulary's size and content (grammar masks, detokenization)."""
    import random

    from tokenizers import pre_tokenizers

    rng = random.Random(seed)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + alphabet)}
    space = "\u0120"  # the byte-level alphabet's space
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [26 - i for i in range(len(letters))]
    # No quote inside longer tokens but the three starts below: a random model writing a JSON
    # string then rarely closes it, so a structured-output benchmark stays in the string.
    pieces = [c for c in letters] + [c.upper() for c in letters[:12]] + list("0123456789") + list("{}[]:,.-_()")
    starts = [space + c for c in letters] + list(letters) + list("0123456789") + [space + '"', '":', '",']
    merges, tokens = [], list(starts)
    for start in starts:  # the two-character starts are merges of single characters
        if start not in vocab:
            vocab[start] = len(vocab)
            merges.append((start[0], start[1:]))
    while len(vocab) < vocab_size:
        left = rng.choice(tokens)
        right = rng.choices(letters, weights)[0] if rng.random() < 0.85 else rng.choice(pieces)
        new = left + right
        if len(new) > 14 or new in vocab:
            continue
        vocab[new] = len(vocab)
        merges.append((left, right))
        tokens.append(new)
    return vocab, merges


def build_tokenizer(vocab_size: int = 384, thinking: str | None = None, synthetic: bool = False):
    """A byte-level BPE tokenizer (any text round-trips) with ChatML special tokens; ``thinking``
    (a key of ``THINKING``): a chat template with think blocks, and <think>, </think> as tokens.
    ``synthetic``: ``vocab_size`` entries made up by ``_synthetic_merges`` instead of trained on
    the built-in text (which gives a few hundred): a vocabulary the size of a real model's."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if synthetic:
        tok = Tokenizer(models.BPE(*_synthetic_merges(vocab_size)))
    else:
        tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if synthetic:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    else:
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator([_CORPUS] * 4, trainer)
    template = CHATML_TEMPLATE
    if thinking is not None:
        if thinking not in THINKING:
            raise ValueError(f"unknown thinking tokenizer {thinking!r}; choose from {sorted(THINKING)}")
        template, tags = THINKING[thinking]
        if tags != "text":  # added after training: the other tokens keep their ids
            tok.add_tokens([AddedToken(t, special=tags == "special", normalized=False)
                            for t in ("<think>", "</think>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, chat_template=template)


def hf_config(arch: str = "qwen3", shape: str = "tiny", vocab_size: int | None = None, **overrides):
    """A transformers config of ``arch`` (qwen3, qwen2, llama, qwen3_moe) in a named shape (a
    mixture-of-experts shape is always qwen3_moe)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    classes = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig}
    if arch not in classes:
        raise ValueError(f"unknown architecture {arch!r}; choose from {sorted(classes)}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    fields = dict(SHAPES[shape])
    if "num_experts" in fields:
        arch = "qwen3_moe"
    elif arch == "qwen3_moe":
        if shape != "tiny":
            raise ValueError(f"shape {shape!r} has no experts: use qwen3_moe with tiny or a mixture-of-experts "
                             f"shape ({', '.join(s for s in SHAPES if 'num_experts' in SHAPES[s])})")
        fields.update(TINY_MOE)
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    if arch == "qwen2":
        fields.pop("head_dim", None)  # Qwen2 derives it from hidden_size / heads
    fields.update(overrides)
    if isinstance(fields.get("mlp_only_layers"), tuple):  # hashable in a test's fixture key; a list for the config
        fields["mlp_only_layers"] = list(fields["mlp_only_layers"])
    rope_scaling = fields.pop("rope_scaling", None)
    config = classes[arch](**fields)
    if rope_scaling is not None:
        theta = fields.get("rope_theta", 10000.0)
        config.rope_scaling = dict(rope_scaling, rope_theta=theta)
        if hasattr(config, "rope_parameters"):
            config.rope_parameters = dict(rope_scaling, rope_theta=theta)
    return config


def make_checkpoint(path: str, arch: str = "qwen3", shape: str = "tiny", dtype: torch.dtype = torch.float32,
                    seed: int = 0, with_weights: bool = True, max_shard_size: str | None = None,
                    thinking: str | None = None, full_vocab: bool = False, **overrides) -> str:
    """Write config.json, tokenizer files and (optionally) random safetensors weights to ``path``;
    ``thinking``: the tokenizer's (``build_tokenizer``). ``full_vocab`` (a shape with its own
    vocabulary size): a synthetic tokenizer of about that size, not the small trained one."""
    os.makedirs(path, exist_ok=True)
    if full_vocab and "vocab_size" in SHAPES[shape]:
        tokenizer = build_tokenizer(SHAPES[shape]["vocab_size"] - 256, thinking=thinking, synthetic=True)
    else:
        tokenizer = build_tokenizer(thinking=thinking)
    vocab = overrides.pop("vocab_size", None) or (None if "vocab_size" in SHAPES[shape] else len(tokenizer))
    config = hf_config(arch, shape, vocab_size=vocab, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **overrides)
    config.architectures = [config.__class__.__name__.replace("Config", "ForCausalLM")]
    config.dtype = dtype
    tokenizer.save_pretrained(path)
    if not with_weights:
        config.save_pretrained(path)
        return path
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path
