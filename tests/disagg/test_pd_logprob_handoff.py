"""The logprobs a PD prefill server hands to its decode server (serving/disagg/logprob_handoff.py):
a round trip through the real control channel; a malformed payload is a 400 to the peer; a
payload that does not fit the request's options fails the request instead of answering it."""

from __future__ import annotations

import json

import httpx
import torch

from serving.disagg import logprob_handoff
from serving.disagg.control import ControlServer
from serving.disagg.protocol import KVDone
from serving.runner.logprobs import LogprobState
from serving.structs.logprob_options import LogprobOptions

PROMPT = [3, 9, 4, 7, 1]


def _prefilled(opts: LogprobOptions) -> LogprobState:
    """A prefill side's state after its prompt and first token (token 2) were computed."""
    st = LogprobState.from_request(opts, PROMPT, vocab=16)
    assert st is not None
    g = torch.Generator().manual_seed(0)
    for pos in st.positions(0, len(PROMPT)):
        st.record_input(torch.randn(1, 16, generator=g), [PROMPT[pos + 1]])
    st.record_output(torch.randn(16, generator=g), 2, [])
    return st


def test_round_trip_through_the_control_channel() -> None:
    opts = LogprobOptions(0, 3, (5, 6))
    pre = _prefilled(opts)
    srv = ControlServer("127.0.0.1", 0, {"mode": "decode"})
    try:
        done = KVDone(7, True, first_token=2, logprobs=logprob_handoff.export(pre))
        assert httpx.post(srv.url + "/pd/done", content=json.dumps(done.to_dict()), timeout=10).status_code == 200
        [got] = srv.drain()
    finally:
        srv.close()
    dec = LogprobState.from_request(opts, PROMPT, vocab=16)
    assert logprob_handoff.adopt(dec, got.logprobs, got.first_token) is None
    assert dec.prompt_done and dec.take_new([2]) == pre.take_new([2])  # the same numbers, the same shape
    assert dec.input[0] == [None, PROMPT[0]] and len(dec.input) == len(PROMPT)


def test_bad_or_unfitting_logprobs_are_refused() -> None:
    srv = ControlServer("127.0.0.1", 0, {"mode": "decode"})
    try:
        good = logprob_handoff.export(_prefilled(LogprobOptions(2, 2)))
        for bad in ({"output": [[0.1, 2]]}, {**good, "output": [["x", 2]]}, {**good, "output_top": [[[True, 1]]]}):
            r = httpx.post(srv.url + "/pd/done", json={"room": 1, "ok": True, "first_token": 2, "logprobs": bad})
            assert r.status_code == 400 and "KVDone.logprobs" in r.json()["error"], r.text
        assert srv.drain() == []
    finally:
        srv.close()
    # a decode request whose options differ from what was computed: refused, state untouched
    for opts in (LogprobOptions(0, 2), LogprobOptions(2, 3), LogprobOptions(2, 2, (1,))):
        dec = LogprobState.from_request(opts, PROMPT, vocab=16)
        before = list(dec.input)
        assert logprob_handoff.adopt(dec, good, 2) is not None and dec.input == before and dec.output == []
    dec = LogprobState.from_request(LogprobOptions(2, 2), PROMPT, vocab=16)
    assert logprob_handoff.adopt(dec, good, 9) is not None and dec.output == []  # another first token
    assert "sent no logprobs" in logprob_handoff.adopt(dec, None, 2)
    assert logprob_handoff.adopt(None, None, 2) is None  # not asked: nothing to do
