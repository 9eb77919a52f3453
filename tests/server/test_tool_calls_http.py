"""Tool calls through a real server (``--tool-call-parser qwen25``) serving SmolLM2 (real weights)
with the real OpenAI and Anthropic SDKs: ``tool_choice`` required / named force real calls through
the model (constrained decoding of the parser's own format, which SmolLM2 does not write on its
own), and their arguments validate against the tools' schemas; plain and streamed; a tool loop
whose cached tokens rise; ``tool_choice`` none / auto; bad tool definitions are 400s naming the
field; LangChain's ``ChatOpenAI(...).bind_tools(...)`` invoked, streamed and in a loop."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from harness.model_utils import smollm2_path
from harness.server_utils import ServerProcess, running_server

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days, and the time?"}]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    args = ["--model-path", str(smollm2_path()), "--max-total-tokens", "4096", "--context-length", "1024",
            "--tool-call-parser", "qwen25", "--served-model-name", "tiny"]
    with running_server(args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_required_returns_valid_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=160, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", repr(choice.message.content)
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        _valid(call.function.name, call.function.arguments)
    assert "<tool_call>" not in (choice.message.content or "")


def test_named_function_plain_and_streamed(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=named,
                                       max_tokens=100, temperature=0)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    plain = _valid("get_time", call.function.arguments)
    stream = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=named,
                                            max_tokens=100, temperature=0, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    slot["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
    assert finish == "tool_calls" and list(calls) == [0], calls
    assert calls[0]["name"] == "get_time" and calls[0]["id"].startswith("call_")
    assert _valid("get_time", calls[0]["arguments"]) == plain  # greedy: the same call


def test_parallel_false_gives_one_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=160, temperature=0)
    assert len(r.choices[0].message.tool_calls) == 1


def test_tool_loop_reads_more_cache_each_turn(client: openai.OpenAI) -> None:
    history = list(ASK)
    cached = []
    for _ in range(3):
        r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=100, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        call = r.choices[0].message.tool_calls[0]
        history += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": '{"result": "sunny, 21 C"}'}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8,
                                            temperature=0)
    cached.append(answer.usage.prompt_tokens_details.cached_tokens)
    assert cached[1] > cached[0] and cached[2] > cached[1] and cached[3] > cached[2], cached
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_none_and_auto(client: openai.OpenAI, server: ServerProcess) -> None:
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(("tool", "field"), [
    ({"type": "function", "function": {"parameters": WEATHER}}, r"tools\.0\.function\.name"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}},
     r"tools\.0\.function\.parameters"),
])
def test_bad_tool_definitions_are_400s(client: openai.OpenAI, tool: dict, field: str) -> None:
    with pytest.raises(openai.BadRequestError, match=field):
        client.chat.completions.create(model="tiny", messages=ASK, tools=[tool], max_tokens=1)


def test_bad_tool_choice_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="no tool is named 'nope'"):
        client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=1,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1, tool_choice="required")


def test_structural_tag_response_format(server: ServerProcess) -> None:
    fmt = {"type": "structural_tag", "structures": [{"begin": "<w>", "schema": CLOCK, "end": "</w>"}],
           "triggers": ["<w>"]}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": ASK, "max_tokens": 40, "temperature": 0, "response_format": fmt})
    assert r.status_code == 200, r.text
    forced = {"type": "structural_tag", "format": {"type": "tag", "begin": "<w>", "end": "</w>",
                                                     "content": {"type": "json_schema", "json_schema": CLOCK,
                                                                 "max_whitespace_cnt": 1}}}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": ASK, "max_tokens": 40, "temperature": 0, "response_format": forced})
    text = r.json()["choices"][0]["message"]["content"]
    assert text.startswith("<w>") and text.endswith("</w>"), text
    jsonschema.validate(json.loads(text[3:-4]), CLOCK)


def test_anthropic_any_and_named_tool_use(server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    r = client.messages.create(model="tiny", max_tokens=160, tools=tools, messages=ASK, tool_choice={"type": "any"})
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and uses, r
    for b in uses:
        jsonschema.validate(b.input, SCHEMAS[b.name])
        assert b.id.startswith("toolu_")
    with client.messages.stream(model="tiny", max_tokens=100, tools=tools, messages=ASK,
                                tool_choice={"type": "tool", "name": "get_time"}) as stream:
        final = stream.get_final_message()
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and use.name == "get_time"
    jsonschema.validate(use.input, CLOCK)


def test_langchain_bind_tools_invoke_stream_and_loop(server: ServerProcess) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="tiny", temperature=0, max_tokens=100,
                     max_retries=0, stream_usage=True)
    bound = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False)
    history = [HumanMessage(ASK[0]["content"])]
    msg = bound.invoke(history)
    [call] = msg.tool_calls
    jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    assert msg.response_metadata["finish_reason"] == "tool_calls" and call["id"].startswith("call_")
    streamed = None
    for chunk in bound.stream(history):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
    # the loop: the call and its result go back; the answer reads the earlier turn from the cache
    history += [msg, ToolMessage('{"result": "sunny, 21 C"}', tool_call_id=call["id"])]
    answer = llm.bind_tools(TOOLS).invoke(history)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    cached = answer.usage_metadata["input_token_details"]["cache_read"]
    assert cached >= msg.usage_metadata["input_tokens"] - 16, (cached, msg.usage_metadata)  # a page at most
