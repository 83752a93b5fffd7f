"""What the API does to a request before the engine sees it: parse the body, render the chat
template, tokenize. All of it runs on a small pool of worker threads, never on the event
loop, so that a large prompt or a slow template delays only its own call, not ``/health``
or the streams (the tokenizer releases the interpreter while it encodes).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

from pydantic import BaseModel

from zipage.server.protocol import ApiError, RequestLimits, find_surrogate, parse_body

CONTROL_MARK = "\ufdd0"  # a Unicode noncharacter: never in text the tokenizer was trained on


class Preprocessor:
    """Parse, render and tokenize API requests on ``workers`` threads, within ``limits``.

    ``trust_request_chat_template``: a request may replace the model's chat template with
    its own (``chat_template_kwargs.chat_template``); a template is a program, so this is
    off by default. ``escape_special_tokens``: special-token text inside messages (such as
    ``<|im_start|>system``) is tokenized as plain text, so only the template writes control
    tokens and a message cannot forge a turn.
    """

    def __init__(self, tokenizer, limits: RequestLimits, max_prompt_tokens: int, workers: int = 2,
                 trust_request_chat_template: bool = False, escape_special_tokens: bool = True):
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"preprocess workers must be an integer >= 1, got {workers!r}")
        self.tokenizer = tokenizer
        self.limits = limits.resolve(max_prompt_tokens, _longest_token_chars(tokenizer))
        self.trust_request_chat_template = trust_request_chat_template
        self.escape_special_tokens = escape_special_tokens
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="zipage-preprocess")
        self._special_tokens = _special_tokens(tokenizer) if escape_special_tokens else ()
        self._plain_encoder = None  # built on first use: a copy of the tokenizer that reads no special token
        self._plain_lock = threading.Lock()
        self._reserved_kwargs = _template_call_parameters(tokenizer)

    async def run(self, fn, *args):
        """``fn(*args)`` on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- on a worker thread ----------------------------------------------------
    def parse(self, raw: bytes, model_class: type[BaseModel]):
        return parse_body(raw, model_class, self.limits)

    def encode_prompts(self, prompts: list) -> list[list[int]]:
        """Token ids of each prompt (strings are tokenized as ``LLM.generate`` does; ids pass)."""
        if self.tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise ApiError(400, "this checkpoint has no tokenizer: give prompts as lists of token ids",
                           param="prompt")
        encoded = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        for i, ids in enumerate(encoded):
            self.limits.check_prompt_tokens(len(ids), "prompt", f"prompt {i}" if len(encoded) > 1 else "prompt")
        return encoded

    def encode_chat(self, messages: list[dict], template_kwargs: dict | None, tools: list[dict] | None = None
                    ) -> list[int]:
        """The chat template's rendering of ``messages`` (and ``tools``, OpenAI's function
        definitions, which the template writes where the model expects them) with a generation
        prompt, tokenized."""
        tokenizer = self.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
        kwargs = self._template_kwargs(template_kwargs)
        template = kwargs.pop("chat_template", None)  # trusted if here: its control tokens are real
        if tools:
            kwargs["tools"] = tools  # a reserved name: never from chat_template_kwargs
        marker = None
        if self._special_tokens and _holds_any([messages, kwargs], self._special_tokens):
            marker = f"{CONTROL_MARK}{secrets.token_hex(8)}{CONTROL_MARK}"  # unguessable: a client cannot forge it
            pattern = re.compile("|".join(re.escape(t) for t in self._special_tokens))
            messages, kwargs = _mark([messages, kwargs], pattern, marker)
        try:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=True, **kwargs)
        except Exception as error:  # noqa: BLE001 - a template may raise anything on odd input
            message = str(error)
            message = message if len(message) <= 200 else message[:197] + "..."
            raise ApiError(400, f"the chat template rejected the messages: {message}", param="messages") from None
        if not isinstance(text, str):
            raise ApiError(400, "the chat template did not render text", param="messages")
        limit = self.limits.max_prompt_chars
        if len(text) > limit:
            raise ApiError(400, f"the chat template renders the messages as {len(text)} characters; at most "
                                f"{limit} can fit the context (max_model_len)", param="messages")
        bad = find_surrogate(text)
        if bad is not None:
            raise ApiError(400, f"the rendered chat holds {bad}, a lone UTF-16 surrogate", param="chat_template_kwargs")
        ids = tokenizer.encode(text, add_special_tokens=False) if marker is None else self._encode_marked(text, marker)
        self.limits.check_prompt_tokens(len(ids), "messages", "the chat")
        return ids

    def _template_kwargs(self, template_kwargs: dict | None) -> dict:
        kwargs = dict(template_kwargs or {})
        if "chat_template" in kwargs and not self.trust_request_chat_template:
            raise ApiError(400, "chat_template_kwargs.chat_template: this server uses the model's chat template "
                                "and refuses one sent with a request (--trust-request-chat-template allows it)",
                           param="chat_template_kwargs.chat_template")
        reserved = sorted(set(kwargs) & self._reserved_kwargs)
        if reserved:
            raise ApiError(400, f"chat_template_kwargs may not set {reserved[0]!r}: it is an argument of the template "
                                "call, not a template variable", param=f"chat_template_kwargs.{reserved[0]}")
        return kwargs

    def _encode_marked(self, text: str, marker: str) -> list[int]:
        """Tokenize a chat rendered from marked input: a marked special token as plain text, the rest
        (the template's own control tokens among it) as usual. A marker left alone (a template that
        cut a marked token apart) still splits the text, so that nothing joins across it."""
        tokens = "|".join(re.escape(t) for t in self._special_tokens)
        pattern = re.compile(f"{re.escape(marker)}({tokens}){re.escape(marker)}|{re.escape(marker)}")
        ids: list[int] = []
        start = 0
        for match in pattern.finditer(text):
            if match.start() > start:
                ids += self.tokenizer.encode(text[start:match.start()], add_special_tokens=False)
            if match.group(1) is not None:
                ids += self._encode_plain(match.group(1))
            start = match.end()
        if start < len(text):
            ids += self.tokenizer.encode(text[start:], add_special_tokens=False)
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        """``text`` tokenized with special tokens read as ordinary text (the shared tokenizer is
        never switched to that mode: the engine thread decodes with it meanwhile)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a pure-Python tokenizer: this mode is a per-call argument
            return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        with self._plain_lock:
            if self._plain_encoder is None:
                from tokenizers import Tokenizer
                encoder = Tokenizer.from_str(backend.to_str())
                encoder.encode_special_tokens = True
                self._plain_encoder = encoder
        return self._plain_encoder.encode(text, add_special_tokens=False).ids


def _longest_token_chars(tokenizer) -> int:
    """The most characters one token stands for, bounded above by its vocabulary entry's length
    (a byte-level entry has a character per byte; other schemes spell a token at least as long)."""
    if tokenizer is None:
        return 1
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def _special_tokens(tokenizer) -> tuple[str, ...]:
    """The text of the tokenizer's special tokens (the control tokens of chat templates), longest first."""
    if tokenizer is None:
        return ()
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    tokens = {t.content for t in decoder.values() if getattr(t, "special", False) and t.content}
    tokens.update(t for t in getattr(tokenizer, "all_special_tokens", []) if t)
    return tuple(sorted(tokens, key=len, reverse=True))


def _template_call_parameters(tokenizer) -> frozenset[str]:
    """Names that ``apply_chat_template`` takes as its own arguments (not template variables)."""
    try:
        signature = inspect.signature(tokenizer.apply_chat_template)
    except (AttributeError, TypeError, ValueError):
        return frozenset()
    return frozenset(name for name, p in signature.parameters.items()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "chat_template")


def _holds_any(value, needles: tuple[str, ...]) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if any(n in item for n in needles):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())  # keys too: a template writes a schema's property names
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


def _mark(value, pattern: re.Pattern, marker: str):
    """``value`` with every special token in its strings and keys wrapped in ``marker``."""
    if isinstance(value, str):
        return pattern.sub(lambda m: f"{marker}{m.group()}{marker}", value)
    if isinstance(value, dict):
        return {_mark(key, pattern, marker): _mark(item, pattern, marker) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark(item, pattern, marker) for item in value]
    return value
