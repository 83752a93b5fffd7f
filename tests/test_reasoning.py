"""Reasoning output (``--reasoning-parser``): the splitter over every way a stream can cut the
tags, the prompt's think state, and the server with a runner whose tokens the test scripts."""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest

from zipage.engine.detokenizer import IncrementalDetokenizer
from zipage.server.reasoning import PARSERS, ReasoningParser, check_parser_name
from zipage.utils.checkpoint import build_tokenizer

OUTPUTS = [
    "<think>\nLet x = 12.\n</think>\n\nThe answer is 42.",  # Qwen3: the model opens the block
    "Let x = 12 and y = 30.</think>The answer",  # R1: the prompt opened it
    "still thinking about x < y and </thin",  # ends while thinking, a tag's start at the end
    "</think>only the answer",  # an empty think block
    "a <b> </thinker> <think> c </think> d <think> e </think>",  # tags after the first end are content
    "<think></think>",
]


def reference(text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
    """vLLM's split of a whole output: (reasoning, content), None for an empty part."""
    if not in_reasoning:
        return None, text
    end = text.find("</think>")
    head = text if end < 0 else text[:end]
    if "<think>" in head:
        at = head.find("<think>")
        head = head[:at] + head[at + len("<think>"):]
    tail = "" if end < 0 else text[end + len("</think>"):]
    return head or None, tail or None


@pytest.fixture(scope="module", params=["qwen3", "qwen3_special", "r1_text"])
def tokenizer(request):
    return request.param, build_tokenizer(thinking=request.param)


def stream_chunks(tok, ids: list[int], cuts: tuple[int, ...], skip_special_tokens: bool):
    """(text, token ids) of each chunk the engine would stream, cut after the token indices ``cuts``."""
    detok = IncrementalDetokenizer(tok, [], False, skip_special_tokens)
    chunks, start = [], 0
    for end in [*cuts, len(ids)]:
        for token in ids[start:end]:
            detok.update(token)
        chunks.append((detok.take(), ids[start:end]))
        start = end
    detok.flush()
    chunks.append((detok.take(), []))
    return chunks


def split_stream(parser, chunks, in_reasoning: bool, skip_special_tokens: bool = True):
    splitter = parser.start(in_reasoning, skip_special_tokens)
    reasoning, content = "", ""
    for text, ids in chunks:
        splitter.feed(text, ids)
        r, c = splitter.take()
        reasoning, content = reasoning + r, content + c
    splitter.finish()
    r, c = splitter.take()
    reasoning, content = reasoning + r, content + c
    return reasoning or None, (content or None) if splitter.saw_reasoning else content


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("output", OUTPUTS)
def test_split_is_the_same_however_the_stream_cuts_the_tags(tokenizer, name, output):
    kind, tok = tokenizer
    parser = ReasoningParser(name, tok)
    ids = tok.encode(output, add_special_tokens=False)
    if kind == "r1_text":
        assert len(tok.encode("</think>", add_special_tokens=False)) > 1  # a tag spans tokens, so chunks
    expected = reference(output, in_reasoning=True)
    if kind == "qwen3_special":  # skip_special_tokens drops the tags the answer holds too
        expected = tuple(p and (p.replace("<think>", "").replace("</think>", "") or None) for p in expected)
    cuttings = [(), tuple(range(1, len(ids)))]  # all in one chunk; a token a chunk
    cuttings += [(i,) for i in range(1, len(ids))]  # every two-chunk split
    cuttings += list(itertools.combinations(range(1, len(ids)), 2))[::7]
    for cuts in cuttings:
        chunks = stream_chunks(tok, ids, cuts, skip_special_tokens=True)
        assert split_stream(parser, chunks, True) == expected, f"cut after tokens {cuts}"


def test_text_tags_split_at_every_character():
    """Tags in plain text: cut the text at every pair of characters, whatever the tokens."""
    tok = build_tokenizer(thinking="r1_text")
    parser = ReasoningParser("deepseek_r1", tok)
    for output in OUTPUTS:
        expected = reference(output, True)
        for i, j in itertools.combinations(range(len(output) + 1), 2):
            chunks = [(output[:i], []), (output[i:j], []), (output[j:], [])]
            assert split_stream(parser, chunks, True) == expected, (output, i, j)


def test_output_that_starts_as_answer_is_never_split():
    tok = build_tokenizer(thinking="qwen3")
    parser = ReasoningParser("qwen3", tok)
    for output in OUTPUTS:
        chunks = stream_chunks(tok, tok.encode(output), (1, 3), True)
        assert split_stream(parser, chunks, False) == (None, output)


def test_special_tags_kept_in_text_are_split_by_text():
    """skip_special_tokens=false: the special tags are in the text and are cut out of it."""
    tok = build_tokenizer(thinking="qwen3_special")
    parser = ReasoningParser("qwen3", tok)
    output = "<think>x y</think> answer"
    ids = tok.encode(output)
    for cuts in [(), (1,), (2,), (3,), tuple(range(1, len(ids)))]:
        chunks = stream_chunks(tok, ids, cuts, skip_special_tokens=False)
        assert split_stream(parser, chunks, True, skip_special_tokens=False) == ("x y", " answer")


# -- the prompt ---------------------------------------------------------------------------------
USER = [{"role": "user", "content": "What is 12 + 30?"}]
TOOL_ROUND = USER + [{"role": "assistant", "content": "calling", "reasoning_content": "I need a tool"},
                     {"role": "tool", "content": "42"}]


def prompt_ids(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_special", "r1", "r1_text"])
@pytest.mark.parametrize("name", sorted(PARSERS))
def test_prompt_decides_whether_the_output_starts_thinking(kind, name):
    tok = build_tokenizer(thinking=kind)
    parser = ReasoningParser(name, tok)

    def starts(messages, **kwargs):
        text = prompt_ids(tok, messages, **kwargs)
        return parser.starts_in_reasoning(tok.encode(text, add_special_tokens=False), kwargs or None)

    assert starts(USER)
    # an earlier turn's closed think block does not close this one
    assert starts(TOOL_ROUND)
    disabled = starts(USER, enable_thinking=False)
    # Qwen3's template closes an empty block; qwen3 reads the flag itself too; R1's template ignores it
    assert disabled is (kind.startswith("r1") and name == "deepseek_r1")


def test_qwen3_template_gets_the_reasoning_of_earlier_turns():
    tok = build_tokenizer(thinking="qwen3")
    assert "<think>\nI need a tool\n</think>" in prompt_ids(tok, TOOL_ROUND)


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        check_parser_name("qwen")
    with pytest.raises(ValueError, match="choose from"):
        ReasoningParser("r1", build_tokenizer())


def test_serve_command_takes_the_parser_names(capsys):
    from zipage.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "m", "--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    assert parser.parse_args(["serve", "m"]).reasoning_parser is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--reasoning-parser", "qwen"])
    assert "'deepseek_r1', 'qwen3'" in capsys.readouterr().err


