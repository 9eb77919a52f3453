"""PD disaggregation with the hybrid SWA L1 (``--enable-hybrid-swa-memory``): a tiny random Gemma-3 (2 sliding
layers with an 8-token window to 1 full), a prefill and a decode server over NIXL (UCX on loopback) behind the
real PD router, and a colocated server, every one with the window pool on.

The decode server takes window pages only for its own pages in the prompt's last window (a prompt longer than
its window pool still fits) and the prefill server writes its sliding layers' KV there, beside the full
layers' pages: greedy tokens through PD equal the colocated server's for prompts 10-30 windows long, asked
twice (the second time the decode server reuses its cached prefix and the prefill server its own), and both
PD servers pass ``check_integrity`` with nothing held. A transport that moves one buffer (cuda_ipc) is refused
at start with the reason."""

from __future__ import annotations

import random

import httpx
import pytest

from harness.model_utils import tiny_model
from harness.pd_pair import nixl_pd_pair
from harness.server_utils import ServerProcess

pytestmark = pytest.mark.slow
NEW = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("gemma3-pd"), "gemma3", with_tokenizer=True,
                      max_position_embeddings=1024)


def generate(url: str, ids: list[int]) -> dict:
    r = httpx.post(url + "/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def internal(s: ServerProcess) -> dict:
    return httpx.get(s.url + "/get_server_info", timeout=30).json()["internal_states"][0]


def test_pd_moves_the_window_pages(model) -> None:
    # 512 logical pages, a 40-page window pool (160 tokens): the 240-token prompt does not fit it whole
    base = ["--model-path", str(model), "--served-model-name", "tiny", "--page-size", "4",
            "--max-total-tokens", "2048", "--enable-hybrid-swa-memory", "--swa-full-tokens-ratio", "0.078125"]
    rng = random.Random(3)
    shared = [rng.randrange(1, 49000) for _ in range(50)]
    prompts = [shared + [rng.randrange(1, 49000) for _ in range(n)] for n in (31, 78, 190)]
    with nixl_pd_pair(base, ["--disaggregation-decode-enable-radix-cache"]) as (router, p, d, c):
        for s in (p, d, c):
            assert internal(s)["pages"]["device_window"]["total"] == 40, internal(s)["pages"]
        want = [generate(c.url, ids)["output_ids"] for ids in prompts]
        for _ in range(2):
            got = [generate(router.url, ids) for ids in prompts]
            assert [g["output_ids"] for g in got] == want
        assert got[-1]["meta_info"]["cached_tokens"] > 0  # the second round: the prefill server's cache
        pd_p, pd_d = internal(p)["pd"], internal(d)["pd"]
        assert pd_p["sent"] == pd_d["received"] == 6 and pd_p["send_failed"] == pd_d["failed"] == 0, (pd_p, pd_d)
        assert pd_d["pages_reused"] > 0, pd_d  # the decode server's cached prefixes (their windows on L1)
        for s in (p, d):
            assert httpx.post(s.url + "/debug/check_integrity", timeout=60).json()["ok"]


def test_cuda_ipc_is_refused_with_the_window_pool(model) -> None:
    s = ServerProcess(["--model-path", str(model), "--disaggregation-mode", "decode", "--enable-hybrid-swa-memory",
                       "--disaggregation-transfer-backend", "cuda_ipc"])
    with pytest.raises(RuntimeError) as e:
        s.start(timeout=120)
    assert "the sliding layers' window pool travels too" in str(e.value), str(e.value)[-2000:]
