"""--quantization through the real server: int8 and int4 weights serve, a cache hit repeats the
cold answer token for token; ``make serve``'s ``auto`` on the real SmolLM2 picks this machine's mode
(logged with the C++ variant) and answers the README's first curl naming Paris; fp8 on a CPU stops
the server at start-up with a message naming it."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from harness.model_utils import SMOLLM2
from harness.server_utils import ROOT, free_port, running_server

IDS = list(range(20, 84))


def generate(url: str) -> dict:
    r = httpx.post(url + "/generate", timeout=120, json={
        "input_ids": IDS, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_server_hit_equals_cold(tiny_chat_model, mode):
    flags = ["--model-path", str(tiny_chat_model), "--max-total-tokens", "512", "--page-size", "4",
             "--quantization", mode]
    with running_server(flags) as s:
        info = httpx.get(s.url + "/get_server_info", timeout=30).json()
        assert info["model"]["quantization"] == mode, info["model"]  # the flag reached the engine's config
        cold = generate(s.url)
        hit = generate(s.url)
        assert cold["meta_info"]["cached_tokens"] == 0 and hit["meta_info"]["cached_tokens"] > 0
        assert hit["output_ids"] == cold["output_ids"]


@pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(), reason="needs make setup's SmolLM2")
def test_make_serve_default_answers_the_readme_question():
    from serving.kernels import cpu_ext

    with running_server(["--model-path", str(SMOLLM2), "--quantization", "auto", "--max-total-tokens", "1024"]) as s:
        question = [{"role": "user", "content": "What is the capital of France?"}]
        r = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "messages": question, "max_tokens": 32, "temperature": 0})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"], r.json()
        log = s.log()
    mode = "int4" if cpu_ext.variant() not in (None, "scalar") else "fp32"
    assert f"--quantization auto: {mode} (" in log, log[-3000:]
    if mode == "int4":
        assert f"C++ CPU kernels: variant {cpu_ext.variant()}" in log and "CPU decoder: fused C++ layers" in log


def test_fp8_on_cpu_stops_the_server_with_a_message(tiny_chat_model):
    out = subprocess.run([sys.executable, "-m", "serving.launch.cli", "serve", "--model-path", str(tiny_chat_model),
                          "--device", "cpu", "--port", str(free_port()), "--quantization", "fp8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--quantization fp8 runs on cuda only, not on cpu" in out.stderr + out.stdout, out.stderr
    assert "Traceback" not in out.stderr
