"""NGRAM speculative decoding through a real ``hicache serve``: streamed and whole answers of
/generate and the OpenAI API equal plain decoding's (the offline engine without speculation),
``meta_info`` carries SGLang's spec_* fields, /metrics the counters; integrity holds; a bad flag
is a one-line configuration error."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from harness.server_utils import running_server
from serving.engine import Engine
from serving.launch import cli

ARGS = ["--page-size", "4", "--max-total-tokens", "4096", "--hicache-ratio", "0", "--enable-debug-endpoints"]
G = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with running_server(["--model-path", str(tiny_chat_model), *ARGS, "--speculative-algorithm", "NGRAM",
                         "--speculative-num-draft-tokens", "6"]) as s:
        yield s


def prompts(n: int) -> list[list[int]]:
    base = [[3 + (i * 7 + j * 13) % 400 for j in range(20)] for i in range(n)]
    return [p + p[:10] for p in base]


@pytest.fixture(scope="module")
def plain(tiny_chat_model):
    eng = Engine(model_path=str(tiny_chat_model), page_size=4, max_total_tokens=4096, hicache_ratio=0)
    yield eng
    eng.shutdown()


def stream_ids(url: str, body: dict) -> tuple[list[int], dict]:
    last = None
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[len("data: "):])
    return last["output_ids"], last["meta_info"]


def test_outputs_meta_info_and_metrics(server, plain):
    ps = prompts(4)
    want = [o["output_ids"] for o in plain.generate(input_ids=ps, sampling_params=G)]
    for _ in range(2):  # the second time the drafts come from the tree (the first answers)
        r = httpx.post(server.url + "/generate", json={"input_ids": ps, "sampling_params": G}, timeout=120)
        assert r.status_code == 200, r.text
        outs = r.json()
        assert [o["output_ids"] for o in outs] == want
    meta = outs[0]["meta_info"]
    for key in ("spec_verify_ct", "spec_accept_length", "spec_accept_rate", "spec_draft_token_num",
                "spec_accept_token_num"):
        assert key in meta, meta
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > 0
    got, smeta = stream_ids(server.url, {"input_ids": ps[1], "sampling_params": G})
    assert got == want[1] and smeta["spec_verify_ct"] >= 1
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    chat = [{"role": "user", "content": "red green blue red green blue red green"}]
    name = str(plain.config.model.model_path)
    whole = client.chat.completions.create(model=name, messages=chat, temperature=0, max_tokens=30)
    parts = client.chat.completions.create(model=name, messages=chat, temperature=0, max_tokens=30, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == whole.choices[0].message.content
    tok = plain.core.tokenizer
    ref = plain.generate(tok.apply_chat_template(chat), sampling_params={"temperature": 0, "max_new_tokens": 30})
    assert whole.choices[0].message.content == ref["text"]
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("hicache_spec_")}
    assert values["hicache_spec_verify_steps_total"] > 0
    assert 0 < values["hicache_spec_accepted_tokens_total"] <= values["hicache_spec_draft_tokens_total"]
    assert "hicache_spec_index_positions" in values and "hicache_spec_auto_off_total" in values
    check = httpx.post(server.url + "/debug/check_integrity", timeout=30).json()
    assert check["ok"], check


def test_bad_speculative_flags_are_configuration_errors(capsys):
    assert cli.main(["serve", "--speculative-algorithm", "EAGLE"]) == 2
    assert "speculative_algorithm" in capsys.readouterr().err
    assert cli.main(["serve", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "1"]) == 2
    assert "speculative_num_draft_tokens" in capsys.readouterr().err
