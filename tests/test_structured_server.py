"""Structured outputs through the server: ``response_format``, ``structured_outputs``, and the
tool choices that hold the output to the tools' schemas (``"required"``, a named function),
with a tiny random model whose every token the grammar decides, driven by the official client.

A random model writes whatever the grammar lets it, so each schema here is one a short output
completes (enums, bounded strings); the checks are that the output matches, that a stream
assembles to the whole response, and that a grammar which cannot compile is a 400 naming the
field the request used.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.conftest import make_llm
from tests.test_tools import QWEN3_TOOLS_TEMPLATE, TOOLS, streamed, whole, without_ids
from zipage.server.app import create_app
from zipage.server.background import ServerThread
from zipage.utils.checkpoint import build_tokenizer, make_checkpoint

pytest.importorskip("xgrammar")

MODEL = "tiny"
TIMEOUT = 60
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]},
                                           "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
          "required": ["city", "days", "code"], "additionalProperties": False}
# Tools whose parameters a short output completes.
def enum_tool(name: str, description: str, key: str, values: list[str]) -> dict:
    parameters = {"type": "object", "properties": {key: {"enum": values}}, "required": [key],
                  "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


SMALL_TOOLS = [enum_tool("get_weather", "The weather in a city now.", "city", ["Paris", "Rome"]),
               enum_tool("get_time", "The time in a city now.", "zone", ["UTC", "CET"])]
ARGUMENTS = {"get_weather": ("city", {"Paris", "Rome"}), "get_time": ("zone", {"UTC", "CET"})}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny model with Qwen3's tools template, the qwen3 reasoning parser and hermes tool calls
    (its own checkpoint: the outputs below are those of these weights)."""
    path = make_checkpoint(str(tmp_path_factory.mktemp("structured")), initializer_range=0.05, seed=0, thinking="qwen3")
    tok = build_tokenizer(thinking="qwen3")
    tok.chat_template = QWEN3_TOOLS_TEMPLATE
    tok.save_pretrained(path)
    llm = make_llm(path, block_size=16, max_num_seqs=8, max_model_len=1024)
    app = create_app(llm.engine, MODEL, stream_interval=0, reasoning_parser="qwen3", tool_call_parser="hermes",
                     enable_auto_tool_choice=True)
    with ServerThread(app) as server:
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        yield server


def chat(served, stream=False, messages=USER, **kwargs):
    kwargs.setdefault("max_tokens", 96)
    kwargs.setdefault("frequency_penalty", 2.0)  # else the random model may fill a JSON gap with whitespace
    kwargs.setdefault("temperature", 0)
    return served.client.chat.completions.create(model=MODEL, messages=messages, stream=stream, **kwargs)


def check_schema_value(value):
    assert isinstance(value, dict) and set(value) == {"city", "days", "code"}, value
    assert value["city"] in ("Paris", "Rome") and value["days"] in (1, 2, 3) and re.fullmatch("[A-Z]{3}", value["code"])


def check_call(name: str, arguments: dict):
    key, allowed = ARGUMENTS[name]
    assert set(arguments) == {key} and arguments[key] in allowed, (name, arguments)


def test_response_format_json_schema(served):
    response_format = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    response = chat(served, response_format=response_format)
    reasoning, content, calls, finish = whole(response)
    assert (reasoning, calls, finish) == (None, [], "stop")  # held from its first token: no thinking
    check_schema_value(json.loads(content))
    assert streamed(chat(served, stream=True, response_format=response_format)) == (None, content, [], "stop")


def test_response_format_json_object(served):
    # Sampled: greedy, this model writes one long key (any key goes).
    response = chat(served, response_format={"type": "json_object"}, max_tokens=200, temperature=1.0, seed=2)
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_regex_choice_and_grammar(served):
    regex = "(yes|no), [0-9]{2}"
    content = chat(served, extra_body={"structured_outputs": {"regex": regex}}).choices[0].message.content
    assert re.fullmatch(regex, content)
    colours = ["red", "green", "blue"]
    assert chat(served, extra_body={"structured_outputs": {"choice": colours}}).choices[0].message.content in colours
    grammar = 'root ::= "x=" [0-9] [0-9]? ";"'
    content = chat(served, extra_body={"structured_outputs": {"grammar": grammar}}).choices[0].message.content
    assert re.fullmatch("x=[0-9][0-9]?;", content)
    completion = served.client.completions.create(model=MODEL, prompt="The colour is", max_tokens=8, temperature=0,
                                                  extra_body={"structured_outputs": {"choice": colours}})
    assert completion.choices[0].text in colours
    response_format = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}
    completion = served.client.completions.create(model=MODEL, prompt="The forecast:", max_tokens=96, temperature=0,
                                                  frequency_penalty=2.0,
                                                  extra_body={"response_format": response_format})
    check_schema_value(json.loads(completion.choices[0].text))


def test_required_tool_choice_yields_valid_calls(served):
    response = chat(served, tools=SMALL_TOOLS, tool_choice="required", max_tokens=160)
    result = whole(response)
    assert result[0] is None and result[1] is None and result[3] == "tool_calls" and result[2]
    for _, name, arguments in result[2]:
        check_call(name, json.loads(arguments))
    assert without_ids(streamed(chat(served, stream=True, tools=SMALL_TOOLS, tool_choice="required",
                                     max_tokens=160))) == without_ids(result)
    single = whole(chat(served, tools=SMALL_TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=160))
    assert len(single[2]) == 1


def test_named_tool_choice_yields_that_call(served):
    named = {"type": "function", "function": {"name": "get_time"}}
    response = chat(served, tools=SMALL_TOOLS, tool_choice=named)
    result = whole(response)
    assert (result[0], result[1], result[3]) == (None, None, "stop") and len(result[2]) == 1
    call_id, name, arguments = result[2][0]
    assert name == "get_time" and call_id.startswith("call_")
    check_call(name, json.loads(arguments))
    assert without_ids(streamed(chat(served, stream=True, tools=SMALL_TOOLS, tool_choice=named))) == without_ids(result)


def test_hermes_reads_a_tool_call_the_model_was_held_to(served):
    """A regex makes the random model write a Hermes tool call; ``tool_choice="auto"`` reads it."""
    regex = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
    response = chat(served, tools=TOOLS, extra_body={"structured_outputs": {"regex": regex}})
    result = without_ids(whole(response))
    assert result[:2] == (None, "Checking.\n") and result[3] == "tool_calls"
    assert [name for name, _ in result[2]] == ["get_weather"] and result[2][0][1]["city"] in ("Paris", "Rome")
    assert without_ids(streamed(chat(served, stream=True, tools=TOOLS,
                                     extra_body={"structured_outputs": {"regex": regex}}))) == result


def test_grammars_that_cannot_compile_name_the_field(served):
    def error(**kwargs):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(served, **kwargs)
        return caught.value.body["param"], caught.value.body["message"]

    bad_schema = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
    param, message = error(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}})
    assert param == "response_format" and "cannot be compiled" in message
    param, message = error(extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert param == "structured_outputs" and "regex" in message
    bad_tool = {"type": "function", "function": {"name": "odd", "parameters": {"type": "strange"}}}
    param, message = error(tools=[bad_tool], tool_choice={"type": "function", "function": {"name": "odd"}})
    assert param == "tools" and "cannot be compiled" in message
    param, message = error(tools=SMALL_TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert param == "response_format"
    # The server still serves after the refusals.
    assert chat(served, extra_body={"structured_outputs": {"choice": ["ok"]}}).choices[0].message.content == "ok"
