"""--quantization through the real server: int8 and int4 (the ``make serve`` default) weights
serve, a cache hit repeats the cold answer token for token; fp8 on a CPU stops the server at
start-up with a message naming it."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.server_utils import ROOT, free_port, running_server

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


def test_fp8_on_cpu_stops_the_server_with_a_message(tiny_chat_model):
    out = subprocess.run([sys.executable, "-m", "serving.cli", "serve", "--model-path", str(tiny_chat_model),
                          "--device", "cpu", "--port", str(free_port()), "--quantization", "fp8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--quantization fp8 runs on cuda only, not on cpu" in out.stderr + out.stdout, out.stderr
    assert "Traceback" not in out.stderr
