"""Anthropic prompt-caching breakpoints (``cache_control``) with the real ``anthropic`` SDK against a
real server with small L1 and L2 and an LMDB L3: a multi-turn agent conversation whose pinned
prefixes survive floods that evict everything unpinned, Anthropic's usage counts, per-tenant
/metrics, the TTL's end (the lease clock moved on by /debug/advance_kv_clock, no waiting), the
limits (400s; past the pin quota or a lease cap the oldest breakpoints give way: never a 429), a
1 h breakpoint flood that locks no one out, a flush that keeps pins, /cache/pin's TTL cap, and the
same field on /generate and /v1/chat/completions."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import pytest

from harness.server_utils import running_server

PS = 16
SYSTEM = "You are a careful coding agent. You read files, run tools and answer briefly. " * 12
EPH = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory):
    l3 = tmp_path_factory.mktemp("cc-l3")
    args = ["--model-path", str(tiny_chat_model), "--served-model-name", "tiny", "--page-size", str(PS),
            "--max-total-tokens", "1024", "--hicache-ratio", "2", "--hicache-storage-backend", "lmdb",
            "--hicache-storage-backend-extra-config", f'{{"path": "{l3}", "capacity_gb": 1}}',
            "--max-pin-leases", "12", "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-load-policy", "always_load"]
    with running_server(args) as s:
        yield s


def metric(s, name: str, tenant: str = "default") -> float:
    text = httpx.get(s.url + "/metrics", timeout=30).text
    m = re.search(rf'^{name}\{{tenant="{tenant}"\}} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def flood(s, seed: int, n: int = 14) -> None:
    """Unpinned prompts of 400 tokens: together several times L1 + L2 (1024 + 2048 tokens)."""
    for p in range(n):
        ids = [(seed * 7919 + p * 131 + i * 17) % 40000 + 100 for i in range(400)]
        r = httpx.post(s.url + "/generate", timeout=120, json={
            "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}})
        assert r.status_code == 200, r.text


def on_l1_l2(s, messages: list[dict]) -> int:
    r = httpx.post(s.url + "/cache/lookup", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    c = r.json()["cached_tokens"]
    return c["L1"] + c["L2"]


def turn(client, history: list[dict], user: str, max_tokens: int = 8):
    """One agent turn: the system block and the last user message carry breakpoints."""
    msgs = [*history, {"role": "user", "content": [{"type": "text", "text": user, "cache_control": HOUR}]}]
    system = [{"type": "text", "text": SYSTEM, "cache_control": EPH}]
    r = client.messages.create(model="tiny", system=system, messages=msgs, max_tokens=max_tokens, extra_body=GREEDY)
    total = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=msgs).input_tokens
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == total, u
    plain = [*history, {"role": "user", "content": user}, {"role": "assistant", "content": r.content[0].text}]
    return r, plain


def test_breakpoints_over_an_agent_conversation(server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    history: list[dict] = []
    r1, history = turn(client, history, "List the files in the repository and say which one holds the tests.")
    assert r1.usage.cache_creation_input_tokens > 0 and r1.usage.cache_read_input_tokens == 0
    pinned = r1.usage.cache_creation_input_tokens  # the prefix through the last breakpoint, in whole pages
    assert pinned % PS == 0
    bystander = [{"role": "user", "content": "An unpinned question nobody asks again. " * 6}]
    httpx.post(server.url + "/v1/chat/completions", timeout=60, json={"model": "tiny", "messages": bystander,
                                                                        "max_tokens": 1}).raise_for_status()
    assert on_l1_l2(server, bystander) > 0
    users = ["Open tests/server/test_cache_control.py and summarise it in one line.",
             "Now run the test file and report which tests failed, if any, with their names.",
             "Thanks. Propose a one-line fix for the first failure you saw."]
    for k, user in enumerate(users):
        flood(server, seed=k + 1)
        assert on_l1_l2(server, bystander) == 0  # the flood evicted everything unpinned from L1 and L2
        r, history = turn(client, history, user)
        u = r.usage
        assert u.cache_read_input_tokens == pinned, (k, u)  # exactly the pinned prefix, back from L2
        assert u.cache_read_input_tokens_details["host"] > 0, u  # it had been demoted, not dropped
        assert u.cache_creation_input_tokens > 0 and (pinned + u.cache_creation_input_tokens) % PS == 0, u
        pinned += u.cache_creation_input_tokens
    assert metric(server, "hicache_tenant_pinned_pages") == pinned // PS
    assert metric(server, "hicache_tenant_prompt_cache_creation_tokens_total") == pinned
    read_before = metric(server, "hicache_tenant_prompt_cache_read_tokens_total")
    assert read_before > 0

    # the TTLs end (1 h and 5 min): the clock moves on instead of the test waiting
    r = httpx.post(server.url + "/debug/advance_kv_clock", json={"seconds": 3601}, timeout=30)
    assert r.status_code == 200, r.text
    assert metric(server, "hicache_tenant_pinned_pages") == 0  # the pins are gone
    flood(server, seed=9)
    r, _ = turn(client, history[:-2], users[-1])  # the last turn again, its pins gone
    u = r.usage
    details = u.cache_read_input_tokens_details
    assert details.get("host", 0) == 0, u  # nothing was kept in L2 for it: the flood evicted the unpinned pages
    assert details["storage"] == u.cache_read_input_tokens > 0, u  # what it reads is L3's (written back)
    assert metric(server, "hicache_tenant_pinned_pages") > 0  # pinned afresh
    assert metric(server, "hicache_tenant_prompt_cache_read_tokens_total") == read_before + u.cache_read_input_tokens
    assert server.check_integrity()["ok"]


def test_limits_and_bad_breakpoints(server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    block = {"type": "text", "text": "x", "cache_control": EPH}
    with pytest.raises(anthropic.BadRequestError, match="A maximum of 4 blocks with cache_control"):
        client.messages.create(model="tiny", max_tokens=1, system=[block, block],
                               messages=[{"role": "user", "content": [block, block, block]}])
    with pytest.raises(anthropic.BadRequestError, match='ttl: must be "5m" or "1h"'):
        client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "10m"}}]}])
    with pytest.raises(anthropic.BadRequestError, match="ephemeral"):
        client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "persistent"}}]}])
    # distinct prompts of 4 breakpoints each past the lease cap (--max-pin-leases 12): never refused, the
    # oldest breakpoints give way (issue 42: the cap used to be a 429 for every cache_control request)
    httpx.post(server.url + "/debug/advance_kv_clock", json={"seconds": 3601}, timeout=30).raise_for_status()
    released = []
    for i in range(6):
        text = f"Prompt number {i} says " * 4
        content = [{"type": "text", "text": text * (j + 1), "cache_control": EPH} for j in range(4)]
        u = client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": content}]).usage
        assert u.cache_creation_input_tokens > 0 and not u.cache_control["not_pinned"], u
        released.append(u.cache_control["released_breakpoints"])
    assert released == [0, 0, 0, 4, 4, 4], released  # each took the 4 leases of the oldest request
    httpx.post(server.url + "/debug/advance_kv_clock", json={"seconds": 301}, timeout=30).raise_for_status()
    # streaming: the final usage (message_delta) carries the pin's counts
    block = {"type": "text", "text": "Stream a pinned answer. " * 6, "cache_control": EPH}
    msgs = [{"role": "user", "content": [block]}]
    with client.messages.stream(model="tiny", max_tokens=4, messages=msgs, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.usage.cache_creation_input_tokens > 0 and final.usage.cache_creation_input_tokens % PS == 0
    assert server.check_integrity()["ok"]


def test_neutral_field_on_generate_and_chat(server) -> None:
    ids = [(i * 37) % 30000 + 200 for i in range(100)]
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1},
            "cache_control": {"type": "ephemeral", "ttl": "5m"}}
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    cc = r.json()["meta_info"]["cache_control"]
    assert cc["pinned_tokens"] == 96 and cc["cache_creation_tokens"] == 96, cc
    flood(server, seed=21)
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    cc = r.json()["meta_info"]["cache_control"]
    assert cc["cache_read_tokens"] == 96 and cc["cache_creation_tokens"] == 0, cc
    bad = httpx.post(server.url + "/generate", json={**body, "cache_control": {"type": "ephemeral", "ttl": 5}})
    assert bad.status_code == 400 and "ttl" in bad.text
    msgs = [{"role": "user", "content": "Pin this chat prompt please. " * 8}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": msgs, "max_tokens": 1, "cache_control": {"type": "ephemeral"}})
    assert r.status_code == 200, r.text
    body = r.json()
    cc = body["meta_info"]["cache_control"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cc["cache_read_tokens"], body  # it stays
    assert cc["cache_creation_tokens"] > 0 and cc["pinned_tokens"] == body["usage"]["prompt_tokens"] // PS * PS, body


def sse_chunks(s, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", s.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(ln) for ln in lines[:-1]]


def test_streamed_cache_control_on_generate_and_chat(server) -> None:
    httpx.post(server.url + "/debug/advance_kv_clock", json={"seconds": 3601}, timeout=30).raise_for_status()
    ids = [(i * 53) % 30000 + 300 for i in range(70)]
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 3},
            "cache_control": {"type": "ephemeral"}, "stream": True}
    chunks = sse_chunks(server, "/generate", body)
    cc = chunks[-1]["meta_info"]["cache_control"]
    assert cc["pinned_tokens"] == 64 and cc["cache_creation_tokens"] == 64, cc  # the same pin as unstreamed
    assert all("cache_control" not in c["meta_info"] for c in chunks[:-1])
    flood(server, seed=31)
    r = httpx.post(server.url + "/generate", json={**body, "stream": False}, timeout=60)
    cc = r.json()["meta_info"]["cache_control"]
    assert cc["cache_read_tokens"] == 64 and cc["cache_creation_tokens"] == 0, cc

    msgs = [{"role": "user", "content": "Stream and pin this chat prompt, then answer. " * 8}]
    chat = {"model": "tiny", "messages": msgs, "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    chunks = sse_chunks(server, "/v1/chat/completions", chat)
    [last] = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    cc = last["meta_info"]["cache_control"]
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    assert cc["cache_creation_tokens"] > 0 and cc["pinned_tokens"] == prompt // PS * PS, (cc, prompt)
    flood(server, seed=32)
    r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "stream": False, "stream_options": None},
                   timeout=60)
    body = r.json()
    assert body["meta_info"]["cache_control"]["cache_read_tokens"] == prompt // PS * PS, body
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt // PS * PS, body
    assert server.check_integrity()["ok"]


def schema(**props: str) -> dict:
    return {"type": "object", "properties": {k: {"type": "string", "description": d} for k, d in props.items()},
            "required": list(props)}


TOOLS = [
    {"name": "read_file", "description": "Read a file of the repository and return its text.",
     "input_schema": schema(path="the file's path, relative to the repository root")},
    {"name": "run_tests", "description": "Run one test file of the suite and report which tests failed.",
     "input_schema": schema(path="the test file", k="a pytest -k selection, or empty for all")},
    {"name": "write_file", "description": "Replace the text of a file of the repository.",
     "input_schema": schema(path="the file's path", text="the new text"), "cache_control": EPH},
]


def test_breakpoint_on_tool_definitions(server, tiny_chat_model: Path) -> None:
    from transformers import AutoTokenizer

    httpx.post(server.url + "/debug/advance_kv_clock", json={"seconds": 3601}, timeout=30).raise_for_status()
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    tool_tokens = len(tok.encode("\n".join(json.dumps(t) for t in TOOLS)))  # the tools' JSON alone
    user = "Which tool would you use to see the failing tests? Answer in one short line, please. " * 2
    msgs = [{"role": "user", "content": user}]
    r1 = client.messages.create(model="tiny", tools=TOOLS, messages=msgs, max_tokens=4, extra_body=GREEDY)
    total = client.messages.count_tokens(model="tiny", tools=TOOLS, messages=msgs).input_tokens
    u = r1.usage
    assert r1.content[0].type == "text" and r1.stop_reason in ("end_turn", "max_tokens")
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == total, u
    pinned = u.cache_creation_input_tokens  # the prefix through the end of the tools, in whole pages
    assert pinned % PS == 0 and tool_tokens // PS * PS <= pinned <= total - len(tok.encode(user)), (u, tool_tokens)
    flood(server, seed=41)
    other = [{"role": "user", "content": "A different question: what does write_file replace? " * 2}]
    r2 = client.messages.create(model="tiny", tools=TOOLS, messages=other, max_tokens=4, extra_body=GREEDY,
                                tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert r2.usage.cache_read_input_tokens == pinned and r2.usage.cache_creation_input_tokens == 0, r2.usage

    # a tool call and its result in the history; a breakpoint on the tool_result block
    history = [*other, {"role": "assistant", "content": [
        {"type": "text", "text": "I will read it."},
        {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "serving/tools.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "def f(): pass",
                                      "cache_control": EPH}]}]
    r3 = client.messages.create(model="tiny", tools=TOOLS, messages=history, max_tokens=4, extra_body=GREEDY)
    total3 = client.messages.count_tokens(model="tiny", tools=TOOLS, messages=history).input_tokens
    assert r3.usage.cache_read_input_tokens >= pinned and r3.usage.cache_creation_input_tokens > 0, r3.usage
    through = r3.usage.cache_read_input_tokens + r3.usage.cache_creation_input_tokens  # up to the tool_result
    assert through % PS == 0 and total3 - 2 * PS < through <= total3, (r3.usage, total3)

    # the tools' breakpoint counts among the 4; malformed tools are 400s naming the field
    block = {"type": "text", "text": "x", "cache_control": EPH}
    with pytest.raises(anthropic.BadRequestError, match="A maximum of 4 blocks with cache_control"):
        client.messages.create(model="tiny", max_tokens=1, tools=TOOLS, system=[block, block],
                               messages=[{"role": "user", "content": [block, block]}])
    nameless = {k: v for k, v in TOOLS[0].items() if k != "name"}
    with pytest.raises(anthropic.BadRequestError, match=r"tools\.0\.name"):
        client.messages.create(model="tiny", max_tokens=1, tools=[nameless], messages=msgs)
    bad_schema = {**TOOLS[0], "input_schema": {"type": "string"}}
    with pytest.raises(anthropic.BadRequestError, match=r'tools\.0\.input_schema: its "type" must be "object"'):
        client.messages.create(model="tiny", max_tokens=1, tools=[bad_schema], messages=msgs)
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        client.messages.create(model="tiny", max_tokens=1, tools=TOOLS, messages=msgs, tool_choice={"type": "any"})
    with pytest.raises(anthropic.BadRequestError, match="tool_use blocks belong to assistant messages"):
        client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "read_file", "input": {}}]}])
    assert server.check_integrity()["ok"]


def test_openai_tools_on_chat(server, tiny_chat_model: Path) -> None:
    import openai
    from transformers import AutoTokenizer

    httpx.post(server.url + "/debug/advance_kv_clock", json={"seconds": 3601}, timeout=30).raise_for_status()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    tool_tokens = len(AutoTokenizer.from_pretrained(tiny_chat_model).encode("\n".join(json.dumps(t) for t in TOOLS)))
    ask = [{"role": "user", "content": "Which tool reads a file? Answer with its name only, nothing else."}]
    r1 = client.chat.completions.create(model="tiny", messages=ask, tools=tools, max_tokens=2, temperature=0,
                                        extra_body={"cache_control": EPH})
    assert r1.choices[0].message.tool_calls is None and r1.choices[0].finish_reason in ("stop", "length")
    assert r1.meta_info["cache_control"]["pinned_tokens"] >= tool_tokens // PS * PS, r1.meta_info
    flood(server, seed=51)
    history = [{"role": "user", "content": "Read the setup file, please."},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "read_file", "arguments": json.dumps({"path": "setup.py"})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "from setuptools import setup; setup()"}]
    r2 = client.chat.completions.create(model="tiny", messages=history, tools=tools, max_tokens=2, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens  # the tools' text block, pinned by r1
    assert tool_tokens // PS * PS <= cached < r2.usage.prompt_tokens - 32, (r2.usage, tool_tokens)
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model="tiny", max_tokens=1, messages=[*history[:2], {
            "role": "tool", "content": "no id"}])
    with pytest.raises(openai.BadRequestError, match=r"tools\.0\.function\.parameters"):
        client.chat.completions.create(model="tiny", max_tokens=1, messages=ask, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}])
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="tiny", max_tokens=1, messages=ask, tools=tools, tool_choice="required")


def test_an_hour_of_breakpoints_locks_no_one_out(server) -> None:
    """Issue 42, finding 6: 1 h breakpoints filled the default tenant's pin quota (half of L2: 64 pages
    here) and every later cache_control request got a 429 for an hour. Now the oldest breakpoints give
    way, and under a concurrent flood each answer says what became of its breakpoint."""
    httpx.post(server.url + "/debug/advance_kv_clock", json={"seconds": 3601}, timeout=30).raise_for_status()
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)

    def ask(i: int):
        text = f"Agent {i} reads its notes. " + f"The notes say many things about item {i}. " * 30
        msgs = [{"role": "user", "content": [{"type": "text", "text": text, "cache_control": HOUR}]}]
        return client.messages.create(model="tiny", max_tokens=1, messages=msgs, extra_body=GREEDY).usage

    serial = [ask(i) for i in range(8)]  # ~20 pages each: 8 of them are over the quota and the lease cap
    for u in serial:
        assert u.cache_creation_input_tokens > 0 and not u.cache_control["not_pinned"], u
        assert u.cache_creation.ephemeral_1h_input_tokens == u.cache_creation_input_tokens, u
        assert u.cache_creation.ephemeral_5m_input_tokens == 0, u
    assert sum(u.cache_control["released_breakpoints"] for u in serial) > 0
    assert 0 < metric(server, "hicache_tenant_pinned_pages") <= 64
    with ThreadPoolExecutor(8) as pool:
        flood = list(pool.map(ask, range(100, 116)))
    for u in flood:  # pinned, or it says why not: never a silent 0
        cc = u.cache_control
        assert u.cache_creation_input_tokens > 0 or cc["not_pinned"], u
        assert all(miss["reason"] and miss["tokens"] > 0 for miss in cc["not_pinned"]), u
        assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens > 0
    assert metric(server, "hicache_tenant_pinned_pages") <= 64
    assert server.check_integrity()["ok"]


def test_count_tokens_checks_breakpoints_as_messages_does(server) -> None:
    """Issue 42, finding 13: count_tokens took ttl "100h", which /v1/messages refuses."""
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    bad_ttl = {"type": "ephemeral", "ttl": "100h"}
    cases = [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": bad_ttl}]}]},
         'messages[0].content[0].cache_control.ttl: must be "5m" or "1h"'),
        ({"messages": [{"role": "user", "content": "hi"}], "system": [{"type": "text", "text": "s",
                                                                        "cache_control": {"type": "x"}}]},
         "system[0].cache_control: must be"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{**TOOLS[0], "cache_control": bad_ttl}]},
         "tools[0].cache_control.ttl"),
        ({"messages": [{"role": "user", "content": "hi"}], "cache_control": bad_ttl}, "request.cache_control.ttl"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": EPH}] * 5}]},
         "A maximum of 4 blocks with cache_control"),
    ]
    for body, why in cases:
        for call in (lambda b: client.messages.create(model="tiny", max_tokens=1, **b),
                     lambda b: client.messages.count_tokens(model="tiny", **b)):
            with pytest.raises(anthropic.BadRequestError, match=re.escape(why)):
                call(body)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi there", "cache_control": HOUR}]}]
    counted = client.messages.count_tokens(model="tiny", messages=msgs, cache_control=EPH).input_tokens
    assert counted == client.messages.count_tokens(model="tiny", messages=[
        {"role": "user", "content": "hi there"}]).input_tokens  # breakpoints change no count


def test_pin_ttl_is_capped(server) -> None:
    """/cache/pin took ttl_s up to 24 h; --max-pin-ttl-s (1 h by default, Anthropic's longest TTL) caps it."""
    ids = [(i * 41) % 30000 + 400 for i in range(40)]
    httpx.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}},
               timeout=60).raise_for_status()
    for ttl in (86400, 3601):
        r = httpx.post(server.url + "/cache/pin", json={"input_ids": ids, "ttl_s": ttl}, timeout=30)
        assert r.status_code == 400 and "max_pin_ttl_s" in r.text and "3600" in r.text, r.text
    r = httpx.post(server.url + "/cache/pin", json={"input_ids": ids, "ttl_s": 3600}, timeout=30)
    assert r.status_code == 200 and r.json()["pinned_tokens"] == 32, r.text
    assert httpx.delete(server.url + "/cache/pin/" + r.json()["lease_id"], timeout=30).status_code == 200


