"""A hybrid model behind the HTTP server (issue 43): a tiny random Qwen3.5 (3 Gated DeltaNet layers to 1
gated attention layer) with SmolLM2's tokenizer and chat template, an L1 small enough that an earlier
conversation goes to L2. A multi-turn chat through the real OpenAI client reports cached tokens from its
state snapshots on L1 and, after other conversations pushed it out, on L2, with the answers of a server
that caches nothing; /get_server_info names the layer mix and the state pools, /metrics counts the
state slots per pool. Through the Anthropic client, a cache_control breakpoint on a shared system
prompt keeps the state there for the next conversation."""

from __future__ import annotations

import re

import httpx
import pytest
from openai import OpenAI

from harness.model_utils import tiny_model
from harness.server_utils import running_server

pytestmark = pytest.mark.slow
QWEN = {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
SYSTEM = "You are a terse assistant. Answer in one short sentence, no lists, no code."


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("qwen35-chat"), "qwen3_5", with_tokenizer=True,
                      max_position_embeddings=1024, **QWEN)


def chat(client: OpenAI, messages: list[dict]) -> tuple[str, int]:
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    details = r.usage.prompt_tokens_details
    return r.choices[0].message.content, (details.cached_tokens if details else 0) or 0


def conversation(client: OpenAI, opener: str, cold_url: str | None = None) -> list[tuple[str, int]]:
    """Three turns; each sends the whole history. Returns (answer, cached prompt tokens) per turn.
    ``cold_url``: flush that server's cache before each turn (the reference computes everything)."""
    history = [{"role": "system", "content": SYSTEM}]
    out = []
    for user in (opener, "And why is that so?", "Say it again, shorter."):
        history.append({"role": "user", "content": user})
        if cold_url is not None:
            assert httpx.post(cold_url + "/flush_cache", timeout=30).status_code == 200
        answer, cached = chat(client, history)
        history.append({"role": "assistant", "content": answer})
        out.append((answer, cached))
    return out


def test_multi_turn_chat_hits_state_snapshots_on_l1_and_l2(model) -> None:
    args = ["--model-path", str(model), "--served-model-name", "tiny", "--page-size", "4",
            "--max-total-tokens", "320", "--hicache-ratio", "4", "--hicache-write-policy", "write_through",
            "--write-through-threshold", "1", "--max-running-requests", "2"]
    openers = [f"Tell me one fact about the number {n}." for n in (7, 12, 31, 45, 58, 63, 77, 89)]
    with running_server(["--model-path", str(model), "--served-model-name", "tiny", "--page-size", "4"]) as cold:
        client = OpenAI(base_url=cold.url + "/v1", api_key="none", max_retries=0)
        ref = [conversation(client, o, cold.url) for o in openers]
    assert all(c == 0 for conv in ref for _, c in conv), ref
    with running_server(args) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        first = conversation(client, openers[0])
        assert [a for a, _ in first] == [a for a, _ in ref[0]]
        assert all(c > 0 for _, c in first[1:]), first  # later turns resume from the earlier turns' snapshots
        for opener, want in zip(openers[1:], ref[1:], strict=True):  # pushes the first conversation out of L1
            assert [a for a, _ in conversation(client, opener)] == [a for a, _ in want]
        before = httpx.get(s.url + "/get_server_info", timeout=30).json()["internal_states"][0]
        again = conversation(client, openers[0])  # its turns now come back from L2 (KV and snapshots)
        assert [a for a, _ in again] == [a for a, _ in ref[0]]
        after = httpx.get(s.url + "/get_server_info", timeout=30).json()
        hits = after["internal_states"][0]["cached_by_tier"]
        assert hits.get("host", 0) > before["cached_by_tier"].get("host", 0), (before, after)
        assert after["engine"]["layers"] == {"linear_attention": 3, "full_attention": 1}
        slots = after["internal_states"][0]["state_slots"]
        assert set(slots) == {"device", "host"} and slots["device"]["snapshots"] > 0, slots
        assert slots["device"]["bytes_per_slot"] > 0
        text = httpx.get(s.url + "/metrics", timeout=30).text
        snap = re.search(r'^hicache_state_slots\{pool="device",state="snapshots"\} ([0-9.e+]+)$', text, re.M)
        assert snap and float(snap.group(1)) > 0, text[-2000:]


def test_a_cache_control_breakpoint_keeps_the_state_of_a_shared_system_prompt(model) -> None:
    """Anthropic's cache_control on the system block: the state model keeps its state at the block's end
    (Req.capture_at), so a second conversation with the same system prompt and another question resumes
    there instead of recomputing the system prompt."""
    import anthropic

    system = [{"type": "text", "text": SYSTEM + " Tools: search(query), open(url), calc(expr). " * 3,
               "cache_control": {"type": "ephemeral"}}]
    args = ["--model-path", str(model), "--served-model-name", "tiny", "--page-size", "4",
            "--max-total-tokens", "2048", "--hicache-ratio", "2"]
    with running_server(args) as s:
        client = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)

        def ask(question: str) -> int:
            before = httpx.get(s.url + "/get_server_info", timeout=30).json()["internal_states"][0]["cached_tokens"]
            client.messages.create(model="tiny", system=system, max_tokens=4,
                                   messages=[{"role": "user", "content": question}], extra_body={"temperature": 0})
            after = httpx.get(s.url + "/get_server_info", timeout=30).json()["internal_states"][0]["cached_tokens"]
            return after - before

        assert ask("What is two plus two?") == 0
        system_tokens = client.messages.count_tokens(model="tiny", system=system, messages=[
            {"role": "user", "content": "x"}]).input_tokens
        hit = ask("Which city is the capital of Italy?")
        assert 0 < hit < system_tokens, (hit, system_tokens)  # the system block's state, not the question's
