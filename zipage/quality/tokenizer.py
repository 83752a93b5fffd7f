"""A character-level tokenizer for the synthetic tasks, saved as a HuggingFace fast tokenizer.

One token per character (digits, letters, a little punctuation, space and newline)
plus ChatML's special tokens, 76 in all. Characters outside the
alphabet become ``<unk>``. The files (tokenizer.json, tokenizer_config.json with the
chat template) load with ``transformers.AutoTokenizer`` and so in the engine.

For training, ``CharCodec`` turns text into ids with one table lookup, no
tokenizer library involved, and gives the same ids.
"""

from __future__ import annotations

import json
import os

import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
PAD, IM_START, IM_END, UNK = SPECIAL_TOKENS
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ =+-:\n.,()"
VOCAB = SPECIAL_TOKENS + list(ALPHABET)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def render_chat(messages: list[dict], add_generation_prompt: bool) -> str:
    """What ``CHAT_TEMPLATE`` renders, without jinja (the training data path)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


class CharCodec:
    """Text <-> ids for the character vocabulary, special tokens included."""

    def __init__(self):
        self.ids = {token: i for i, token in enumerate(VOCAB)}
        table = np.full(256, self.ids[UNK], dtype=np.uint8)
        for char in ALPHABET:
            table[ord(char)] = self.ids[char]
        self._table = table

    @property
    def vocab_size(self) -> int:
        return len(VOCAB)

    def encode_plain(self, text: str) -> np.ndarray:
        """Ids (uint8) of text without special tokens; any non-ASCII character is ``<unk>``."""
        data = np.frombuffer(text.encode("ascii", "replace"), dtype=np.uint8)
        return self._table[data]

    def encode_chat(self, prompt_messages: list[dict], reply: str) -> tuple[np.ndarray, int]:
        """Ids of the rendered chat with ``reply`` as the assistant's turn (closed by
        ``<|im_end|>``), and the number of prompt ids (the loss starts there)."""
        prompt = render_chat(prompt_messages, add_generation_prompt=True)
        pieces = [self._encode_with_specials(prompt), self.encode_plain(reply),
                  np.array([self.ids[IM_END]], dtype=np.uint8)]
        return np.concatenate(pieces), len(pieces[0])

    def _encode_with_specials(self, text: str) -> np.ndarray:
        out, rest = [], text
        while rest:
            at, token = min(((rest.find(t), t) for t in (IM_START, IM_END, PAD) if t in rest),
                            default=(-1, None))
            if token is None:
                out.append(self.encode_plain(rest))
                break
            out.append(self.encode_plain(rest[:at]))
            out.append(np.array([self.ids[token]], dtype=np.uint8))
            rest = rest[at + len(token):]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.uint8)

    def decode(self, ids) -> str:
        return "".join(VOCAB[int(i)] for i in ids)


def build_tokenizer():
    """The ``tokenizers.Tokenizer``: a word-level model over single characters."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    tok.decoder = decoders.Fuse()  # join the characters back without separators
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def save_tokenizer(path: str) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) to ``path``.

    The config is written by hand, naming ``PreTrainedTokenizerFast``, so that older
    and newer transformers releases load it alike.
    """
    os.makedirs(path, exist_ok=True)
    build_tokenizer().save(os.path.join(path, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": UNK,
        "bos_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": IM_END, "pad_token": PAD, "unk_token": UNK}, f, indent=2)
