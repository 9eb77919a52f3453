"""Logprobs (SGLang's /generate fields) agree with HF transformers' log-softmax for SmolLM2 in
fp32, for prompt and generated tokens, with and without a cached prefix (a request asking for
prompt logprobs recomputes the positions whose logits they need)."""

from __future__ import annotations

import httpx
import pytest

from harness.model_utils import smollm2_path
from harness.server_utils import running_server

TOL = 1e-4
PROMPT = ("The history of the city goes back to a small fishing village on the river, where traders from "
          "the north came every summer to sell")


@pytest.fixture(scope="module")
def server():
    with running_server(["--model-path", str(smollm2_path()), "--dtype", "float32", "--page-size", "4",
                         "--max-total-tokens", "4096", "--hicache-ratio", "0"]) as s:
        yield s


@pytest.fixture(scope="module")
def hf():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def hf_logprobs(hf, ids: list[int]):
    import torch

    model, _ = hf
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # row p: the distribution of token p + 1


def generate(server, ids: list[int], **kw) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "return_logprob": True,
            **kw}
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def check_against_hf(hf, ids: list[int], out: dict, start: int, top: int = 0) -> None:
    meta = out["meta_info"]
    full = ids + out["output_ids"]
    ref = hf_logprobs(hf, full)
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(ids) - start
    for k, (lp, tok, _) in enumerate(inp):
        p = start + k
        assert tok == ids[p]
        if p == 0:
            assert lp is None
        else:
            assert abs(lp - ref[p - 1, tok].item()) < TOL, (p, lp, ref[p - 1, tok].item())
    outs = meta["output_token_logprobs"]
    assert [t for _, t, _ in outs] == out["output_ids"]
    for k, (lp, tok, _) in enumerate(outs):
        row = ref[len(ids) - 1 + k]
        assert abs(lp - row[tok].item()) < TOL
        assert tok == int(row.argmax())  # greedy: the chosen token is the top-1
    if top:
        for k, cand in enumerate(meta["output_top_logprobs"]):
            row = ref[len(ids) - 1 + k]
            assert [t for _, t, _ in cand] == row.topk(top).indices.tolist()
            assert all(abs(lp - row[t].item()) < TOL for lp, t, _ in cand)


@pytest.mark.slow
def test_logprobs_match_hf_prompt_and_output(server, hf) -> None:
    ids = hf[1].encode(PROMPT)
    out = generate(server, ids, logprob_start_len=0, top_logprobs_num=3)
    check_against_hf(hf, ids, out, start=0, top=3)
    # the same prompt again: its pages are cached, but the prompt logprobs need the logits, so they
    # are recomputed (cached_tokens 0), and agree again
    again = generate(server, ids, logprob_start_len=0)
    assert again["meta_info"]["cached_tokens"] == 0
    check_against_hf(hf, ids, again, start=0)
    # from a later position: the cache serves the pages before it
    start = len(ids) - 5
    late = generate(server, ids, logprob_start_len=start, token_ids_logprob=[ids[-1], 13])
    assert 0 < late["meta_info"]["cached_tokens"] <= start - 1
    check_against_hf(hf, ids, late, start=start)
    assert [t for _, t, _ in late["meta_info"]["output_token_ids_logprobs"][0]] == [ids[-1], 13]
    # output only (the default start): no prompt logprobs, and the whole prefix from the cache
    plain = generate(server, ids)
    assert plain["meta_info"]["input_token_logprobs"] == []
    assert plain["meta_info"]["cached_tokens"] >= len(ids) - 4
    check_against_hf(hf, ids, plain, start=len(ids))
    assert server.check_integrity()["running"] == 0


@pytest.mark.slow
def test_logprobs_scoring_stream_and_bad_input(server, hf) -> None:
    ids = hf[1].encode("Paris is the capital of France.")
    scored = generate(server, ids, logprob_start_len=0, sampling_params={"max_new_tokens": 0},
                      return_text_in_logprobs=True)
    assert scored["output_ids"] == [] and scored["meta_info"]["completion_tokens"] == 0
    assert scored["meta_info"]["input_token_logprobs"][1][2] == hf[1].decode([ids[1]])
    check_against_hf(hf, ids, scored, start=0)
    with httpx.stream("POST", server.url + "/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "stream": True,
            "return_logprob": True, "logprob_start_len": 2}, timeout=60) as r:
        chunks = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    import json

    last = json.loads(chunks[-1][6:])
    check_against_hf(hf, ids, last, start=2)
    for bad, word in (({"logprob_start_len": len(ids) + 1}, "logprob_start_len"), ({"top_logprobs_num": 99},
                      "top_logprobs_num"), ({"token_ids_logprob": [10**9]}, "token_ids_logprob")):
        r = httpx.post(server.url + "/generate", json={"input_ids": ids, "return_logprob": True, **bad}, timeout=30)
        assert r.status_code == 400 and word in r.text, r.text
    assert server.check_integrity()["running"] == 0


@pytest.mark.slow
def test_offline_engine_logprobs_match_hf(hf) -> None:
    """``Engine.generate`` takes sgl.Engine's logprob arguments and answers in /generate's shape,
    also for a prompt whose prefix is cached (and per prompt in a batch)."""
    from serving.engine import Engine

    eng = Engine(model_path=str(smollm2_path()), dtype="float32", page_size=4, max_total_tokens=2048,
                 hicache_ratio=0)
    try:
        ids = hf[1].encode(PROMPT)
        first = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 6, "temperature": 0},
                             return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
        check_against_hf(hf, ids, first, start=0, top=3)
        outs = eng.generate(input_ids=[ids, ids[:20]], sampling_params={"max_new_tokens": 4, "temperature": 0},
                            return_logprob=[True, False], logprob_start_len=5)
        assert outs[0]["meta_info"]["cached_tokens"] > 0
        check_against_hf(hf, ids, outs[0], start=5)
        assert "output_token_logprobs" not in outs[1]["meta_info"]
        eng.check_integrity()
    finally:
        eng.shutdown()
