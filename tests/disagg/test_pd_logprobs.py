"""PD through the real PD router (issue 25, findings 6 and 5): logprobs equal to a colocated
server's, and a decode server killed mid-stream.

A prefill and a decode server (NIXL over UCX on loopback) and a colocated reference, the same
tiny model (a long context, so a stream is thousands of tokens from its end when the decode
server dies). The first token is sampled on the prefill side, and only it computes the prompt:
its logprob, top_logprobs and the prompt's (input) logprobs must travel to the decode side,
not be made up there (it answered logprob 0.0 with one top entry, and no input logprobs).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from harness.pd_pair import nixl_or_skip, nixl_pd_pair
from harness.server_utils import ServerProcess, kill_tree
from router.embedded import RouterThread

pytestmark = pytest.mark.slow
TOL = 1e-4
MSGS = [{"role": "user", "content": "Name three large animals and say why they are large."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterThread, ServerProcess, ServerProcess]]:
    """(PD router, decode server, colocated server)."""
    nixl_or_skip()
    from harness.model_utils import tiny_model

    model = tiny_model(tmp_path_factory.mktemp("tiny-pd-long"), with_tokenizer=True, max_position_embeddings=16384)
    base = ["--model-path", str(model), "--served-model-name", "tiny", "--max-total-tokens", "32768"]
    with nixl_pd_pair(base) as (r, _, d, c):
        yield r, d, c


def _close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and abs(a - b) <= TOL)


def _same_rows(got: list, ref: list) -> None:
    """SGLang triples ``[logprob, token_id, text]``, or per position lists of them (or None)."""
    assert len(got) == len(ref), (len(got), len(ref))
    for g, r in zip(got, ref, strict=True):
        if r is None or (r and isinstance(r[0], list)):
            assert (g is None) == (r is None), (g, r)
            if r is not None:
                _same_rows(g, r)
            continue
        assert g[1:] == r[1:] and _close(g[0], r[0]), (g, r)


def test_chat_logprobs_through_pd_equal_colocated(cluster: tuple[RouterThread, ServerProcess, ServerProcess]) -> None:
    r, _, c = cluster
    kw = {"model": "tiny", "messages": MSGS, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    pd = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0).chat.completions.create(**kw)
    ref = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0).chat.completions.create(**kw)
    got, want = pd.choices[0].logprobs.content, ref.choices[0].logprobs.content
    assert [t.token for t in got] == [t.token for t in want] and len(got) == 6
    for g, w in zip(got, want, strict=True):
        assert abs(g.logprob - w.logprob) <= TOL, (g, w)
        assert len(g.top_logprobs) == 3 and [t.token for t in g.top_logprobs] == [t.token for t in w.top_logprobs]
        assert all(abs(a.logprob - b.logprob) <= TOL for a, b in zip(g.top_logprobs, w.top_logprobs, strict=True))
    assert got[0].logprob < -1e-3  # the first token's own logprob, not the 0.0 of a token nobody sampled
    # streamed: the same numbers, chunk by chunk
    stream = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        **kw, stream=True)
    streamed = [t for ch in stream if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in want]
    assert all(abs(g.logprob - w.logprob) <= TOL for g, w in zip(streamed, want, strict=True))


def test_generate_input_and_output_logprobs_through_pd(
        cluster: tuple[RouterThread, ServerProcess, ServerProcess]) -> None:
    r, _, c = cluster
    body = {"text": "The quick brown fox jumps over the lazy dog because", "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 3, "token_ids_logprob": [5, 77],
            "sampling_params": {"temperature": 0, "max_new_tokens": 5}}
    ref = httpx.post(c.url + "/generate", json=body, timeout=120).json()["meta_info"]
    assert len(ref["input_token_logprobs"]) == ref["prompt_tokens"] and ref["input_token_logprobs"][0][0] is None
    for _ in range(2):  # the second time the prefill server holds the prompt in its cache
        got = httpx.post(r.url + "/generate", json=body, timeout=120)
        assert got.status_code == 200, got.text
        meta = got.json()["meta_info"]
        for key in ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
                    "input_token_ids_logprobs", "output_token_ids_logprobs"):
            _same_rows(meta[key], ref[key])
    # from the middle of the prompt: only the positions asked for
    body["logprob_start_len"] = 4
    ref = httpx.post(c.url + "/generate", json=body, timeout=120).json()["meta_info"]
    meta = httpx.post(r.url + "/generate", json=body, timeout=120).json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == ref["prompt_tokens"] - 4
    _same_rows(meta["input_token_logprobs"], ref["input_token_logprobs"])
    _same_rows(meta["input_top_logprobs"], ref["input_top_logprobs"])


def test_decode_killed_mid_stream_ends_with_an_error(
        cluster: tuple[RouterThread, ServerProcess, ServerProcess]) -> None:
    """Last in this module: the decode server does not come back."""
    r, d, _ = cluster
    long = 12000
    stream = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=long, stream=True, extra_body={"ignore_eos": True})
    assert next(stream).choices[0].delta.role == "assistant"
    body = {"text": "Once upon a time", "stream": True, "sampling_params": {"max_new_tokens": long,
                                                                            "ignore_eos": True}}
    with httpx.stream("POST", r.url + "/generate", json=body, timeout=120) as raw:
        assert raw.status_code == 200
        lines = raw.iter_lines()
        assert next(lines).startswith("data: {")
        kill_tree(d.proc)  # a crash, not a shutdown
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]", rest[-3:]
    err = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert err["code"] == "502" and d.url in err["message"] and "incomplete" in err["message"], err
    with pytest.raises(openai.APIError) as e:
        for chunk in stream:
            assert chunk.choices[0].finish_reason is None
    assert "incomplete" in e.value.message
    deadline = time.monotonic() + 15  # the router checks the decode server at once (its own checks: 60 s apart)
    while True:
        workers = httpx.get(r.url + "/list_workers", timeout=10).json()["workers"]
        decode = next(w for w in workers if w["url"] == d.url)
        if (not decode["healthy"] and decode["in_flight"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not decode["healthy"] and decode["requests_failed"] >= 2 and decode["in_flight"] == 0, decode
    assert httpx.get(r.url + "/health", timeout=10).status_code == 503  # no decode server is left
