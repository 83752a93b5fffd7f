"""Reasoning output: split a chat answer into the thinking between ``<think>`` and ``</think>``
and the answer after it, as vLLM's ``--reasoning-parser`` does (``qwen3``, ``deepseek_r1``).

Both parsers read the output as reasoning up to the first ``</think>`` (a ``<think>`` the model
writes itself is dropped) and the rest as the answer; an output that ends while still thinking
is all reasoning. Models of this kind open ``<think>`` in the generation prompt (R1 distills,
Qwen3.5) or write it first (Qwen3). When the generation prompt already closes the think block
(Qwen3 with ``enable_thinking=false`` renders ``<think>\\n\\n</think>``), the output is all answer;
``qwen3`` also reads ``chat_template_kwargs.enable_thinking=false`` so.

The split works on the streamed text: a tail that could be the start of a tag is held back until
the next text shows whether it is one. A tag that is a special token, which the detokenizer
skips (``skip_special_tokens``), leaves no text: it is found by its token id instead.
"""

from __future__ import annotations

from dataclasses import dataclass

START_TAG, END_TAG = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 64  # tokens of the prompt looked at for an open or closed think block


@dataclass(frozen=True)
class _Flavour:
    honours_enable_thinking: bool  # chat_template_kwargs.enable_thinking=false: the output is all answer


PARSERS = {"qwen3": _Flavour(honours_enable_thinking=True), "deepseek_r1": _Flavour(honours_enable_thinking=False)}


def check_parser_name(name: str | None) -> None:
    if name is not None and name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(sorted(PARSERS))}")


class ReasoningParser:
    """One server's parser: what it knows of the tokenizer's tags; ``start`` makes a splitter per choice."""

    def __init__(self, name: str, tokenizer):
        check_parser_name(name)
        if tokenizer is None:
            raise ValueError(f"the {name} reasoning parser needs the model's tokenizer; this checkpoint has none")
        self.name, self.flavour, self.tokenizer = name, PARSERS[name], tokenizer
        self.start_id, self.end_id = _single_token_id(tokenizer, START_TAG), _single_token_id(tokenizer, END_TAG)
        special = special_ids(tokenizer)
        self._start_special = self.start_id is not None and self.start_id in special
        self._end_special = self.end_id is not None and self.end_id in special
        self._stop_ids = special - {self.start_id, self.end_id}  # a turn's boundary: the prompt tail ends there

    def starts_in_reasoning(self, prompt_ids: list[int], template_kwargs: dict | None) -> bool:
        """Whether the output begins inside a think block (False: it is all answer)."""
        if self.flavour.honours_enable_thinking and (template_kwargs or {}).get("enable_thinking", True) is False:
            return False
        tail: list[int] = []
        for token in reversed(prompt_ids[-PROMPT_TAIL_TOKENS:]):
            if token in self._stop_ids:
                break  # an earlier turn's think block says nothing of this one
            tail.append(token)
        text = self.tokenizer.decode(tail[::-1], skip_special_tokens=False)
        return not text.rfind(END_TAG) > text.rfind(START_TAG)  # a closed block: the answer comes next

    def start(self, in_reasoning: bool, skip_special_tokens: bool) -> ReasoningSplitter:
        return ReasoningSplitter(self, in_reasoning, skip_special_tokens)


class ReasoningSplitter:
    """One choice's split: ``feed`` each new piece of text with its token ids, ``take`` what is
    ready, ``finish`` when the output ends (the held-back tail goes out then)."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool, skip_special_tokens: bool):
        self.parser = parser
        self.in_reasoning = in_reasoning
        self.saw_reasoning = in_reasoning  # content is None (not "") when the output began thinking
        self._end_by_id = parser._end_special and skip_special_tokens  # the end tag leaves no text
        self._drop_start_text = not (parser._start_special and skip_special_tokens)
        self._start_dropped = False
        self._held = ""  # reasoning text that may end in the start of a tag
        self._reasoning: list[str] = []  # ready, not taken yet
        self._content: list[str] = []

    def feed(self, text: str, token_ids=()) -> None:
        if not self.in_reasoning:
            if text:
                self._content.append(text)
            return
        if self._end_by_id and self.parser.end_id in token_ids:
            before, after = self._split_at_end_id(text, list(token_ids))
            self._scan(before, final=True)
            self._end(after)
            return
        self._scan(text, final=False)

    def finish(self) -> None:
        if self.in_reasoning:
            self._scan("", final=True)

    def take(self) -> tuple[str, str]:
        """(reasoning, content) ready since the last call."""
        reasoning, content = "".join(self._reasoning), "".join(self._content)
        self._reasoning.clear()
        self._content.clear()
        return reasoning, content

    # -- inside the think block -------------------------------------------------------------
    def _scan(self, text: str, final: bool) -> None:
        """Reasoning text up to the end tag (dropping a first start tag); the rest is content."""
        text = self._held + text
        self._held = ""
        if self._drop_start_text and not self._start_dropped:
            at = text.find(START_TAG)
            end_at = -1 if self._end_by_id else text.find(END_TAG)
            if at >= 0 and (end_at < 0 or at < end_at):
                text = text[:at] + text[at + len(START_TAG):]
                self._start_dropped = True
        if not self._end_by_id:
            at = text.find(END_TAG)
            if at >= 0:
                self._reasoning.append(text[:at])
                self._end(text[at + len(END_TAG):])
                return
        keep = 0 if final else self._partial_tag_length(text)
        ready = text[:len(text) - keep]
        self._held = text[len(text) - keep:]
        if ready:
            self._reasoning.append(ready)

    def _partial_tag_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that a tag still looked for begins with."""
        tags = [] if self._end_by_id else [END_TAG]
        if self._drop_start_text and not self._start_dropped:
            tags.append(START_TAG)
        for length in range(min(len(text), max(map(len, tags), default=1) - 1), 0, -1):
            if any(tag.startswith(text[-length:]) for tag in tags):
                return length
        return 0

    def _end(self, content: str) -> None:
        self.in_reasoning = False
        if content:
            self._content.append(content)

    def _split_at_end_id(self, text: str, token_ids: list[int]) -> tuple[str, str]:
        """``text`` cut where the (textless) end tag token sat among ``token_ids``."""
        at = token_ids.index(self.parser.end_id)
        decode = self.parser.tokenizer.decode
        after = decode(token_ids[at + 1:], skip_special_tokens=True).rstrip("\ufffd")
        if after and text.endswith(after):
            return text[:len(text) - len(after)], after
        before = decode(token_ids[:at], skip_special_tokens=True).rstrip("\ufffd")
        if text.startswith(before):
            return before, text[len(before):]
        return text, ""  # the detokenizer held text back across the tag: keep it with the reasoning


def _single_token_id(tokenizer, tag: str) -> int | None:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def special_ids(tokenizer) -> set[int]:
    """Ids of the tokens that ``skip_special_tokens`` drops from text."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, t in decoder.items() if getattr(t, "special", False))
    return ids