# -- the server ---------------------------------------------------------------------------------
class ScriptedRunner:
    """A model-free runner: every request's output is ``script`` (token ids), then EOS."""

    num_query_slots = 0
    last_prepare_s = 0.0

    def __init__(self, vocab_size: int, eos_id: int):
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.num_blocks = 64
        self.script: list[int] = []

    def execute(self, seqs, is_prefill, eos_token_ids, async_callback=None):
        if async_callback is not None:
            async_callback()
        return [self.script[s.num_output_tokens] if s.num_output_tokens < len(self.script) else self.eos_id
                for s in seqs if s.samples]

    def forget(self, seqs):
        pass

    def close(self):
        pass


MODEL = "thinker"


@pytest.fixture(scope="module", params=["qwen3", "qwen3_special", "r1_text"])
def server(request, tmp_path_factory):
    from zipage.config import EngineConfig
    from zipage.engine.llm_engine import LLMEngine
    from zipage.server.app import create_app
    from zipage.server.background import ServerThread
    from zipage.utils.checkpoint import make_checkpoint

    kind = request.param
    path = make_checkpoint(str(tmp_path_factory.mktemp(f"think-{kind}")), with_weights=False, thinking=kind)
    tok = build_tokenizer(thinking=kind)
    config = EngineConfig.from_kwargs(path, device="cpu", block_size=16, max_model_len=512, max_num_seqs=4)
    runner = ScriptedRunner(len(tok), tok.eos_token_id)
    engine = LLMEngine(config, runner=runner)
    parser = "deepseek_r1" if kind.startswith("r1") else "qwen3"
    app = create_app(engine, MODEL, stream_interval=0, reasoning_parser=parser)
    with ServerThread(app) as served:
        served.kind, served.tok, served.runner = kind, tok, runner
        served.client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield served


def chat(server, output: str, messages=USER, stream=False, **kwargs):
    server.runner.script = server.tok.encode(output, add_special_tokens=False)
    return server.client.chat.completions.create(model=MODEL, messages=messages, stream=stream, **kwargs)


