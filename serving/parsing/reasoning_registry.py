"""SGLang's ``--reasoning-parser`` names -> the parser (one class a form)."""

from __future__ import annotations

from serving.parsing.reasoning import DeepSeekR1, Kimi, Qwen3, ReasoningParser
from serving.parsing.reasoning_gpt_oss import GptOssReasoning

PARSERS: dict[str, ReasoningParser] = {
    name: cls() for cls in (DeepSeekR1, Qwen3, Kimi, GptOssReasoning) for name in cls.names
}
REASONING_PARSER_NAMES = tuple(PARSERS)


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser ``name`` names (None: none); ValueError naming the known ones."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r}: not known; one of {', '.join(REASONING_PARSER_NAMES)}")
    return PARSERS[name]
