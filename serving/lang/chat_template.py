"""Role prefixes and suffixes of a model's chat template, read off its Jinja template.

A program's text is built client side (``system(...)``, ``user(...)``, ``assistant(...)`` wrap
their content in the role's prefix and suffix), so that every ``gen`` sends one plain text
whose leading part is the text of the previous call: the server's radix tree matches it. The
strings come from the model's own template (rendered with sentinel contents and cut around
them), so a program's text equals what the server's chat API builds for the same messages; a
template that injects a default system message when there is none (SmolLM2's does) gives
``default_system``, which the program gets before its first non-system role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")
_SENT = {role: f"\x00\x01{role.upper()}\x01\x00" for role in ROLES}


@dataclass(frozen=True)
class ChatTemplate:
    prefix: dict[str, str]
    suffix: dict[str, str]
    default_system: str = ""  # text a template puts first when the messages have no system message

    def begin(self, role: str) -> str:
        return self.prefix[role]

    def end(self, role: str) -> str:
        return self.suffix[role]


CHATML = ChatTemplate(
    prefix={r: f"<|im_start|>{r}\n" for r in ROLES},
    suffix={r: "<|im_end|>\n" for r in ROLES},
)


def _render(template: str, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    from common.chat_jinja import render  # the server's rendering (transformers' environment)

    return render(template, messages, add_generation_prompt, bos_token="", eos_token="")


def _cut(text: str, sentinel: str) -> tuple[str, str]:
    head, sep, tail = text.partition(sentinel)
    if not sep:
        raise ValueError("the chat template drops a message's content")
    return head, tail


def from_jinja(template: str) -> ChatTemplate:
    """Role strings of a Jinja chat template (HF's ``chat_template``). Raises ValueError when the
    template is not a plain per-message wrapper (then use ``CHATML`` or pass one explicitly)."""
    msgs: list[dict[str, str]] = [{"role": r, "content": _SENT[r]} for r in ROLES]
    prefix: dict[str, str] = {}
    suffix: dict[str, str] = {}
    before = ""
    for k, role in enumerate(ROLES):
        text = _render(template, msgs[: k + 1])
        head, tail = _cut(text, _SENT[role])
        if not head.startswith(before):
            raise ValueError("the chat template is not a per-message wrapper")
        prefix[role], suffix[role] = head[len(before):], tail
        before = head + _SENT[role] + tail
    alone = _render(template, [msgs[1]])
    head, _ = _cut(alone, _SENT["user"])
    if not head.endswith(prefix["user"]):
        raise ValueError("the chat template is not a per-message wrapper")
    return ChatTemplate(prefix, suffix, head[: len(head) - len(prefix["user"])])


def resolve(template: Any) -> ChatTemplate:
    """A ChatTemplate, a Jinja string or None (ChatML)."""
    if template is None or template == "":
        return CHATML
    if isinstance(template, ChatTemplate):
        return template
    if isinstance(template, str):
        try:
            return from_jinja(template)
        except Exception:  # noqa: BLE001 - an exotic template: fall back to ChatML, as SGLang's default
            return CHATML
    raise TypeError(f"chat_template must be a ChatTemplate, a Jinja string or None, not {type(template).__name__}")


def from_model_folder(path: str) -> str | None:
    """The Jinja chat template of a local HF model folder (chat_template.jinja or tokenizer_config.json)."""
    import json
    import os

    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja) as f:
            return f.read()
    cfg = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(cfg):
        with open(cfg) as f:
            tpl = json.load(f).get("chat_template")
        return tpl if isinstance(tpl, str) else None
    return None
