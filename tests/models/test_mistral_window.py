"""Mistral's ``sliding_window`` is honoured: a tiny random Mistral whose window is much shorter than
its prompts gives HF transformers' greedy tokens through the engine (torch and cpu backends: the cpu
one runs the fused C++ decoder with the window), and its layer stack says every layer is sliding."""

from __future__ import annotations

import pytest

from harness.engine_cases import ids_of, prompts
from harness.model_utils import hf_greedy
from serving.engine import Engine
from serving.kernels import cpu_ext
from serving.models.arch_config import ModelArchConfig
from serving.models.layer_spec import LayerKind
from serving.models.llama import LlamaForCausalLM

WINDOW = 8
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


def tiny_mistral(path, window: int | None = WINDOW):
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                        initializer_range=0.5, tie_word_embeddings=False, eos_token_id=511, bos_token_id=0,
                        sliding_window=window)
    torch.manual_seed(0)
    MistralForCausalLM(cfg).float().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tiny_mistral(tmp_path_factory.mktemp("mistral"))
    ps = prompts(3, 512, seed=7, lo=40, hi=56)  # 5-7 windows long
    return path, ps, hf_greedy(path, ps, GREEDY["max_new_tokens"])


BACKENDS = ["torch"] + (["cpu"] if cpu_ext.extension() is not None else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_mistral_window_greedy_matches_hf(mistral, backend: str) -> None:
    path, ps, ref = mistral
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, attention_backend=backend,
                 chunked_prefill_size=16)  # chunks end inside windows
    try:
        assert eng.core.runner.model.layer_stack.windows == (WINDOW, WINDOW)
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        if backend == "cpu":  # the fused C++ decoder ran the windows
            assert eng.core.runner.model.fused_decoder() is not None
        again = eng.generate(input_ids=ps, sampling_params=GREEDY)  # prefixes from L1
        assert ids_of(again) == ref
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_layer_stacks_of_the_llama_family() -> None:
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, vocab_size=64)
    mistral = ModelArchConfig.from_dict({**base, "model_type": "mistral", "sliding_window": 16})
    specs = LlamaForCausalLM.build_layer_stack(mistral).specs
    assert all(s.kind is LayerKind.SLIDING and s.window == 16 for s in specs)
    no_window = ModelArchConfig.from_dict({**base, "model_type": "mistral", "sliding_window": None})
    assert not LlamaForCausalLM.build_layer_stack(no_window).is_hybrid
    llama = ModelArchConfig.from_dict({**base, "model_type": "llama", "sliding_window": 16})  # Llama ignores it
    assert not LlamaForCausalLM.build_layer_stack(llama).is_hybrid
    qwen_off = ModelArchConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 32768,
                                          "use_sliding_window": False})
    assert not LlamaForCausalLM.build_layer_stack(qwen_off).is_hybrid
    qwen_on = ModelArchConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 16,
                                         "use_sliding_window": True, "max_window_layers": 2})
    assert LlamaForCausalLM.build_layer_stack(qwen_on).windows == (None, None, 16, 16)
