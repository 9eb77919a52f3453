"""A real ``mooncake_master`` on 127.0.0.1 inside a test's network namespace, and the server config
that points HiCache servers at it (``configs/mooncake.yaml`` with the master's addresses): what the
Mooncake driver scripts (tests/server/mooncake_two_servers.py, tests/router/mooncake_drain.py)
share. Run them with :func:`harness.netns.run_mooncake_script`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
RPC, HTTP, METRICS = 50051, 50080, 50090


class Master:
    def __init__(self, log: Path) -> None:
        self.log, self.proc = log, None

    def start(self) -> None:
        exe = Path(sys.executable).parent / "mooncake_master"
        argv = [str(exe), "--rpc_address=127.0.0.1", f"--rpc_port={RPC}", "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={HTTP}",
                f"--metrics_port={METRICS}"]
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{HTTP}/metadata", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("mooncake_master did not come up")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def config(work: Path, address: str) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "mooncake.yaml").read_text())
    cfg["cache"]["hicache_storage_backend_extra_config"] = {
        "master_server_address": f"127.0.0.1:{RPC}", "metadata_server": f"http://127.0.0.1:{HTTP}/metadata",
        "local_hostname": address, "global_segment_mb": 128, "local_buffer_mb": 64, "timeout_s": 1.0,
        "backoff_s": 0.2, "max_backoff_s": 1.0}
    cfg["cache"].update(hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=16)
    out = work / "mooncake.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out
