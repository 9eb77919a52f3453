"""``gpt-oss`` reasoning: harmony's ``<|channel|>analysis<|message|>...<|end|>`` messages are the
reasoning; the framing of the final message (serving/parsing/tool_gpt_oss.py's ``FRAMING``) is
dropped; commentary (tool calls) stays in the content for the tool parser."""

from __future__ import annotations

from serving.parsing.reasoning import ReasoningParser, Split
from serving.parsing.tool_base import marker_tail
from serving.parsing.tool_gpt_oss import FRAMING, strip_framing

ANALYSIS, END = "<|channel|>analysis<|message|>", "<|end|>"


class GptOssReasoning(ReasoningParser):
    names = ("gpt-oss",)
    keeps_special_tokens = True

    def forced(self, prompt_text: str) -> bool:
        return False

    def parse(self, text: str, forced: bool, final: bool = True) -> Split:
        reasoning, content, pos = [], [], 0
        while True:
            i = text.find(ANALYSIS, pos)
            if i < 0:
                rest = text[pos:]
                if not final:
                    rest = rest[:marker_tail(rest, 0, (ANALYSIS, *FRAMING))]
                content.append(rest)
                break
            content.append(text[pos:i])
            j = text.find(END, i + len(ANALYSIS))
            if j < 0:
                piece = text[i + len(ANALYSIS):]
                reasoning.append(piece if final else piece[:marker_tail(piece, 0, (END,))])
                break
            reasoning.append(text[i + len(ANALYSIS): j])
            pos = j + len(END)
        return Split("".join(reasoning), strip_framing("".join(content), True))
