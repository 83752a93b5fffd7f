"""The incremental detokenizer against decoding the whole output every step, and its cost per token."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zipage.engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from zipage.utils.loader import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(checkpoint_dir):
    return load_tokenizer(checkpoint_dir("qwen3"))


def reference(tokenizer, ids, stops, include_stop, skip_special):
    """Decode the whole output after each token: (step the request stops at or None, final text).

    Text counts once it does not end in an unfinished character; the first step whose text
    holds a stop string ends the request, cut at the earliest such string."""
    released = ""
    for step in range(len(ids)):
        full = tokenizer.decode(ids[:step + 1], skip_special_tokens=skip_special)
        if full.endswith("\ufffd"):
            continue
        released = full
        hits = [(at, stop) for stop in stops if (at := released.find(stop)) >= 0]
        if hits:
            at, stop = min(hits)
            return step, stop, released[:at + len(stop) if include_stop else at]
    full = tokenizer.decode(ids, skip_special_tokens=skip_special)  # at the end, unfinished characters too
    return None, None, full


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_detokenizer_matches_whole_output_decoding(tokenizer, data):
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.integers(0, vocab + 3), min_size=1, max_size=60), label="ids")
    skip_special = data.draw(st.booleans(), label="skip_special")
    text = tokenizer.decode(ids, skip_special_tokens=skip_special)
    # Stop strings taken from the text (so that they occur), some random ones, or none.
    stops = []
    for _ in range(data.draw(st.integers(0, 3), label="num_stops")):
        if text and data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(text) - 1))
            stops.append(text[start:start + data.draw(st.integers(1, 6))])
        else:
            stops.append(data.draw(st.text(alphabet="ab 1.\n", min_size=1, max_size=4)))
    include_stop = data.draw(st.booleans(), label="include_stop")
    hold = max((len(s) for s in stops), default=1) - 1
    stop_step, stop, expected = reference(tokenizer, ids, stops, include_stop, skip_special)

    for stream in (False, True):  # read whole at the end, or handed out piece by piece
        detok = IncrementalDetokenizer(tokenizer, stops, include_stop, skip_special)
        streamed = []
        for step, token in enumerate(ids):
            hit = detok.update(token)
            if hit is not None:
                assert (step, hit) == (stop_step, stop)
                break
            if stream:
                streamed.append(detok.take(hold))
        else:
            assert stop_step is None
            detok.flush()
        assert ("".join(streamed) + detok.take() if stream else detok.text) == expected


def test_stop_string_split_over_many_tokens_and_held_back_text(tokenizer):
    """A stop string that arrives one character per token: the streamed text never shows its start."""
    ids = tokenizer.encode("abc STOP here", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, ["STOP"], False, True)
    streamed = ""
    for token in ids:
        if detok.update(token) is not None:
            break
        streamed += detok.take(hold_back=3)
        assert "S" not in streamed
    assert streamed + detok.take() == "abc "


def test_work_per_token_does_not_grow_with_the_output(tokenizer):
    """Each update decodes a bounded tail, however long the output; the text stays whole."""

    class Counting:
        def __init__(self, inner):
            self.inner, self.longest = inner, 0

        def decode(self, ids, skip_special_tokens=False):
            self.longest = max(self.longest, len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    words = tokenizer.encode(" we check the result once more", add_special_tokens=False)
    ids = (words * 400)[:2500]
    counting = Counting(tokenizer)
    detok = IncrementalDetokenizer(counting, ["never appears"], False, True)
    streamed = []
    for token in ids:
        assert detok.update(token) is None
        streamed.append(detok.take(hold_back=12))
        assert len(detok._tail) <= CONTEXT_TOKENS + 2
        assert sum(map(len, detok._parts)) <= 12 + 64  # what it has not handed out, nothing older
    assert counting.longest <= CONTEXT_TOKENS + 2
    assert "".join(streamed) + detok.take() == tokenizer.decode(ids)
