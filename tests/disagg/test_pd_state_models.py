"""PD disaggregation of a model with recurrent-state layers (issue 43): a tiny random Qwen3.5 (3 Gated
DeltaNet layers to 1 gated attention layer) with SmolLM2's tokenizer, a prefill and a decode server
over NIXL (UCX on loopback) behind the real PD router. The prefill server sends the prompt's KV *and*
its state after the prompt (into the decode request's working state slot); multi-turn chats through
the router answer what a colocated server answers, later turns hit the prefill server's state
snapshots, and both PD servers pass ``check_integrity`` with nothing held. A transport that moves one
buffer (cuda_ipc) is refused at start with the reason."""

from __future__ import annotations

import httpx
import pytest

from harness.model_utils import tiny_model
from harness.pd_pair import nixl_pd_pair
from harness.server_utils import ServerProcess

pytestmark = pytest.mark.slow
QWEN = {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
SYSTEM = "You are a terse assistant. Answer in one short sentence."


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("qwen35-pd"), "qwen3_5", with_tokenizer=True,
                      max_position_embeddings=1024, **QWEN)


def chat(url: str, messages: list[dict]) -> tuple[str, int]:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    details = body["usage"].get("prompt_tokens_details") or {}
    return body["choices"][0]["message"]["content"], details.get("cached_tokens") or 0


def conversation(url: str, opener: str) -> list[tuple[str, int]]:
    history, out = [{"role": "system", "content": SYSTEM}], []
    for user in (opener, "Why?", "Once more, shorter."):
        history.append({"role": "user", "content": user})
        answer, cached = chat(url, history)
        history.append({"role": "assistant", "content": answer})
        out.append((answer, cached))
    return out


def internal(s: ServerProcess) -> dict:
    return httpx.get(s.url + "/get_server_info", timeout=30).json()["internal_states"][0]


def test_pd_moves_the_state_with_the_kv(model) -> None:
    base = ["--model-path", str(model), "--served-model-name", "tiny", "--page-size", "4",
            "--max-total-tokens", "2048"]
    with nixl_pd_pair(base, ["--disaggregation-decode-enable-radix-cache"]) as (router, p, d, c):
        for opener in ("Name a prime number.", "What colour is the sea?"):
            want = conversation(c.url, opener)
            got = conversation(router.url, opener)
            assert [a for a, _ in got] == [a for a, _ in want], (got, want)
            assert all(n > 0 for _, n in got[1:]), got  # the prefill server resumed from its snapshots
        pd_p, pd_d = internal(p)["pd"], internal(d)["pd"]
        assert pd_p["sent"] == pd_d["received"] == 6 and pd_p["send_failed"] == pd_d["failed"] == 0, (pd_p, pd_d)
        assert pd_p["bytes_sent"] == pd_d["bytes_received"] > 0
        for s in (p, d):
            assert httpx.post(s.url + "/debug/check_integrity", timeout=60).json()["ok"]
            assert internal(s)["state_slots"]["device"]["used"] == internal(s)["state_slots"]["device"]["snapshots"]


def test_cuda_ipc_is_refused_for_state_models(model) -> None:
    s = ServerProcess(["--model-path", str(model), "--disaggregation-mode", "decode",
                       "--disaggregation-transfer-backend", "cuda_ipc"])
    with pytest.raises(RuntimeError) as e:
        s.start(timeout=120)
    assert "use mooncake or nixl" in str(e.value), str(e.value)[-2000:]
