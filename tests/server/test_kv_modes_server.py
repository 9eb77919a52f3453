"""KV modes through the real server: the flags reach the engine (int8 L2 + L3 on LMDB, a restart
serves the conversation from L3 with the same tokens), and a bad or conflicting flag stops the
server at start-up with a message naming it."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import yaml

from harness.server_utils import ROOT, running_server

IDS = list(range(20, 84))  # 64 prompt tokens: 16 pages of 4


def generate(url: str) -> dict:
    r = httpx.post(url + "/generate", timeout=120, json={
        "input_ids": IDS, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def test_int8_tiers_survive_a_restart_through_the_server(tmp_path, tiny_chat_model):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"model_path": str(tiny_chat_model)},
        "scheduler": {"max_total_tokens": 512},
        "cache": {"page_size": 4, "hicache_ratio": 2.0, "hicache_mem_layout": "page_first",
                  "hicache_storage_backend": "lmdb", "hicache_storage_prefetch_policy": "wait_complete",
                  "hicache_storage_prefetch_threshold": 8, "hicache_storage_load_policy": "always_load",
                  "hicache_storage_backend_extra_config": {"path": str(tmp_path / "l3"), "capacity_gb": 0.05,
                                                           "initial_map_mb": 1}}}))
    flags = ["--config", str(cfg), "--hicache-l2-encoding", "int8", "--hicache-l3-encoding", "int8"]
    with running_server(flags) as s:
        cold = generate(s.url)
        assert cold["meta_info"]["cached_tokens"] == 0
        hit = generate(s.url)  # an L1 hit: write_through backs the pages up to L2 now
        assert hit["meta_info"]["cached_tokens"] > 0 and hit["output_ids"] == cold["output_ids"]
        text = httpx.get(s.url + "/metrics", timeout=30).text
        pages, nbytes = (float(re.search(rf'^hicache_tenant_{m}\{{tenant="default",tier="host"\}} (\S+)$', text,
                                         re.M).group(1)) for m in ("pages", "bytes"))
        # an int8 page of the tiny model: 2 layers x K/V x 4 tokens x 2 kv heads x (16 codes + 1 scale)
        assert pages > 0 and nbytes / pages == 2 * 2 * 4 * 2 * (16 + 1)
    with running_server(flags) as s:  # L1 and L2 empty; L3 holds the int8 pages
        warm = generate(s.url)
        assert warm["meta_info"]["cached_tokens_details"]["storage"] > 0, warm["meta_info"]
        assert warm["output_ids"] == cold["output_ids"]
        assert s.check_integrity()["ok"]


def test_bad_and_conflicting_kv_flags_stop_the_server_with_a_message(tiny_chat_model):
    for flags, message in (
            (["--hicache-l2-encoding", "fp4"], "hicache_l2_encoding must be one of raw, fp8, int8"),
            (["--kv-cache-dtype", "fp8_e4m3", "--hicache-l3-encoding", "int8"], "needs a 16- or 32-bit L1"),
            (["--hicache-l2-encoding", "fp8", "--hicache-l3-encoding", "int8"], "two different lossy encodings")):
        out = subprocess.run([sys.executable, "-m", "serving.launch.cli", "serve", "--model-path", str(tiny_chat_model),
                              *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0
        assert message in out.stderr + out.stdout, out.stderr
        assert "Traceback" not in out.stderr
