"""Log probabilities in OpenAI's response shapes, gathered from an API call's outputs.

Chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}``. Completions (``logprobs: k``, the
legacy shape): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.
A stream's chunk carries the log probabilities of the tokens that came since the last chunk.
"""

from __future__ import annotations

import math

from zipage.outputs import Logprob, RequestOutput

# JSON has no -inf (a token the processed distribution excludes): vLLM's stand-in.
MIN_LOGPROB = -9999.0


def _value(logprob: Logprob) -> float:
    return logprob.logprob if math.isfinite(logprob.logprob) else MIN_LOGPROB


def _text(logprob: Logprob) -> str:
    return logprob.decoded_token or ""


class CallLogprobs:
    """Per choice of one call: the positions observed and not yet taken into a response."""

    def __init__(self, num_choices: int, num_top: int, chat: bool):
        self.num_top, self.chat = num_top, chat
        self._pending: list[list] = [[] for _ in range(num_choices)]  # (token id, {id: Logprob})
        self._text_offset = [0] * num_choices  # completions: characters of the tokens taken so far

    def observe(self, index: int, output: RequestOutput) -> None:
        out = output.outputs[0]
        if out.logprobs is not None:
            self._pending[index].extend(zip(out.token_ids, out.logprobs))

    def take(self, index: int) -> dict:
        """The log probabilities of choice ``index``'s tokens observed since the last take."""
        positions, self._pending[index] = self._pending[index], []
        return self._chat(positions) if self.chat else self._completion(index, positions)

    def _top(self, position: dict) -> list:
        """The ``num_top`` most likely tokens, most likely first."""
        ranked = sorted(position.items(), key=lambda item: item[1].rank)
        return [item for item in ranked if item[1].rank <= self.num_top][:self.num_top]

    def _chat(self, positions: list) -> dict:
        def entry(logprob: Logprob) -> dict:
            text = _text(logprob)
            return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}
        return {"content": [dict(entry(position[token_id]),
                                 top_logprobs=[entry(lp) for _, lp in self._top(position)])
                            for token_id, position in positions]}

    def _completion(self, index: int, positions: list) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        offset = self._text_offset[index]
        for token_id, position in positions:
            sampled = position[token_id]
            tokens.append(_text(sampled))
            values.append(_value(sampled))
            top: dict[str, float] = {}
            for _, lp in sorted(position.items(), key=lambda item: item[1].rank):
                top.setdefault(_text(lp), _value(lp))  # tokens of the same text: the most likely one's
            tops.append(top)
            offsets.append(offset)
            offset += len(tokens[-1])
        self._text_offset[index] = offset
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class CallPromptLogprobs:
    """Per choice: its prompt's log probabilities in vLLM's shape, ``[null, {"<token id>": {"logprob",
    "rank", "decoded_token"}}, ...]`` (the first prompt token has none)."""

    def __init__(self, num_choices: int):
        self._prompts: list[list | None] = [None] * num_choices

    def observe(self, index: int, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None:
            self._prompts[index] = output.prompt_logprobs

    def take(self, index: int) -> list | None:
        positions = self._prompts[index]
        if positions is None:
            return None
        return [None if p is None else {str(token_id): {"logprob": _value(lp), "rank": lp.rank,
                                                        "decoded_token": _text(lp)}
                                        for token_id, lp in p.items()} for p in positions]


def call_prompt_logprobs(body, num_choices: int) -> CallPromptLogprobs | None:
    """The collector of a call that asks for its prompts' log probabilities, else None."""
    return None if body.prompt_logprobs is None else CallPromptLogprobs(num_choices)


def call_logprobs(body, num_choices: int, chat: bool) -> CallLogprobs | None:
    """The collector of a call that asks for log probabilities, else None."""
    k = body.num_logprobs
    return None if k is None else CallLogprobs(num_choices, k, chat)


def observers(*observe):
    """One ``observe(index, output)`` calling each of ``observe`` that is not None (None if none is)."""
    present = [fn for fn in observe if fn is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]

    def both(index, output):
        for fn in present:
            fn(index, output)
    return both
