"""Model folders for tests: the converted SmolLM2 and tiny random checkpoints built on the fly."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def smollm2_path() -> Path:
    """The folder `make setup` converts; converted here if a test runs before it."""
    if not (SMOLLM2 / "config.json").exists():
        from serving.convert import convert_gguf, smollm2_gguf_path

        convert_gguf(smollm2_gguf_path(), SMOLLM2, progress=False)
    return SMOLLM2


def tiny_model(path: Path, arch: str = "llama", with_tokenizer: bool = False, **overrides) -> Path:
    """Save a tiny random Llama / Qwen2 checkpoint (HF format) into ``path``.

    Weights are drawn with a large ``initializer_range`` so greedy decoding has clear
    winners (random models with tiny weights produce near-ties that make token
    comparisons flaky under harmless float reordering).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    vocab = 49152 if with_tokenizer else 512
    kw = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.5, tie_word_embeddings=False, eos_token_id=vocab - 1, bos_token_id=0,
    )
    kw.update(overrides)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kw)).float()
    model.save_pretrained(path)
    if with_tokenizer:
        src = smollm2_path()
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy(src / name, Path(path) / name)
    return Path(path)


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: HF transformers greedy generation, one prompt at a time, fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs

