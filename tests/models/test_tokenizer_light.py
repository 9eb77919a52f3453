"""common.tokenizer_light / common.chat_jinja: the light tokenizer answers as the HF one does."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from common import tokenizer_light
from common.tokenizer_load import hf_tokenizer, load_hf_tokenizer, load_tokenizer
from harness.model_utils import smollm2_path
from harness.server_utils import ROOT

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines   ", "ünïcödé — 東京 🙂 \u200b\u00a0x",
         "<|im_start|>user\nhi<|im_end|>", "<|endoftext|><|im_end|>text", "", " ", "\n\n\n", "a" * 3000,
         "def f(x):\n    return x ** 2  # comment\n", "1234567890 3.14159 -42", "The café's naïve façade."]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "again <|im_end|> é"}],
    [{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": None,
                                                      "tool_calls": [{"type": "function", "function": {"name": "f"}}]}],
    [{"role": "user", "content": "think"}, {"role": "assistant", "content": "ok", "reasoning": "because"}],
]
# Templates using what transformers gives a chat template (chat_jinja's module doc), one feature each.
TEMPLATES = {
    "tojson": "{% for m in messages %}{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=true) }}{% endfor %}",
    "namespace_loopcontrols": ("{% set ns = namespace(n=0, last='') %}{% for m in messages %}"
                               "{% if m.role == 'assistant' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
                               "{% set ns.last = m.content %}{% if ns.n > 1 %}{% break %}{% endif %}{% endfor %}"
                               "{{ ns.n }}:{{ ns.last }}"),
    "generation": ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>"
                   "{% endgeneration %}{% else %}<{{ m.role }}>{{ m.content }}{% endif %}\n{% endfor %}"),
    "special_tokens_and_prompt": ("{{ bos_token }}{% for m in messages %}{{ m.role }}={{ m.content }}{{ eos_token }}"
                                  "{% endfor %}{% if add_generation_prompt %}>>{% endif %}{{ unk_token }}"),
    "dict_and_trim": "  {% for m in messages %}\n  {{ dict(a=m.role, **{'b': 1}) | tojson }}\n  {% endfor %}\n",
    "reasoning_and_none": ("{% for m in messages %}[{{ m.keys() | list | sort | join(',') }}]"
                           "{{ m.reasoning_content }}/{{ m.thinking }}{% endfor %}"),
    "strftime": "{{ strftime_now('%Y') }}{{ messages | length }}",
}
ERRORS = {
    "raise": "{{ raise_exception('roles must alternate') }}",
    "underscore_namespace": "{% set ns = namespace(_x=1) %}{{ ns }}",
}


@pytest.fixture
def snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HICACHE_TOKENIZER_CACHE", str(tmp_path / "snapshots"))
    return tmp_path / "snapshots"


def _outcome(tok: object, chat: list[dict], **kw: object) -> object:
    """The chat's text under ``tok``, or the type and message of the error it raised."""
    try:
        return tok.apply_chat_template(chat, tokenize=False, **kw)
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)


def _pair(path: str) -> tuple[tokenizer_light.LightTokenizer, object]:
    first = load_tokenizer(path)  # no snapshot yet: the HF tokenizer, and its snapshot written
    light = load_tokenizer(path)
    assert not isinstance(first, tokenizer_light.LightTokenizer)
    assert isinstance(light, tokenizer_light.LightTokenizer)
    return light, load_hf_tokenizer(path)


