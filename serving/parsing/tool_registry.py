"""SGLang's ``--tool-call-parser`` names -> the parser of that format (one class a format, each in
its own module; a name is looked up, never matched in a chain of ifs)."""

from __future__ import annotations

from serving.parsing.tool_base import ToolParser
from serving.parsing.tool_deepseek import DeepSeekV3Parser
from serving.parsing.tool_gpt_oss import GptOssParser
from serving.parsing.tool_hermes import HermesParser
from serving.parsing.tool_llama3 import Llama3Parser
from serving.parsing.tool_mistral import MistralParser

PARSERS: dict[str, ToolParser] = {
    name: cls() for cls in (HermesParser, Llama3Parser, MistralParser, DeepSeekV3Parser, GptOssParser)
    for name in cls.names
}
TOOL_PARSER_NAMES = tuple(PARSERS)


def tool_parser(name: str | None) -> ToolParser | None:
    """The parser ``name`` names (None: none); ValueError naming the known ones."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r}: not known; one of {', '.join(TOOL_PARSER_NAMES)}")
    return PARSERS[name]
