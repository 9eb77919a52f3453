"""PD control channel and messages: page geometry, message validation, and a bootstrap port that
answers bad input with a clear 4xx (a real HTTP server on 127.0.0.1, a real client)."""

from __future__ import annotations

import json

import httpx
import pytest

from serving.disagg.control import ControlServer
from serving.disagg.protocol import DecodeTarget, KVDone, KVGeometry, prompt_digest

GEO = KVGeometry(num_layers=2, page_size=16, num_kv_heads=3, head_dim=64, dtype="float32", num_pages=10, base=1000)


def _target(**kw: object) -> dict:
    t = DecodeTarget(room=7, prompt_len=40, prompt_digest=prompt_digest(list(range(40))), endpoint={"session": "x"},
                     geometry=GEO, pages=[4, 5, 6], skip_pages=0, notify_url="http://127.0.0.1:1/pd/done").to_dict()
    return {**t, **kw}


def test_geometry_addresses_and_mismatch() -> None:
    assert GEO.chunk == 16 * 3 * 64 * 4
    got = GEO.addrs([3, 4]).tolist()
    planes = [1000 + plane * 10 * GEO.chunk for plane in range(4)]  # K0, K1, V0, V1 ... in (kv, layer) order
    assert got == [b + p * GEO.chunk for b in planes for p in (3, 4)]
    with pytest.raises(ValueError, match="outside the pool"):
        GEO.addrs([10])
    other = KVGeometry(2, 16, 3, 64, "bfloat16", 99, 5)
    assert "dtype" in GEO.mismatch(other)
    assert GEO.mismatch(KVGeometry(2, 16, 3, 64, "float32", 99, 5)) is None  # pool size and address may differ


def test_messages_round_trip_and_reject_bad_fields() -> None:
    t = DecodeTarget.from_dict(json.loads(json.dumps(_target())))
    assert t.geometry == GEO and t.pages == [4, 5, 6]
    with pytest.raises(ValueError, match="unknown fields"):
        DecodeTarget.from_dict(_target(evil=1))
    with pytest.raises(ValueError):
        DecodeTarget.from_dict(_target(skip_pages=-1))
    with pytest.raises(ValueError):
        DecodeTarget.from_dict({"room": 1})
    d = KVDone(7, True, first_token=3, cached_tokens=16)
    assert KVDone.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    assert prompt_digest([1, 23]) != prompt_digest([12, 3])


def test_bootstrap_port_answers_bad_input_with_4xx() -> None:
    srv = ControlServer("127.0.0.1", 0, {"mode": "prefill"})
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert c.get("/pd/info").json() == {"mode": "prefill"}
            assert c.get("/nope").status_code == 404
            assert c.post("/pd/target", content=b"{not json").status_code == 400
            r = c.post("/pd/target", json=_target(evil=1))
            assert r.status_code == 400 and "unknown fields" in r.json()["error"]
            assert c.post("/pd/target", content=b"").status_code == 400
            assert c.post("/pd/done", json={"room": 1}).status_code == 400  # "ok" is required
            assert srv.drain() == []  # nothing bad reached the engine
            assert c.post("/pd/target", json=_target()).status_code == 200
            assert c.post("/pd/done", json={"room": 7, "ok": True, "first_token": 5}).status_code == 200
            got = srv.drain()
            assert isinstance(got[0], DecodeTarget) and got[1] == KVDone(7, True, first_token=5)
    finally:
        srv.close()


def test_geometry_names_a_model_tag_mismatch() -> None:
    a = KVGeometry(2, 16, 3, 64, "float32", 10, 0, "q:int8v2|rt:raw")
    b = KVGeometry(2, 16, 3, 64, "float32", 10, 0, "q:none|rt:raw")
    assert a.mismatch(b) == "model_tag differs: q:int8v2|rt:raw here, q:none|rt:raw on the peer"
    assert a.mismatch(KVGeometry(2, 16, 3, 64, "float32", 99, 5, "q:int8v2|rt:raw")) is None
