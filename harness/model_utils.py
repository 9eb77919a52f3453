"""Model folders for tests: the converted SmolLM2 and Gemma-3 270M, tiny random checkpoints built on the fly."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"
GEMMA3_270M = ROOT / "models" / "gemma-3-270m"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _without_fla(name: str, *args: object) -> object:
    """``name(*args)`` of this module in a child Python where ``import fla`` fails; JSON in and out."""
    code = ("import json, sys; sys.modules['fla'] = None; from harness import model_utils; "
            "a = json.load(sys.stdin); print(json.dumps(getattr(model_utils, a['name'])(*a['args'])))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps({"name": name, "args": list(args)}),
                         capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{name} without fla failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def smollm2_path() -> Path:
    """The folder `make setup` converts; converted here if a test runs before it."""
    if not (SMOLLM2 / "config.json").exists():
        from serving.convert import convert_gguf, smollm2_gguf_path

        convert_gguf(smollm2_gguf_path(), SMOLLM2, progress=False)
    return SMOLLM2


# arch -> (transformers config class, model class, the family's own config fields)
TINY_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[1])),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"])),
    # MLA (no q_lora_rank: V2-Lite's shape), a dense layer then two MoE layers (group-limited routing,
    # scaled weights, 2 shared experts)
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4,
        topk_group=2, routed_scaling_factor=1.5)),
    # DeepSeek-V3: the same MLA shape with q_lora_rank, V3's noaux_tc router (its correction bias drawn
    # at random below), a dense layer then two MoE layers
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        hybrid_override_pattern="M*-M", head_dim=16, ssm_state_size=16, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, conv_kernel=4, chunk_size=8)),
}


def gemma3_270m_path() -> Path:
    """The Gemma-3 270M folder `make setup` converts (a sliding-window hybrid with real weights);
    converted here if a test runs before it. FileNotFoundError when its package is not installed."""
    from serving.convert import convert_packaged, is_converted

    if not is_converted(GEMMA3_270M):
        convert_packaged("gemma3-270m", GEMMA3_270M, progress=False)
    return GEMMA3_270M


def tiny_model(path: Path, arch: str = "llama", with_tokenizer: bool = False, **overrides) -> Path:
    """Save a tiny random checkpoint (HF format) into ``path``: ``arch`` one of ``TINY_FAMILIES``
    (llama, qwen2, qwen3 (head_dim 32), qwen3_moe (8 experts, top 2, a sparse then a dense layer);
    the sliding-window families mistral, every layer an 8-token window, gemma3, 2 sliding layers
    (window 8) to 1 full, and gpt_oss (sinks, an 8-token window then a full layer, 4 experts); deepseek_v2
    (MLA without q_lora_rank, a dense layer then 2 MoE layers with shared experts), deepseek_v3 (the same
    with q_lora_rank and V3's noaux_tc router); the hybrids
    qwen3_5, a Gated DeltaNet + gated-attention stack, and nemotron_h, Mamba2 + attention + MLP blocks).

    Weights are drawn with a large ``initializer_range`` so greedy decoding has clear
    winners (random models with tiny weights produce near-ties that make token
    comparisons flaky under harmless float reordering).
    """
    import torch
    import transformers

    cfg_name, model_name, family = TINY_FAMILIES[arch]
    cfg_cls, model_cls = getattr(transformers, cfg_name), getattr(transformers, model_name)
    vocab = 49152 if with_tokenizer else 512
    kw = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.5, tie_word_embeddings=False, eos_token_id=vocab - 1, bos_token_id=0,
    )
    kw.update(family)
    kw.update(overrides)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kw)).float()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # HF starts it at 0: the choice would be the scores'
                buf.normal_(0.0, 0.5)
    model.save_pretrained(path)
    if with_tokenizer:
        src = smollm2_path()
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy(src / name, Path(path) / name)
    return Path(path)


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: HF transformers greedy generation, one prompt at a time, fp32, on the CPU.

    Where fla-core is installed (the GPU machine), transformers binds its linear-attention layers to
    fla's Triton kernels when the modeling module is imported, and those refuse CPU tensors: the
    reference then runs in a child process that cannot import fla (HF's own torch path)."""
    if importlib.util.find_spec("fla") is not None:
        return _without_fla("hf_greedy", str(path), prompts, max_new_tokens)
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



def hf_output_logprobs(path: Path, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[float]]:
    """Reference: HF transformers' log-probability of each output token after its prompt and the output
    before it (one forward pass over prompt + output, fp32): what an engine's ``output_token_logprobs``
    must match when its cache served part of the prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    refs = []
    with torch.inference_mode():
        for ids, out in zip(prompts, outputs, strict=True):
            x = torch.tensor([ids + out])
            lp = torch.log_softmax(model(x).logits[0].float(), dim=-1)
            refs.append([lp[len(ids) - 1 + k, t].item() for k, t in enumerate(out)])
    return refs
