"""A PD pair on one machine for tests: a prefill and a decode server over NIXL (UCX on loopback)
behind the real PD router, and a colocated server with the same flags as the reference; and the
skip where NIXL is not installed. (harness/pd_cluster.py is the heavier driver that also runs
Mooncake inside a network namespace.)"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest

from harness.server_utils import ServerProcess, free_port, start_all
from router.config import RouterConfig
from router.embedded import RouterThread

NIXL_FLAGS = ["--disaggregation-transfer-backend", "nixl", "--disaggregation-bootstrap-timeout-s", "30"]


def nixl_or_skip() -> None:
    """Skip the test where NIXL cannot be imported (``make setup`` installs nixl-cu12)."""
    try:
        from serving.disagg.transport_nixl import _api

        _api()
    except Exception as e:  # noqa: BLE001 - any import failure is a skip reason
        pytest.skip(f"NIXL is not installed (make setup installs nixl-cu12): {e}")


@contextmanager
def nixl_pd_pair(base: Sequence[str], decode_flags: Sequence[str] = ()
                 ) -> Iterator[tuple[RouterThread, ServerProcess, ServerProcess, ServerProcess]]:
    """(PD router, prefill server, decode server, colocated server): every server gets ``base``,
    the decode server ``decode_flags`` too; UCX over TCP on ``lo``, one OpenMP thread each."""
    nixl_or_skip()
    bp = free_port()
    p = ServerProcess([*base, *NIXL_FLAGS, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                       str(bp)])
    d = ServerProcess([*base, *NIXL_FLAGS, "--disaggregation-mode", "decode", *decode_flags])
    c = ServerProcess(list(base))
    old = {k: os.environ.get(k) for k in ("UCX_TLS", "UCX_NET_DEVICES", "OMP_NUM_THREADS")}
    os.environ.update(UCX_TLS=old["UCX_TLS"] or "tcp,self,sm", UCX_NET_DEVICES="lo", OMP_NUM_THREADS="1")
    try:
        start_all(p, d, c, timeout=360.0)  # three model loads at once on a shared 2-core machine
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    cfg = RouterConfig(pd_disaggregation=True, prefill_urls=((p.url, bp),), decode_urls=(d.url,),
                       tokenizer_workers=0, health_check_interval_s=60.0)
    try:
        with RouterThread(cfg) as r:
            yield r, p, d, c
    finally:
        for s in (p, d, c):
            if s.proc is not None and s.proc.poll() is None:
                s.stop()
