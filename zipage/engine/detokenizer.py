"""Incremental detokenization and stop strings, at a cost per token independent of the output length.

The detokenizer is fed each new token once and keeps only a short tail of token ids:
the tokens already turned into text that serve as context (``CONTEXT_TOKENS`` or
fewer, for word boundaries) and those whose text is not released yet. Text is
released only once it cannot change: a byte-level token may end in the middle of a
UTF-8 character, which decodes to U+FFFD until the next token completes it. Tokens
that decode to nothing (special tokens skipped, ids the tokenizer does not know) are
passed over, keeping ``CONTEXT_TOKENS`` of them as context, so that a run of them
does not make every step decode a longer and longer tail.

Released text is kept as a list of parts (one per step that released some) and joined
once, when the request ends: appending to one growing string would copy it every step.
A streamed request's parts are dropped once ``take`` has handed them out, so that a long
stream holds only what it has not sent (a list of every part would be walked by each full
garbage collection).
A stop string is searched for in the new text plus the ``len(stop) - 1`` characters
before it, which is all a match that ends in the new text can span.

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
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = decode_function(tokenizer)
        self._max_stop = max((len(s) for s in stop), default=0)
        self._tail: list[int] = []  # context tokens, then the tokens whose text is not released yet
        self._read = 0  # index in _tail of the first token whose text is not released
        self._parts: list[str] = []  # the released text, in pieces
        self.num_chars = 0  # length of the released text
        self._recent = ""  # its last (longest stop string - 1) characters
        self._sent = 0  # characters handed out by ``take``

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def text(self) -> str:
        """The released text (joined each call: read it once, at the end); after ``take``, only
        what was not handed out."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def update(self, token_id: int) -> str | None:
        """Take in the next output token; return the stop string it completed, if any."""
        self._tail.append(token_id)
        prefix = self._decode(self._tail[:self._read])
        full = self._decode(self._tail)
        if full == prefix:  # the new tokens have no text: pass over them
            self._read = len(self._tail)
            self._drop_context(self._read - CONTEXT_TOKENS)
            return None
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # nothing new, or an unfinished character
        delta = full[len(prefix):]
        self._drop_context(self._read)  # the released tokens are the next decode's context
        self._read = len(self._tail)
        window = self._recent + delta  # every place a stop string ending in ``delta`` can start
        hits = [(at, stop) for stop in self.stop if (at := window.find(stop)) >= 0]
        if hits:
            at, stop = min(hits)  # the earliest stop string ends the text
            end = at + len(stop) if self.include_stop_str else at
            self._release(window[len(self._recent):end] if end >= len(self._recent) else "")
            if end < len(self._recent):
                self._cut(len(self._recent) - end)
            return stop
        self._release(delta)
        return None

    def take(self, hold_back: int = 0) -> str:
        """The released text not handed out yet, but for its last ``hold_back`` characters."""
        end = self.num_chars - hold_back
        if end <= self._sent:
            return ""
        need, pieces, i = end - self._sent, [], len(self._parts)
        skip = hold_back  # walk back from the end past the held-back characters, then collect
        while need > 0:
            i -= 1
            part = self._parts[i]
            if skip >= len(part):
                skip -= len(part)
                continue
            end_in_part = len(part) - skip
            skip = 0
            pieces.append(part[max(0, end_in_part - need):end_in_part])
            need -= len(pieces[-1])
        self._sent = end
        self._drop_taken()
        return "".join(reversed(pieces))

    def _drop_taken(self) -> None:
        """Forget the leading parts that were handed out entirely."""
        untaken, kept, i = self.num_chars - self._sent, 0, len(self._parts)
        while i > 0 and kept < untaken:
            i -= 1
            kept += len(self._parts[i])
        del self._parts[:i]

    def flush(self) -> None:
        """The request ended without a stop string: release what is left, an unfinished character too."""
        prefix, full = self._decode(self._tail[:self._read]), self._decode(self._tail)
        if len(full) > len(prefix):
            self._release(full[len(prefix):])
        self._read = len(self._tail)

    def _drop_context(self, start: int) -> None:
        """Forget the tokens before ``start`` in the tail (keeping ``_read`` pointing at the same token)."""
        if start > 0:
            del self._tail[:start]
            self._read -= start

    def _release(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self.num_chars += len(text)
            if self._max_stop > 1:
                self._recent = (self._recent + text)[-(self._max_stop - 1):]

    def _cut(self, num_chars: int) -> None:
        """Drop the last ``num_chars`` released characters (a stop string found in them)."""
        self.num_chars -= num_chars
        while num_chars:
            part = self._parts.pop()
            if len(part) > num_chars:
                self._parts.append(part[:len(part) - num_chars])
                num_chars = 0
            else:
                num_chars -= len(part)