@pytest.mark.parametrize("which", ["smollm2", "tiny_chat"])
def test_light_tokenizer_answers_as_the_hf_one(which: str, tiny_chat_model: Path, snapshots: Path) -> None:
    light, hf = _pair(str(smollm2_path() if which == "smollm2" else tiny_chat_model))
    assert len(light) == len(hf) and light.eos_token_id == hf.eos_token_id
    assert light.special_tokens_map == hf.special_tokens_map and light.chat_template == hf.chat_template
    rng = random.Random(0)
    for text in TEXTS:
        for special in (False, True):
            ids = light.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
        noisy = ids + [rng.randrange(len(hf)) for _ in range(20)] + sorted(hf.all_special_ids)
        for some in (ids, noisy, noisy[3:], noisy[:-1]):
            for skip in (False, True):
                assert light.decode(some, skip_special_tokens=skip) == hf.decode(some, skip_special_tokens=skip)
                assert light.convert_ids_to_tokens(some, skip_special_tokens=skip) == \
                    hf.convert_ids_to_tokens(some, skip_special_tokens=skip)
        assert all(light.convert_ids_to_tokens(i) == hf.convert_ids_to_tokens(i) for i in noisy)
    rendered = 0
    for chat in CHATS:
        for gen in (False, True):
            ours = _outcome(light, chat, add_generation_prompt=gen)
            assert ours == _outcome(hf, chat, add_generation_prompt=gen)
            rendered += isinstance(ours, str)
    assert rendered >= 6  # only the chat whose assistant has no content fails (both the same way)
    assert hf_tokenizer(light) is light.full() and type(light.full()) is type(hf)


def test_chat_template_features_render_as_transformers_renders_them(snapshots: Path) -> None:
    light, hf = _pair(str(smollm2_path()))
    for name, template in TEMPLATES.items():
        for chat in CHATS:
            for gen in (False, True):
                ours = _outcome(light, chat, chat_template=template, add_generation_prompt=gen)
                assert isinstance(ours, str), (name, ours)
                assert ours == _outcome(hf, chat, chat_template=template, add_generation_prompt=gen), (name, chat)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = "{{ tools | tojson }}{{ documents | tojson }}{{ extra }}"
    assert light.apply_chat_template(CHATS[0], tools=tools, documents=[{"title": "t", "text": "x"}], extra=7,
                                     chat_template=with_tools, tokenize=False) == \
        hf.apply_chat_template(CHATS[0], tools=tools, documents=[{"title": "t", "text": "x"}], extra=7,
                               chat_template=with_tools, tokenize=False)
    for name, template in ERRORS.items():
        with pytest.raises(jinja2.TemplateError) as ours:
            light.apply_chat_template(CHATS[0], chat_template=template, tokenize=False)
        with pytest.raises(jinja2.TemplateError) as theirs:
            hf.apply_chat_template(CHATS[0], chat_template=template, tokenize=False)
        assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value), name
    with pytest.raises(jinja2.exceptions.SecurityError):  # the sandbox: no attribute escape
        light.apply_chat_template(CHATS[0], chat_template="{{ messages.__class__.__mro__ }}", tokenize=False)
    with pytest.raises(TypeError, match="tokenize=False"):
        light.apply_chat_template(CHATS[0])


def test_snapshot_follows_the_files_and_refuses_what_it_cannot_serve(tmp_path: Path, snapshots: Path) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    for f in smollm2_path().iterdir():
        if f.name in tokenizer_light.FILES:
            shutil.copy(f, folder / f.name)
    _pair(str(folder))
    before = tokenizer_light.snapshot_path(str(folder))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}!{% endfor %}")
    assert tokenizer_light.snapshot_path(str(folder)) != before  # another template: another snapshot
    light, fresh = _pair(str(folder))
    assert light.apply_chat_template(CHATS[1], tokenize=False) == "Be brief.!Hi!Hello!!again <|im_end|> é!"
    assert fresh.apply_chat_template(CHATS[1], tokenize=False) == "Be brief.!Hi!Hello!!again <|im_end|> é!"
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "clean_up_tokenization_spaces": True}))
    for _ in range(2):  # HF's clean-up is not rebuilt here: that folder stays on transformers
        assert not isinstance(load_tokenizer(str(folder)), tokenizer_light.LightTokenizer)
    state = tokenizer_light.recall(str(folder))
    assert state == {"format": tokenizer_light.FORMAT, "light": False, "why": "clean_up_tokenization_spaces is set"}


def test_a_process_with_a_snapshot_never_imports_transformers(snapshots: Path) -> None:
    load_tokenizer(str(smollm2_path()))  # writes the snapshot
    code = ("import sys; from serving.tokenizer import Tokenizer; "
            f"t = Tokenizer({str(smollm2_path())!r}); assert t.encode('hi'); "
            "assert t.apply_chat_template([{'role': 'user', 'content': 'hi'}]).endswith('assistant\\n'); "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