def streamed(chunks) -> tuple[str | None, str | None, str | None, str]:
    """(reasoning, reasoning_content, content, finish_reason) of a stream, joined."""
    parts = {"reasoning": [], "reasoning_content": [], "content": []}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            extra = delta.model_extra or {}
            parts["reasoning"].append(extra.get("reasoning") or "")
            parts["reasoning_content"].append(extra.get("reasoning_content") or "")
            parts["content"].append(delta.content or "")
            assert not (extra.get("reasoning") and "<think>" in extra["reasoning"])
            finish = choice.finish_reason or finish
    return tuple("".join(p) or None for p in parts.values()) + (finish,)


ANSWERED = "<think>\nLet x = 12 and y = 30.\n</think>\n\nThe answer is 42."


def test_server_puts_the_thinking_apart(server):
    expected_reasoning = "\nLet x = 12 and y = 30.\n"
    response = chat(server, ANSWERED)
    message = response.choices[0].message
    assert message.content == "\n\nThe answer is 42."
    assert message.model_extra["reasoning"] == expected_reasoning
    assert message.model_extra["reasoning_content"] == expected_reasoning
    assert response.choices[0].finish_reason == "stop"
    chunks = list(chat(server, ANSWERED, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert streamed(chunks) == (expected_reasoning, expected_reasoning, "\n\nThe answer is 42.", "stop")


def test_server_output_that_ends_thinking_is_all_reasoning(server):
    response = chat(server, "Let x = 12 and y = 30. Then", max_tokens=6)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "length"
    assert message.content is None
    text = server.tok.decode(server.runner.script[:6], skip_special_tokens=True)
    assert message.model_extra["reasoning_content"] == text
    assert streamed(chat(server, "Let x = 12 and y = 30. Then", stream=True, max_tokens=6)) == (
        text, text, None, "length")


def test_server_without_thinking_gives_all_content(server):
    disabled = {"chat_template_kwargs": {"enable_thinking": False}}
    response = chat(server, "The answer is 42.", extra_body=disabled)
    message = response.choices[0].message
    if server.kind.startswith("r1"):  # R1's template opens the block whatever the flag
        assert message.content is None and message.model_extra["reasoning"] == "The answer is 42."
        return
    assert message.content == "The answer is 42."
    assert message.model_extra["reasoning"] is None and message.model_extra["reasoning_content"] is None
    assert streamed(chat(server, "The answer is 42.", stream=True, extra_body=disabled)) == (
        None, None, "The answer is 42.", "stop")


def test_server_takes_earlier_reasoning_in_messages(server):
    for field in ("reasoning", "reasoning_content"):
        messages = USER + [{"role": "assistant", "content": "calling", field: "I need a tool"},
                           {"role": "tool", "content": "42"}]
        message = chat(server, ANSWERED, messages=messages).choices[0].message
        assert message.content == "\n\nThe answer is 42."
    bad = USER + [{"role": "assistant", "content": "x", "reasoning": ["not", "text"]}]
    with pytest.raises(openai.BadRequestError) as error:
        chat(server, ANSWERED, messages=bad)
    assert error.value.body["param"] == "messages.1" and "reasoning must be a string" in error.value.body["message"]


def test_server_completions_are_not_split(server):
    server.runner.script = server.tok.encode(ANSWERED, add_special_tokens=False)
    text = server.client.completions.create(model=MODEL, prompt="Let x", max_tokens=64,
                                            extra_body={"skip_special_tokens": False}).choices[0].text
    assert text == ANSWERED
    body = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Let x", "max_tokens": 64},
                      timeout=60).json()
    assert "reasoning" not in body["choices"][0]


def test_langchain_deepseek_client_reads_the_reasoning(server):
    """LangChain's DeepSeek-convention client (``ChatDeepSeek``) reads ``reasoning_content``."""
    from langchain_deepseek import ChatDeepSeek as chat_deepseek  # a test dependency (pyproject.toml)

    model = chat_deepseek(model=MODEL, api_base=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    server.runner.script = server.tok.encode(ANSWERED, add_special_tokens=False)
    reply = model.invoke("What is 12 + 30?")
    assert reply.content == "\n\nThe answer is 42."
    assert reply.additional_kwargs["reasoning_content"] == "\nLet x = 12 and y = 30.\n"
    reasoning, content = "", ""
    for chunk in model.stream("What is 12 + 30?"):
        reasoning += chunk.additional_kwargs.get("reasoning_content", "")
        content += chunk.content
    assert (reasoning, content) == ("\nLet x = 12 and y = 30.\n", "\n\nThe answer is 42.")
