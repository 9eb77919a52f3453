"""A tiny Qwen3 checkpoint that thinks and calls tools on cue, for the reasoning and tool-call tests.

A random model never writes ``</think>`` or a ``<tool_call>`` on its own, so tests of what the
server does with them would see only their absence. This checkpoint is a real Qwen3 (saved by HF
transformers, served by the engine, equal to HF's greedy answer) whose weights make its greedy
answer follow a script: every layer's output projections are zero, so the last hidden state is
the current token's embedding; the embedding of each script token is a basis vector that the LM
head maps onto the next script token. The script's pieces are added to SmolLM2's tokenizer as
tokens of their own (plain, not special: they always show), so each appears once and the chains
never cross. The chat template is ChatML with Qwen3's thinking switch:

- thinking (the default): the prompt ends in ``<think>\\n`` and the answer is ``THINKING``, then
  ``</think>``, then ``ANSWER``, then ``<|im_end|>``;
- ``enable_thinking=False``: the prompt ends in ``<think>\\n\\n</think>\\n\\n`` and the answer is
  ``CALL`` (a Hermes / Qwen2.5 ``<tool_call>``), then ``<|im_end|>``.
"""

from __future__ import annotations

from pathlib import Path

from harness.model_utils import smollm2_path

THINKING = ["Paris weather", " was asked for."]
ANSWER = ["It is sunny", " in Paris."]
CALL = ['<tool_call>\n{"name": "get_time", ', '"arguments": {"zone": ', '"UTC"}}\n</tool_call>']
TEMPLATE = (  # no whitespace control: the newlines are the prompt's (trim_blocks drops none here)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
GAIN = 20.0  # the next script token's logit (all others are 0)


def scripted_model(path: Path) -> Path:
    """Save the checkpoint and its tokenizer into ``path``."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    tok.add_tokens(["<think>", "</think>", *THINKING, *ANSWER, *CALL])
    tok.chat_template = TEMPLATE
    one = {s: tok.convert_tokens_to_ids(s) for s in ("<think>", "</think>", *THINKING, *ANSWER, *CALL)}
    newline, blank = (tok.encode(s, add_special_tokens=False) for s in ("\n", "\n\n"))
    assert len(newline) == 1 and len(blank) == 1, (newline, blank)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    chains = [[newline[0], *(one[s] for s in (*THINKING, "</think>", *ANSWER)), eos],
              [blank[0], *(one[s] for s in CALL), eos]]
    links = [(a, b) for chain in chains for a, b in zip(chain, chain[1:], strict=False)]
    assert len({a for a, _ in links}) == len(links), "a token has two successors"
    hidden = 64
    assert len(links) <= hidden
    cfg = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=eos, bos_token_id=tok.bos_token_id or 0)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        for i, (a, b) in enumerate(links):
            emb[a, i] = 1.0
            head[b, i] = GAIN
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)
