"""Structured output: grammars that constrain what a request may generate.

A request asks for one of: a JSON schema, any JSON object, a regular expression, one of
a list of strings, an EBNF grammar (xgrammar's syntax) or an xgrammar structural tag
(``StructuredOutputsParams``, vLLM's ``structured_outputs``). xgrammar compiles it
against the tokenizer's vocabulary once (compiled grammars are cached by their text) and
gives each request a matcher, which says, from the tokens accepted so far, which tokens
may come next: a bitmask of one bit per token of the model's vocabulary.

Where each part runs:

- the engine accepts every sampled token into the request's matcher when the token
  reaches the host (``RequestGrammar.accept``), one token per step, and stops the
  request when the grammar is complete;
- the runner fills the step's bitmask rows on the host (``fill_bitmasks``, several
  threads), copies them to the device with the step's other inputs, and the sampler
  masks the disallowed tokens to ``-inf`` there (``apply_token_bitmask``), before
  temperature, top-k/top-p/min-p and the draw. The [batch, vocab] logits never leave
  the device.

With asynchronous scheduling a decode step is launched before the previous step's
tokens are on the host, but a request's bitmask depends on its previous token. A step
holding a constrained request therefore queues its forward (the CUDA graph) at once,
then waits for the previous step's tokens, accepts them, fills the bitmask and only
then queues the sampler: the device runs the forward while the host works on the
grammar, and every other request of the batch keeps its place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, fields

import torch

from zipage.sampling_params import ParameterError

MAX_CHOICES = 1024  # strings a ``choice`` may list
CACHE_LIMIT_BYTES = 256 << 20  # compiled grammars kept for reuse (least recently used go first)


def _threads(limit: int = 8) -> int:
    return max(1, min(limit, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match: exactly one of the fields.

    ``json``: a JSON schema (a dict or its JSON text); ``json_object``: any JSON object;
    ``regex``: a regular expression; ``choice``: one of these strings; ``grammar``: an
    EBNF grammar in xgrammar's syntax (rule ``root`` first); ``structural_tag``: an
    xgrammar structural tag (JSON text)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self):
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(f.name for f in fields(self))
            raise ValueError(f"structured_outputs needs exactly one of {names}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its JSON text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if (isinstance(choice, str) or not isinstance(choice, SequenceOf) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {choice!r}")
            if len(choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice lists {len(choice)} strings; at most {MAX_CHOICES}")
            object.__setattr__(self, "choice", list(choice))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """The kind and its text: what a compiled grammar is cached under."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json" and isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(value)
        elif kind == "json_object":
            value = ""
        return kind, value


def _xgrammar():
    try:
        import xgrammar
    except ImportError as error:  # a declared dependency: only a broken install lacks it
        raise RuntimeError("structured output needs the xgrammar package (pip install xgrammar)") from error
    return xgrammar


def grammar_compiler_for(runner_name: str, supported: bool, tokenizer, vocab_size: int,
                         stop_token_ids, disable_any_whitespace: bool) -> GrammarCompiler:
    """The ``GrammarCompiler`` of an engine whose runner is ``runner_name``, or the ValueError a
    request for structured outputs gets when the runner (``supported``) or the checkpoint (no
    tokenizer) cannot apply one."""
    if not supported:
        raise ValueError(f"structured_outputs: this engine's runner ({runner_name}) does not apply token bitmasks")
    if tokenizer is None:
        raise ValueError("structured_outputs needs the checkpoint's tokenizer, and this one has none")
    return GrammarCompiler(tokenizer, vocab_size, sorted(stop_token_ids), any_whitespace=not disable_any_whitespace)


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and model vocabulary (thread-safe;
    compiled grammars are kept in xgrammar's cache, bounded by ``CACHE_LIMIT_BYTES``, so a schema
    in use is compiled once). Sizes are bounded by the caller (the server's limits); the time a
    grammar takes to compile is not."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int | None = None,
                 any_whitespace: bool = True):
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads or _threads(),
                                             cache_limit_bytes=CACHE_LIMIT_BYTES)
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace  # JSON schemas: whitespace between tokens as JSON allows

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar, or ``ParameterError`` naming ``structured_outputs`` and the reason."""
        kind, text = params.key()
        compiler = self._compiler
        try:
            if kind == "json":
                return compiler.compile_json_schema(text, any_whitespace=self.any_whitespace)
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            if kind == "grammar":
                return compiler.compile_grammar(text)
            return compiler.compile_structural_tag(text)
        except Exception as error:  # xgrammar raises several types (RuntimeError, ValueError, its own)
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ParameterError("structured_outputs",
                                 f"structured_outputs.{kind} cannot be compiled: {reason[:500]}") from None

    def matcher(self, params: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(_xgrammar().GrammarMatcher(self.compile(params)), params.kind)


class RequestGrammar:
    """One request's matcher: the tokens it accepted decide the tokens it allows next."""

    def __init__(self, matcher, kind: str):
        self.matcher = matcher
        self.kind = kind
        self.num_accepted = 0

    def accept(self, token_id: int) -> None:
        """Advance by one sampled token; ``ValueError`` if the grammar does not allow it (the
        sampler masks such tokens, so this means the two disagree)."""
        if not self.matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} does not continue the request's {self.kind} grammar "
                             f"(after {self.num_accepted} accepted tokens)")
        self.num_accepted += 1

    @property
    def is_terminated(self) -> bool:
        """The output is complete (the grammar accepted its end)."""
        return self.matcher.is_terminated()


class BitmaskFiller:
    """Fills the bitmask rows of a step's constrained requests on the host, in parallel."""

    def __init__(self, max_threads: int | None = None):
        self._batch = _xgrammar().BatchGrammarMatcher(max_threads or _threads())

    def fill(self, grammars: list[RequestGrammar], bitmask: torch.Tensor) -> None:
        """Rows ``0..len(grammars)-1`` of ``bitmask`` (int32 on the host) for ``grammars``."""
        self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``logits`` [batch, vocab] with the tokens that ``bitmask`` [G, ceil(vocab / 32)] (int32,
    bit ``t % 32`` of word ``t // 32`` set = token t allowed) forbids at ``rows`` [G] set to
    ``-inf`` (out of place)."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]
    masked = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits.index_put((rows,), masked)
