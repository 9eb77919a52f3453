"""Speculative decoding on a PD decode server (issue 30): the decode side drafts from its own tree
(the prompt pages the prefill side sent it, its earlier answers) and from the request's prompt,
and verifies them; the greedy answers stay token-identical to a colocated server without
speculation -- single requests, a batch, a stream -- drafts are verified and accepted there, and
the decode server's cache passes its integrity check afterwards.

A prefill and a decode server (NIXL over UCX on loopback) behind the real PD router, and a
colocated reference, the same tiny random model (fp32 on the CPU): a random model's greedy answers
fall into loops, which the n-gram drafter predicts, so the drafts are accepted as a real model's
repeated text would be.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from harness.pd_pair import nixl_pd_pair
from harness.server_utils import ServerProcess
from router.embedded import RouterThread

pytestmark = pytest.mark.slow
PROMPTS = ["one two three one two three one two three one two", "the cat sat on the mat and the cat sat on",
           "a b c d a b c d a b c", "Repeat after me: hello world hello world hello"]


@pytest.fixture(scope="module")
def cluster(tiny_chat_model) -> Iterator[tuple[RouterThread, ServerProcess, ServerProcess]]:
    """(PD router, decode server with NGRAM speculation, colocated server without)."""
    base = ["--model-path", str(tiny_chat_model), "--served-model-name", "tiny", "--enable-debug-endpoints"]
    with nixl_pd_pair(base, ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5"]) as (
            r, _, d, c):
        yield r, d, c


def _generate(url: str, text: str | list[str], stream: bool = False) -> list[list[int]]:
    body = {"text": text, "stream": stream, "sampling_params": {"temperature": 0, "max_new_tokens": 40,
                                                                "ignore_eos": True}}
    if not stream:
        r = httpx.post(url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        return [o["output_ids"] for o in (out if isinstance(out, list) else [out])]
    ids: list[int] = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ids = json.loads(line[6:])["output_ids"]  # cumulative, as SGLang streams them
    return [ids]


def _spec_steps(s: ServerProcess) -> tuple[float, float]:
    """(verify steps, accepted draft tokens) from the server's /metrics."""
    text = httpx.get(s.url + "/metrics", timeout=30).text

    def value(name: str) -> float:
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))
    return value("hicache_spec_verify_steps_total"), value("hicache_spec_accepted_tokens_total")


def test_decode_side_speculation_is_token_identical(cluster: tuple[RouterThread, ServerProcess, ServerProcess]):
    r, d, c = cluster
    for text in PROMPTS:  # one at a time
        assert _generate(r.url, text) == _generate(c.url, text), text
    assert _generate(r.url, PROMPTS) == _generate(c.url, PROMPTS)  # a batch
    assert _generate(r.url, PROMPTS[0], stream=True) == _generate(c.url, PROMPTS[0])  # a stream
    for text in PROMPTS:  # again: the decode side now drafts from its own tree too
        assert _generate(r.url, text) == _generate(c.url, text), text
    verified, accepted = _spec_steps(d)
    assert verified > 0 and accepted > 0, (verified, accepted)
    assert _spec_steps(c) == (0.0, 0.0)  # the reference never speculated
    assert d.check_integrity()["ok"]
