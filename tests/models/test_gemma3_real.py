"""Gemma-3 270M with real weights (the Q4_K_M GGUF `make setup` converts into models/gemma-3-270m).

The conversion is right when HF transformers' Gemma3ForCausalLM on the converted folder has a sane
perplexity on a fixed English text (a lost BOS or an un-subtracted norm gives ~70 or thousands),
and the norms and quantized blocks equal the GGUF's dequantized values. HiCache serves it as HF
computes it: perplexity within 1 % of HF's on the same weights (the text, and the text twice,
longer than the 512-token window); a real server answers a completion as HF does ("Paris");
a multi-turn chat against a server with L2 and L3 (LMDB) gets its later turns from L2 and, after
a restart, from L3, and the L3-served answer is HF's greedy answer.

Measured on the 2-vCPU Xeon: HF perplexity 15.49 (69.8 without the BOS).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import yaml

from harness.model_utils import gemma3_270m_path
from harness.server_utils import ServerProcess, running_server

pytestmark = pytest.mark.slow

TEXT = """The history of the bicycle begins in the early nineteenth century. In 1817 the German inventor \
Karl von Drais built a two-wheeled machine that riders pushed along the ground with their feet. It had no \
pedals, but it proved that a person could balance on two wheels in a line while moving forward. Over the \
following decades, craftsmen in France and Britain added cranks and pedals to the front wheel, and the \
machines became known as velocipedes. Because the pedals turned the front wheel directly, makers enlarged \
that wheel to travel farther with each turn, which led to the tall "penny-farthing" designs of the 1870s. \
These bicycles were fast but dangerous, and a sudden stop could throw the rider over the handlebars.