def test_a_flush_keeps_pins_and_breakpoints(server) -> None:
    """Issue 42, finding 4: a flush dropped every pin lease and breakpoint without saying so (a later
    DELETE of the lease said 404 "unknown or expired lease"). Their pages now stay, on L2; the rest goes."""
    httpx.post(server.url + "/debug/advance_kv_clock", json={"seconds": 3601}, timeout=30).raise_for_status()
    pinned, bp, bystander = ([(i * k) % 30000 + 500 for i in range(100)] for k in (43, 47, 53))
    for ids in (pinned, bystander):
        httpx.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}},
                   timeout=60).raise_for_status()
    r = httpx.post(server.url + "/cache/pin", json={"input_ids": pinned, "ttl_s": 3600}, timeout=30)
    assert r.status_code == 200 and r.json()["pinned_tokens"] == 96, r.text
    lease = r.json()["lease_id"]
    body = {"input_ids": bp, "sampling_params": {"temperature": 0, "max_new_tokens": 1}, "cache_control": HOUR}
    cc = httpx.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]["cache_control"]
    assert cc["pinned_tokens"] == 96 and cc["cache_creation_tokens"] == 96, cc
    r = httpx.post(server.url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["kept_leases"] == r.json()["kept_breakpoints"] + 1 >= 2, r.text  # the answer says what stayed
    assert r.json()["kept_pinned_pages"] == 12, r.text
    for ids, on_l2 in ((pinned, 96), (bp, 96)):
        r = httpx.post(server.url + "/cache/lookup", json={"input_ids": ids}, timeout=30)
        assert r.json()["cached_tokens"]["L1"] == 0 and r.json()["cached_tokens"]["L2"] == on_l2, r.text
    r = httpx.post(server.url + "/cache/lookup", json={"input_ids": bystander}, timeout=30)
    assert r.json()["cached_tokens"]["L1"] == r.json()["cached_tokens"]["L2"] == 0, r.text  # it went
    assert metric(server, "hicache_tenant_pinned_pages") == 12
    cc = httpx.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]["cache_control"]
    assert cc["cache_read_tokens"] == 96 and cc["refreshed_tokens"] == 96 and cc["cache_creation_tokens"] == 0, cc
    r = httpx.delete(server.url + "/cache/pin/" + lease, timeout=30)
    assert r.status_code == 200 and r.json()["pinned_tokens"] == 96, r.text
    assert server.check_integrity()["ok"]
