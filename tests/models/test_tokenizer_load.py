"""common.tokenizer_load: the direct path builds exactly what AutoTokenizer builds, without torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.tokenizer_load import DIRECT_MODEL_TYPES, builds_directly, load_hf_tokenizer
from harness.model_utils import smollm2_path
from harness.server_utils import ROOT

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines",
         "ünïcödé — 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.mark.parametrize("which", ["smollm2", "tiny_chat"])
def test_direct_path_builds_what_autotokenizer_builds(which: str, tiny_chat_model: Path) -> None:
    from transformers import AutoTokenizer

    path = str(smollm2_path() if which == "smollm2" else tiny_chat_model)
    assert builds_directly(path)
    ours, auto = load_hf_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert type(ours) is type(auto)
    assert len(ours) == len(auto) and ours.eos_token_id == auto.eos_token_id and ours.bos_token_id == auto.bos_token_id
    assert ours.all_special_tokens == auto.all_special_tokens
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == auto.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    for gen in (True, False):
        assert ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen) == \
            auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)


def test_direct_model_types_are_not_overridden_by_transformers() -> None:
    from transformers.models.auto import tokenization_auto as ta

    assert not DIRECT_MODEL_TYPES & set(ta.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)


def test_other_folders_go_through_autotokenizer(tmp_path: Path) -> None:
    src = smollm2_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, tmp_path / name)
    assert builds_directly(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2"}))  # AutoTokenizer overrides it
    assert not builds_directly(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tok_cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "auto_map": {"AutoTokenizer": ["x", None]}}))
    assert not builds_directly(str(tmp_path))


def test_the_http_process_tokenizer_does_not_import_torch() -> None:
    code = ("import sys; from serving.tokenizer import Tokenizer; "
            f"t = Tokenizer({str(smollm2_path())!r}); assert t.encode('hi'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