The safety bicycle of the 1880s solved this problem. It used two wheels of similar size and a chain that \
carried power from the pedals to the rear wheel. Soon afterwards, John Boyd Dunlop developed a practical \
pneumatic tire, which made riding far more comfortable on rough roads. By the end of the century, millions \
of people owned bicycles, and cycling clubs organized long tours through the countryside. The bicycle gave \
many workers a cheap way to travel to their jobs, and it offered women a new kind of independence. Today, \
bicycles remain one of the most efficient forms of transport ever invented, and cities around the world are \
building protected lanes to encourage more people to ride them every day.
"""
# HiCache tokenizes completion prompts without special tokens; Gemma needs its BOS (written here)
COMPLETION = "<bos>Q: What is the capital of France?\nA:"
WINDOW = 512


@pytest.fixture(scope="module")
def model_dir() -> Path:
    try:
        return gemma3_270m_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def texts(tokenizer) -> dict[str, list[int]]:  # noqa: ANN001
    one = tokenizer(TEXT)["input_ids"]
    assert one[0] == tokenizer.bos_token_id and 250 < len(one) < WINDOW
    two = tokenizer(TEXT + "\n" + TEXT)["input_ids"]
    assert len(two) > WINDOW + 50  # the sliding layers' window is crossed
    return {"text": one, "text twice": two}


def hf_perplexity(model: torch.nn.Module, ids: list[int]) -> float:
    with torch.no_grad():
        x = torch.tensor([ids])
        return math.exp(model(x, labels=x).loss.item())


def needs_hicache_gemma3() -> None:
    from serving.models.registry import supported_architectures

    if "Gemma3ForCausalLM" not in supported_architectures():
        pytest.skip("HiCache has no Gemma3ForCausalLM yet (serving/models/gemma3.py, issue 43 Build 2)")


def test_config_tokenizer_and_template(model_dir: Path, tokenizer) -> None:  # noqa: ANN001
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert cfg["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert cfg["sliding_window"] == WINDOW and cfg["query_pre_attn_scalar"] == cfg["head_dim"] == 256
    assert cfg["rope_parameters"] == {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["tie_word_embeddings"] and cfg["vocab_size"] == 262144
    assert "quantization_config" not in cfg
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, tokenizer.convert_tokens_to_ids("<end_of_turn>")] == [1, 106]
    assert tokenizer("The capital of France is")["input_ids"] == [2, 818, 5279, 529, 7001, 563]
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
        tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_weights_are_the_ggufs_dequantized(model_dir: Path, tmp_path: Path) -> None:
    """Norms as HF keeps them (llama.cpp stores 1 + w), quantized blocks (Q4_K, Q6_K, Q5_0, Q8_0)
    as gguf.quants.dequantize gives them, under HF's names."""
    from safetensors import safe_open

    from serving.convert_gemma3 import hf_name, packaged_gguf
    from serving.convert_gguf_file import read_gguf

    gguf = read_gguf(packaged_gguf(tmp_path))
    names = ["blk.0.attn_norm.weight", "blk.0.attn_q_norm.weight", "blk.5.post_ffw_norm.weight",
             "output_norm.weight", "blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.0.attn_q.weight",
             "blk.0.attn_v.weight"]
    assert {gguf.tensors[n].type_name for n in names} >= {"F32", "Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == len(gguf.tensors) == 236  # lm_head tied to the embeddings
        for name in names:
            ours, raw = f.get_tensor(hf_name(name)).numpy(), gguf.tensors[name].dequantize()
            expected = raw - np.float32(1) if name.endswith("norm.weight") else raw
            np.testing.assert_array_equal(ours, expected, err_msg=name)
        norm = f.get_tensor("model.layers.0.post_feedforward_layernorm.weight")
    assert norm.min() < 0  # w, not 1 + w: HF's Gemma3RMSNorm scales by (1 + w)


def test_convert_refuses_a_cut_file_and_leaves_nothing(tmp_path: Path) -> None:
    import subprocess
    import sys

    from serving.convert_gemma3 import packaged_gguf

    gguf = packaged_gguf(tmp_path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[:100_000_000])
    for args, message in (([str(cut), str(tmp_path / "out")], "token_embd.weight ends past the end of the file"),
                          ([str(tmp_path / "none.gguf"), str(tmp_path / "out")], "no such GGUF file"),
                          (["--packaged", "gemma3-270m", str(cut), str(tmp_path / "out")], "give only OUT_DIR")):
        out = subprocess.run([sys.executable, "-m", "serving.convert", "--quiet", *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", gguf.name]


def test_hf_perplexity_is_sane(hf_model, texts) -> None:  # noqa: ANN001
    ppl = hf_perplexity(hf_model, texts["text"])
    assert 5 < ppl < 25, ppl  # 15.49; a lost BOS gives 69.8


def test_hicache_perplexity_within_one_percent_of_hf(model_dir: Path, hf_model, texts) -> None:  # noqa: ANN001
    needs_hicache_gemma3()
    from serving.engine import Engine

    eng = Engine(model_path=str(model_dir), max_total_tokens=2048)
    try:
        for name, ids in texts.items():
            out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                               return_logprob=True, logprob_start_len=0)
            logprobs = [p[0] for p in out["meta_info"]["input_token_logprobs"]]
            assert logprobs[0] is None and len(logprobs) == len(ids), name
            ours, ref = math.exp(-sum(logprobs[1:]) / (len(ids) - 1)), hf_perplexity(hf_model, ids)
            assert abs(ours / ref - 1) < 0.01, (name, ours, ref)
        eng.check_integrity()
    finally:
        eng.shutdown()


def hf_greedy_text(model: torch.nn.Module, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> str:  # noqa: ANN001
    with torch.no_grad():
        x = torch.tensor([prompt_ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(y[0, len(prompt_ids):], skip_special_tokens=True)


def test_server_answers_a_completion(model_dir: Path, hf_model, tokenizer) -> None:  # noqa: ANN001
    needs_hicache_gemma3()
    with running_server(["--model-path", str(model_dir)]) as s:
        r = httpx.post(s.url + "/v1/completions", timeout=120, json={
            "model": "gemma-3-270m", "prompt": COMPLETION, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        # without "<bos>" in the text the server adds it, as vLLM / SGLang do (the tokenizer adds one): the same
        # prompt, the same answer; /generate's text too
        bare = httpx.post(s.url + "/v1/completions", timeout=120, json={
            "model": "gemma-3-270m", "prompt": COMPLETION.removeprefix("<bos>"), "max_tokens": 8, "temperature": 0})
        assert bare.status_code == 200, bare.text
        assert bare.json()["choices"][0]["text"] == text
        assert bare.json()["usage"]["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
        gen = httpx.post(s.url + "/generate", timeout=120, json={
            "text": COMPLETION.removeprefix("<bos>"), "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert gen.status_code == 200 and gen.json()["text"] == text, gen.text
    assert "Paris" in text, text
    assert text == hf_greedy_text(hf_model, tokenizer, tokenizer(COMPLETION, add_special_tokens=False)["input_ids"], 8)


def tier_hits(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    found = re.findall(r'^hicache_cache_hit_tokens_total\{[^}]*tier="(\w+)"[^}]*\} ([0-9.e+]+)$', text, re.M)
    return {tier: float(v) for tier, v in found}


def chat_turn(server: ServerProcess, convo: list[dict]) -> tuple[str, dict, dict[str, float]]:
    """One turn: the answer, its usage, and the tokens each tier served it (the metrics' deltas)."""
    before = tier_hits(server)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "gemma-3-270m", "messages": convo, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    after = tier_hits(server)
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"], {
        t: after.get(t, 0.0) - before.get(t, 0.0) for t in after}


def test_multi_turn_chat_is_served_from_l2_then_l3(model_dir: Path, tmp_path: Path, hf_model, tokenizer) -> None:  # noqa: ANN001
    needs_hicache_gemma3()
    cfg = tmp_path / "gemma3-l3.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"model_path": str(model_dir), "served_model_name": "gemma-3-270m"},
        "scheduler": {"max_total_tokens": 1024},  # L1: a filler prompt pushes the conversation out
        "cache": {"page_size": 16, "hicache_ratio": 4.0, "hicache_write_policy": "write_through",
                  "hicache_mem_layout": "page_first", "hicache_storage_backend": "lmdb",
                  "hicache_storage_backend_extra_config": {"path": str(tmp_path / "l3"), "capacity_gb": 1.0},
                  "hicache_storage_prefetch_policy": "wait_complete", "hicache_storage_prefetch_threshold": 16,
                  "hicache_storage_load_policy": "always_load"}}))
    convo = [{"role": "system", "content": "You are a patient history teacher. " + TEXT[:600]},
             {"role": "user", "content": "Who built the first two-wheeled machine?"}]
    with running_server(["--config", str(cfg)]) as s:
        a1, u1, _ = chat_turn(s, convo)
        assert u1["prompt_tokens_details"]["cached_tokens"] == 0 and u1["prompt_tokens"] > 150
        filler = httpx.post(s.url + "/v1/completions", timeout=120, json={
            "model": "gemma-3-270m", "prompt": "<bos>" + TEXT + TEXT + TEXT, "max_tokens": 1, "temperature": 0})
        assert filler.status_code == 200 and filler.json()["usage"]["prompt_tokens"] > 800, filler.text
        convo += [{"role": "assistant", "content": a1}, {"role": "user", "content": "When was the safety bicycle?"}]
        a2, u2, tiers2 = chat_turn(s, convo)
        assert u2["prompt_tokens_details"]["cached_tokens"] >= 128 and tiers2["host"] > 0, (u2, tiers2)
        assert s.check_integrity()["ok"]
    convo += [{"role": "assistant", "content": a2}, {"role": "user", "content": "Who made the pneumatic tire?"}]
    with running_server(["--config", str(cfg)]) as s:  # a restart: L1 and L2 empty, L3 kept
        a3, u3, tiers3 = chat_turn(s, convo)
        assert u3["prompt_tokens_details"]["cached_tokens"] >= u2["prompt_tokens"] - 16, (u2, u3)
        assert tiers3["storage"] > 0, tiers3
        assert s.check_integrity()["ok"]
    prompt = tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert a3 == hf_greedy_text(hf_model, tokenizer, tokenizer(prompt, add_special_tokens=False)["input_ids"], 12)
