"""Incremental detokenization and stop strings.

Decoding only the tail of the output each step keeps the cost per token
constant. Text is released only once it cannot change: a byte-level token may end
in the middle of a UTF-8 character, which decodes to U+FFFD until the next token
completes it. Tokens that decode to nothing (special tokens skipped, ids the tokenizer
does not know) are passed over too, keeping ``CONTEXT_TOKENS`` of them as context, so that
a run of them does not make every step decode a longer and longer tail.

A streamed request decodes twice a step, so the call itself matters: transformers'
``decode`` first walks the list in Python to convert it (``to_py_obj``), which took three
times as long as the decoding; ``decode_function`` skips that for a list of ints.
"""

from __future__ import annotations

from typing import Callable

CONTEXT_TOKENS = 4  # tokens kept as context when the offsets move past tokens without text


def decode_function(tokenizer) -> Callable[..., str]:
    """``tokenizer.decode`` for a list of ints: a transformers tokenizer that keeps the base
    class's ``decode`` (which converts the input, then calls ``_decode``) is called at ``_decode``."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        return tokenizer.decode
    if (isinstance(tokenizer, PreTrainedTokenizerBase) and type(tokenizer).decode is PreTrainedTokenizerBase.decode
            and callable(getattr(tokenizer, "_decode", None))):
        return tokenizer._decode
    return tokenizer.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], include_stop_str: bool, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.prefix_offset = 0  # tokens decoded as context only, for word boundaries
        self.read_offset = 0  # tokens whose text is already in ``self.text``
        self._max_stop = max((len(s) for s in stop), default=0)
        self._decode_ids = decode_function(tokenizer)

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, output_ids: list[int]) -> str | None:
        """Take in the output so far; return the stop string hit, if any."""
        prefix = self._decode(output_ids[self.prefix_offset:self.read_offset])
        full = self._decode(output_ids[self.prefix_offset:])
        if full == prefix:  # the new tokens have no text: pass over them
            self.read_offset = len(output_ids)
            self.prefix_offset = max(self.prefix_offset, self.read_offset - CONTEXT_TOKENS)
            return None
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # nothing new, or an unfinished character
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        search_from = max(0, len(self.text) - self._max_stop + 1)
        self.text += delta
        hits = [(at, stop) for stop in self.stop if (at := self.text.find(stop, search_from)) >= 0]
        if not hits:
            return None
        at, stop = min(hits)  # the earliest stop string ends the text
        self.text = self.text[:at + len(stop) if self.include_stop_str else at]
        return stop
