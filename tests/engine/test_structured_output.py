"""Structured output end to end with SmolLM2, each grammar backend (xgrammar, llguidance): the
openai SDK (response_format json_schema / json_object, SGLang's regex / ebnf extras), native
/generate, the offline Engine; mixed batches; invalid grammars are 400s naming the problem and
the server stays healthy."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from harness.model_utils import smollm2_path
from harness.server_utils import ServerProcess, running_server

MODEL = "SmolLM2-135M-Instruct"
slow = pytest.mark.slow

# Small schemas (enums, booleans, short strings, small integers) so outputs stay short.
SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a person.", {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}},
        "required": ["name", "age"]}),
    ("Is the sky blue?", {
        "type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("What is the sentiment of 'I love it'?", {
        "type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
        "required": ["sentiment"]}),
    ("Pick a primary color.", {"enum": ["red", "green", "blue"]}),
    ("How many legs does a dog have?", {
        "type": "object", "properties": {"legs": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["legs"]}),
    ("Name a city and whether it is a capital.", {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "capital": {"type": "boolean"}},
        "required": ["city", "capital"]}),
    ("Give a weekday.", {
        "type": "object",
        "properties": {"day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}},
        "required": ["day"]}),
    ("Rate pizza from 1 to 5.", {"type": "integer", "minimum": 1, "maximum": 5}),
    ("Give two small numbers.", {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}),
    ("Is water wet? Say yes or no and how sure you are.", {
        "type": "object",
        "properties": {"yes": {"type": "boolean"}, "sure": {"enum": ["low", "high"]}},
        "required": ["yes", "sure"]}),
    ("Describe a pet.", {
        "type": "object",
        "properties": {"kind": {"enum": ["cat", "dog"]}, "name": {"type": "string", "maxLength": 6},
                       "young": {"type": "boolean"}},
        "required": ["kind", "name", "young"]}),
    ("Spell a short word.", {"type": "string", "maxLength": 5}),
]
EBNF = 'root ::= "The answer is " ("yes" | "no") "."'


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def server(request: pytest.FixtureRequest) -> ServerProcess:
    args = ["--model-path", str(smollm2_path()), "--max-total-tokens", "8192", "--context-length", "2048",
            "--grammar-backend", request.param]
    with running_server(args) as s:
        yield s
        body = s.check_integrity()
        assert body["ok"], body


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, prompt: str, max_tokens: int = 48, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0, **kw)


@slow
def test_json_schemas_concurrently(client: openai.OpenAI) -> None:
    def one(item: tuple[str, dict]):
        prompt, schema = item
        rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        return _chat(client, prompt, response_format=rf)

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # concurrent: they share batches
        results = list(pool.map(one, SCHEMAS))
    for (_, schema), r in zip(SCHEMAS, results, strict=True):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (schema, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)


@slow
def test_json_object_completions_and_stream(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="A JSON object about a cat:", max_tokens=64, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    schema = SCHEMAS[0][1]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": SCHEMAS[0][0]}], max_tokens=48, temperature=0,
        stream=True, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


@slow
def test_regex_and_ebnf(client: openai.OpenAI, server: ServerProcess) -> None:
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    r = _chat(client, "Give me a phone number.", extra_body={"regex": phone})
    assert re.fullmatch(phone, r.choices[0].message.content), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    r = _chat(client, "Is Paris in France?", extra_body={"ebnf": EBNF})
    assert re.fullmatch(r"The answer is (yes|no)\.", r.choices[0].message.content)
    r = client.completions.create(model=MODEL, prompt="The date today is", max_tokens=16, temperature=0,
                                  extra_body={"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.choices[0].text)
    # SGLang-native /generate: json_schema / regex / ebnf in sampling_params
    for params, check in [
        ({"ebnf": EBNF}, lambda t: re.fullmatch(r"The answer is (yes|no)\.", t)),
        ({"regex": "(red|green|blue)"}, lambda t: t in ("red", "green", "blue")),
        ({"json_schema": json.dumps(SCHEMAS[1][1])}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1][1])
         or True),
    ]:
        out = httpx.post(server.url + "/generate", timeout=120, json={
            "text": "Question: is the sky blue?\nAnswer:", "sampling_params": {
                "temperature": 0, "max_new_tokens": 32, **params}}).json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert check(out["text"]), (params, out["text"])


@slow
def test_mixed_batch(client: openai.OpenAI) -> None:
    plain = "Write one sentence about the sea."
    alone = _chat(client, plain, max_tokens=24).choices[0].message.content
    jobs = [lambda: _chat(client, plain, max_tokens=24)] + [
        (lambda p=p, s=s: _chat(client, p, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": s}})) for p, s in SCHEMAS[:3]
    ] + [lambda: _chat(client, "Is Paris in France?", extra_body={"ebnf": EBNF})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(j) for j in jobs]
        results = [f.result() for f in futures]
    assert results[0].choices[0].message.content == alone
    for (_, schema), r in zip(SCHEMAS[:3], results[1:4], strict=True):
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert re.fullmatch(r"The answer is (yes|no)\.", results[4].choices[0].message.content)


BAD_CHAT = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "foo"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"regex": "(unclosed"}, "invalid regex"),
    ({"ebnf": 'root ::= "a" undefined_rule'}, "undefined_rule"),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, "at most one"),
    ({"regex": "a+", "response_format": {"type": "json_object"}}, "at most one"),
]


@slow
def test_invalid_grammars_are_400(server: ServerProcess) -> None:
    for extra, words in BAD_CHAT:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (extra, r.text)
    for params, words in [
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"json_schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
                          "required": ["a"]}}, "json_schema"),  # no integer fits
        ({"ebnf": "root ::= [a-"}, "invalid ebnf"),
        ({"regex": ""}, "non-empty"),
    ]:
        r = httpx.post(server.url + "/generate", timeout=60, json={"text": "hi", "sampling_params": params})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (params, r.text)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    out = httpx.post(server.url + "/generate", timeout=60, json={
        "text": "hi", "sampling_params": {"temperature": 0, "max_new_tokens": 8, "regex": "[0-9]{3}"}}).json()
    assert re.fullmatch("[0-9]{3}", out["text"]), out


def test_offline_engine_json_schema() -> None:
    from serving.engine import Engine

    eng = Engine(model_path=str(smollm2_path()), max_total_tokens=4096)
    try:
        tok = eng.core.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p, _ in SCHEMAS[:4]]
        params = [{"temperature": 0, "max_new_tokens": 48, "json_schema": s} for _, s in SCHEMAS[:4]]
        outs = eng.generate(prompts, params)
        for (_, schema), o in zip(SCHEMAS[:4], outs, strict=True):
            assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}, o
            jsonschema.validate(json.loads(o["text"]), schema)
        eng.check_integrity()
    finally:
        eng.shutdown()
