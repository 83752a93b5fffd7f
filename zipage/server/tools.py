"""Tool calls: the function calls a chat answer holds, in OpenAI's shapes.

An answer becomes tool calls in one of three ways, chosen by the request's ``tool_choice``:

- ``"auto"`` with ``--tool-call-parser hermes``: the model writes each call among its text
  as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes 2 Pro form
  that Qwen2.5 and Qwen3 use). ``HermesParser`` takes the blocks out; the text around them
  is the answer's content. A block whose JSON is not a call (malformed, or no name) stays
  in the content as written, as vLLM leaves it.
- ``"required"``: the output is held by structured outputs to a JSON array of
  ``{"name", "arguments"}`` objects, one per call (``required_schema``); ``RequiredCalls``
  reads them.
- a named function: the output is held to that function's parameters; it is the
  arguments of one call (``NamedCall``).

Each reader takes the answer's text in pieces (``feed``), then ``finish``; ``take`` returns
what is ready since the last call: (content, tool-call deltas). A response is the reader fed
everything and taken once; a stream takes after every piece. So a streamed answer assembles
to exactly the response, however the text was cut. To keep that promise for malformed
blocks, ``HermesParser`` sends a call whole once its block has closed (a block cannot be
judged before), as one delta carrying index, id, type, name and arguments; ``NamedCall``,
whose output the grammar keeps valid, streams its arguments as they come.

``ChatAnswers`` puts it together per chat call: the thinking split off first
(``--reasoning-parser``, see ``zipage.server.reasoning``), then the rest read for tool calls.
"""

from __future__ import annotations

import json
import secrets

from zipage.server.reasoning import ReasoningParser

START_TAG, END_TAG = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)


