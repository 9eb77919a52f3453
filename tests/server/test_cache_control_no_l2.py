"""Prompt-caching accounting on a server without L2 (breakpoints cannot be pinned there): a
``cache_control`` breakpoint's prefix that turn 1 wrote into the cache is reported as created on
turn 1 (``cache_creation_input_tokens``), so what turn 2 reads, turn 1 created -- not 0 created and
then hundreds read. The real ``anthropic`` SDK against a real server."""

from __future__ import annotations

import anthropic
import pytest

from harness.server_utils import running_server

PS = 16
SYSTEM = "You are a careful coding agent. You read files, run tools and answer briefly. " * 12
EPH = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with running_server(["--model-path", str(tiny_chat_model), "--served-model-name", "tiny", "--page-size",
                         str(PS), "--max-total-tokens", "2048"]) as s:
        yield s


def ask(client, messages: list[dict]):
    system = [{"type": "text", "text": SYSTEM, "cache_control": EPH}]
    r = client.messages.create(model="tiny", system=system, messages=messages, max_tokens=4,
                               extra_body={"temperature": 0})
    total = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=messages).input_tokens
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == total, u
    return r


def test_turn_two_reads_what_turn_one_created(server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    first = [{"role": "user", "content": "List the files in the repository."}]
    r1 = ask(client, first)
    u1 = r1.usage
    assert u1.cache_read_input_tokens == 0, u1
    assert u1.cache_creation_input_tokens > 0 and u1.cache_creation_input_tokens % PS == 0, u1  # 0 before
    assert u1.cache_control["not_pinned"], u1  # no L2: nothing is pinned, and the usage says why
    assert "no L2" in u1.cache_control["not_pinned"][0]["reason"]
    second = [*first, {"role": "assistant", "content": r1.content[0].text},
              {"role": "user", "content": "Which one holds the tests?"}]
    u2 = ask(client, second).usage
    assert u2.cache_read_input_tokens >= u1.cache_creation_input_tokens, (u1, u2)  # it reads what turn 1 made
    assert u2.cache_creation_input_tokens == 0, u2  # the breakpoint's prefix was read, not written again
