"""``--reasoning-parser``: the model's reasoning taken out of its answer (SGLang's names).

``deepseek-r1``: the answer starts inside the reasoning (the template opened ``<think>``) up to
``</think>``; ``qwen3``: reasoning when the answer starts with ``<think>``, or when the prompt
ends inside an open ``<think>`` (a template that opens it, or Qwen3-Thinking's); ``kimi`` the same
with ``◁think▷``; ``gpt-oss``: harmony's analysis channel (serving/parsing/reasoning_gpt_oss.py).
Without the end marker the whole answer is reasoning (a thinking model cut off by max_tokens).
``parse(text, final=False)`` holds back what it cannot decide yet (a partial marker), so what a
stream shows is a prefix of the final split. Stateless; ``forced`` is per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from serving.parsing.tool_base import marker_tail


@dataclass(frozen=True)
class Split:
    reasoning: str
    content: str


class ReasoningParser:
    names: ClassVar[tuple[str, ...]] = ()
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    always: ClassVar[bool] = False  # the answer starts inside the reasoning whatever the prompt
    keeps_special_tokens: ClassVar[bool] = False

    def forced(self, prompt_text: str) -> bool:
        """Whether an answer to this prompt starts inside the reasoning."""
        if self.always:
            return True
        tail = prompt_text[-4000:]
        return tail.rfind(self.end) < tail.rfind(self.start)

    def parse(self, text: str, forced: bool, final: bool = True) -> Split:
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not final and self.start.startswith(body):
            return Split("", "")  # may still become the start marker
        elif not forced:
            return Split("", text)
        k = body.find(self.end)
        if k < 0:
            return Split(body.lstrip() if final else body[:marker_tail(body, 0, (self.end,))].lstrip(), "")
        return Split(body[:k].lstrip(), body[k + len(self.end):].lstrip())


class DeepSeekR1(ReasoningParser):
    names = ("deepseek-r1", "deepseek-v3")
    always = True


class Qwen3(ReasoningParser):
    names = ("qwen3", "qwen3-thinking", "glm45", "minimax")


class Kimi(ReasoningParser):
    names = ("kimi",)
    start, end = "◁think▷", "◁/think▷"
