"""The tool-call and reasoning parsers (serving/parsing) on recorded outputs of each format:
calls and text around them, malformed and unfinished calls kept as text, and a stream split at
every character boundary adding up to the whole parse."""

from __future__ import annotations

import pytest

from serving.parsing.output import OutputParser, OutputStream
from serving.parsing.reasoning_registry import PARSERS as REASONING
from serving.parsing.tool_base import ToolCall
from serving.parsing.tool_registry import PARSERS

W = ToolCall("get_weather", '{"city": "Paris"}')
F = ToolCall("f", "{}")
CASES = [
    ("qwen25", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', [W, F], "Let me check.\n\n"),
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par</tool_call> ok', [],
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par</tool_call> ok'),
    ("qwen25", 'Hi <tool_call>{"name": "f"', [], 'Hi <tool_call>{"name": "f"'),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
               '{"name": "f", "parameters": {}}', [W, F], ""),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', [W], ""),
    ("llama3", "Paris is sunny {not json", [], "Paris is sunny {not json"),
    ("llama3", '{"city": "Paris"}', [], '{"city": "Paris"}'),
    ("mistral", 'Sure [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "f", "arguments": {}}] done', [W, F], "Sure  done"),
    ("mistral", "[TOOL_CALLS] [1, 2]", [], "[TOOL_CALLS] [1, 2]"),
    ("deepseekv3", 'Hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                   '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', [W], "Hi"),
    ("gpt-oss", '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Paris"}<|call|>', [W], ""),
    ("gpt-oss", "<|channel|>commentary to=functions.f <|message|>nope<|call|>", [],
     "<|channel|>commentary to=functions.f <|message|>nope<|call|>"),
]


def _streamed(parser: OutputParser, text: str) -> tuple[str, str, list[ToolCall]]:
    s, pieces = OutputStream(parser), []
    for k in range(len(text) + 1):
        pieces += s.update(text[:k])
    pieces += s.update(text, True)
    return ("".join(p.text for p in pieces if p.kind == "reasoning"),
            "".join(p.text for p in pieces if p.kind == "content"), [p.call for p in pieces if p.kind == "call"])


@pytest.mark.parametrize(("name", "text", "calls", "content"), CASES)
def test_parse_and_stream_at_every_split(name: str, text: str, calls: list[ToolCall], content: str) -> None:
    parser = OutputParser(tools=PARSERS[name])
    out = parser.parse(text)
    assert out.calls == calls and out.content == content, out
    assert _streamed(parser, text) == ("", content, calls)


@pytest.mark.parametrize(("name", "forced", "text", "reasoning", "content"), [
    ("qwen3", False, "<think>\nhmm, Paris\n</think>\n\nIt is sunny.", "hmm, Paris\n", "It is sunny."),
    ("qwen3", False, "It is sunny.", "", "It is sunny."),
    ("qwen3", True, "hmm</think>Sunny", "hmm", "Sunny"),
    ("deepseek-r1", True, "let me think\n</think>\n\nSunny", "let me think\n", "Sunny"),
    ("deepseek-r1", True, "cut off by max_tokens", "cut off by max_tokens", ""),
    ("gpt-oss", False, "<|channel|>analysis<|message|>think hard<|end|><|start|>assistant<|channel|>final"
                       "<|message|>Hello<|return|>", "think hard", "Hello"),
])
def test_reasoning_at_every_split(name: str, forced: bool, text: str, reasoning: str, content: str) -> None:
    parser = OutputParser(REASONING[name], forced)
    out = parser.parse(text)
    assert (out.reasoning, out.content) == (reasoning, content)
    assert _streamed(parser, text) == (reasoning, content, [])


def test_reasoning_then_calls() -> None:
    parser = OutputParser(REASONING["qwen3"], False, PARSERS["qwen25"])
    text = '<think>need weather</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    out = parser.parse(text)
    assert out.reasoning == "need weather" and out.calls == [F] and out.content == ""
    assert _streamed(parser, text) == ("need weather", "", [F])


def test_forced_from_the_prompt() -> None:
    qwen3 = REASONING["qwen3"]
    assert qwen3.forced("<|im_start|>assistant\n<think>\n")
    assert not qwen3.forced("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not qwen3.forced("<|im_start|>assistant\n")