def check_parser_name(name: str | None) -> None:
    if name is not None and name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(PARSERS)}")


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    """A ``message.tool_calls`` entry."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of ``{"name": ..., "arguments": {...}}``, or None if ``text``
    is not one. Arguments given as a string holding a JSON object are taken too; absent ones are {}."""
    try:
        call = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of ``tool_choice="required"``: one or more calls of the given functions
    (at most one unless ``parallel``), each ``{"name", "arguments"}`` with its own parameters."""
    options = [{"type": "object",
                "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                               "arguments": function_parameters(tool)},
                "required": ["name", "arguments"]} for tool in tools]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def function_parameters(tool: dict) -> dict:
    """A tool's parameter schema (a function without parameters takes an empty object)."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that ``tag`` begins with (and is not all of it)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class HermesParser:
    """``<tool_call>...</tool_call>`` blocks out of streamed text (see the module's docstring).

    The content is the text outside the blocks that are calls, less the stretches of it that are
    only whitespace between or around calls (the line breaks a model writes between blocks).
    Whitespace that may turn out to be such a stretch is held back until text follows it; an
    answer without calls is returned as written. ``parallel=False``: only the first call is kept.
    An unclosed block at the end is a call if its JSON is whole (the output ended at its
    closing tag, e.g. on a stop string).
    """

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.calls: list[dict] = []  # every call kept so far, whole
        self.saw_call = False  # a call was read (kept or not): whitespace around calls is dropped
        self._buffer = ""  # text not yet read: a tail that may begin a tag, or an open block
        self._in_block = False
        self._scanned = 0  # of an open block: where to look for the end tag from
        self._held = ""  # the current stretch of content, whitespace only so far
        self._live = False  # the current stretch holds more than whitespace: it goes out as it comes
        self._content: list[str] = []
        self._deltas: list[dict] = []

    def feed(self, text: str) -> None:
        if text:
            self._buffer += text
            self._read(final=False)

    def finish(self) -> None:
        self._read(final=True)
        if self._held and not self.saw_call:
            self._content.append(self._held)
        self._held = ""

    def take(self) -> tuple[str, list[dict]]:
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason is not None else reason

    def _read(self, final: bool) -> None:
        while True:
            if not self._in_block:
                at = self._buffer.find(START_TAG)
                if at < 0:
                    keep = 0 if final else _partial_tag_length(self._buffer, START_TAG)
                    self._text(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return
                self._text(self._buffer[:at])
                self._buffer = self._buffer[at + len(START_TAG):]
                self._in_block, self._scanned = True, 0
            at = self._buffer.find(END_TAG, self._scanned)
            if at < 0:
                if final:
                    self._block(self._buffer, closed=False)
                    self._buffer, self._in_block = "", False
                else:
                    self._scanned = max(0, len(self._buffer) - len(END_TAG) + 1)
                return
            self._block(self._buffer[:at], closed=True)
            self._buffer, self._in_block = self._buffer[at + len(END_TAG):], False

    def _block(self, body: str, closed: bool) -> None:
        call = parse_call(body)
        if call is None:  # not a call: content, as written
            self._text(START_TAG + body + (END_TAG if closed else ""))
            return
        self.saw_call = True
        self._held, self._live = "", False  # a stretch of whitespace before it is dropped; a new one begins
        if self.parallel or not self.calls:
            entry = tool_call(new_call_id(), *call)
            self._deltas.append({"index": len(self.calls), **entry})
            self.calls.append(entry)

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._live:
            self._content.append(text)
            return
        self._held += text
        if not self._held.isspace():
            self._content.append(self._held)
            self._held, self._live = "", True


class RequiredCalls:
    """The calls of ``tool_choice="required"``: a JSON array whose elements are read as each closes.

    Each whole element goes out as one call. An answer with no whole call (cut by ``max_tokens``)
    is returned as content, as written; once there is a call, the content is null.
    """

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.calls: list[dict] = []
        self._text: list[str] = []  # all of it while there is no call yet
        self._element: list[str] = []  # the open element's text
        self._depth = 0
        self._in_string = self._escape = False
        self._content: list[str] = []
        self._deltas: list[dict] = []

    def feed(self, text: str) -> None:
        if not self.calls:
            self._text.append(text)
        start = 0
        for i, char in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
                if self._depth == 2:  # an element of the array opens
                    start, self._element = i, []
            elif char in "]}":
                if self._depth == 2:
                    self._element.append(text[start:i + 1])
                    self._call("".join(self._element))
                    self._element = []
                self._depth -= 1
        if self._depth >= 2:
            self._element.append(text[start:])

    def _call(self, element: str) -> None:
        call = parse_call(element)
        if call is None or not (self.parallel or not self.calls):
            return
        entry = tool_call(new_call_id(), *call)
        self._deltas.append({"index": len(self.calls), **entry})
        self.calls.append(entry)
        self._text = []

    def finish(self) -> None:
        if not self.calls:
            self._content.append("".join(self._text))
            self._text = []

    def take(self) -> tuple[str, list[dict]]:
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason


class NamedCall:
    """The one call of a named ``tool_choice``: the whole output is its arguments (streamed as they
    come; the first delta carries the id and the name). The finish reason stays the engine's, as
    vLLM and OpenAI answer a forced function."""

    def __init__(self, name: str):
        self.name = name
        self.call_id = new_call_id()
        self._arguments: list[str] = []
        self._deltas: list[dict] = []
        self._finished = False

    @property
    def calls(self) -> list[dict]:
        return [tool_call(self.call_id, self.name, "".join(self._arguments))] if self._finished else []

    def feed(self, text: str) -> None:
        if text:
            self._delta(text)

    def finish(self) -> None:
        if not self._arguments:
            self._delta("")
        self._finished = True

    def _delta(self, text: str) -> None:
        if self._arguments:
            self._deltas.append({"index": 0, "function": {"arguments": text}})
        else:
            self._deltas.append({"index": 0, **tool_call(self.call_id, self.name, text)})
        self._arguments.append(text)

    def take(self) -> tuple[str, list[dict]]:
        deltas, self._deltas = self._deltas, []
        return "", deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return reason


class _Answer:
    """One choice: its reasoning splitter (or none), then its tool-call reader (or none)."""

    def __init__(self, splitter, reader):
        self.splitter, self.reader = splitter, reader
        self._reasoning: list[str] = []
        self._content: list[str] = []  # without a reader

    def feed(self, text: str, token_ids, finished: bool) -> None:
        if self.splitter is not None:
            self.splitter.feed(text, token_ids)
            if finished:
                self.splitter.finish()
            reasoning, text = self.splitter.take()
            if reasoning:
                self._reasoning.append(reasoning)
        if self.reader is None:
            if text:
                self._content.append(text)
        else:
            self.reader.feed(text)
            if finished:
                self.reader.finish()

    def take(self) -> tuple[str, str, list[dict]]:
        """(reasoning, content, tool-call deltas) ready since the last call."""
        reasoning = "".join(self._reasoning)
        self._reasoning = []
        if self.reader is None:
            content, deltas = "".join(self._content), []
            self._content = []
        else:
            content, deltas = self.reader.take()
        return reasoning, content, deltas


class ChatAnswers:
    """The answers of one chat call's choices in the API's shapes: ``observe`` every output as it
    comes; then ``message`` (a whole response) or ``delta`` (a stream chunk) per choice, and
    ``finish_reason``. ``reasoning``: the server's parser, or None; ``make_reader``: a new tool-call
    reader per choice, or None."""

    def __init__(self, num_choices: int, reasoning: ReasoningParser | None, in_reasoning: bool,
                 skip_special_tokens: bool, make_reader=None):
        self.with_reasoning = reasoning is not None
        self.answers = [_Answer(None if reasoning is None else reasoning.start(in_reasoning, skip_special_tokens),
                                None if make_reader is None else make_reader()) for _ in range(num_choices)]

    def observe(self, index: int, output) -> None:
        out = output.outputs[0]
        self.answers[index].feed(out.text, out.token_ids, output.finished)

    def message(self, index: int) -> dict:
        """A response's ``message``: content null when empty beside thinking or tool calls, as vLLM."""
        answer = self.answers[index]
        reasoning, content, _ = answer.take()
        calls = [] if answer.reader is None else answer.reader.calls
        saw_reasoning = answer.splitter is not None and answer.splitter.saw_reasoning
        message = {"role": "assistant", "content": content}
        if not content and (saw_reasoning or calls or isinstance(answer.reader, (RequiredCalls, NamedCall))):
            message["content"] = None
        if self.with_reasoning:
            message["reasoning"] = message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = calls
        return message

    def delta(self, index: int) -> dict:
        """A chunk's ``delta``: the reasoning, the content and the tool calls ready since the last one."""
        reasoning, content, deltas = self.answers[index].take()
        delta = {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning else {}
        if content:
            delta["content"] = content
        if deltas:
            delta["tool_calls"] = deltas
        return delta

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        reader = self.answers[index].reader
        return reason if reader is None else reader.finish_reason(reason)
