"""Issue 25, finding 2: a prompt far over the context but under the body limit is refused after
tokenizing about the context's worth of it, on every route, so 8 of them at once leave the
HTTP process's memory where it was (before: one 7.8 MB prompt took its RSS up by 1.1 GB, 8 at
once to 9.2 GB, 4.7 GB of which stayed). The bounded tokenizer's ids are exactly the whole
text's whenever the text fits."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server_utils import ServerProcess, proc_status, running_server
from serving.tokenizer import PIECE_CHARS, Tokenizer, TooManyTokens

CONTEXT = 512
HUGE = "word " * 1_560_000  # 7.8 MB, 1.56 M tokens
# the 8 huge requests: every route that tokenizes text (chat templates too), one each, two chats
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": HUGE}], "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": HUGE}], "stream": True,
                              "max_tokens": 2}),
    ("/v1/completions", {"model": "m", "prompt": HUGE, "max_tokens": 2}),
    ("/generate", {"text": HUGE, "sampling_params": {"max_new_tokens": 2}}),
    ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": HUGE}], "max_tokens": 2}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": HUGE}]}),
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": HUGE}], "stream": False,
                   "options": {"num_predict": 2}}),
    ("/api/generate", {"model": "m", "prompt": HUGE, "raw": True, "stream": False, "options": {"num_predict": 2}}),
]
MB = 2**20


def error_message(r: httpx.Response) -> str:
    body = r.json()
    err = body["error"]
    return err if isinstance(err, str) else err["message"]  # Ollama's shape, else OpenAI's / Anthropic's


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model: Path) -> Tokenizer:
    return Tokenizer(str(tiny_chat_model))


@pytest.mark.parametrize("text", [
    "Hello there, how are you? " * 1500,  # 39 K chars, spaces to cut at
    "#" * (PIECE_CHARS * 2 + 17),  # no space: pieces cut mid-run
    ("ünïcödé ✓ 文字 " * 3000)[: PIECE_CHARS + 5],
    "\n\n  x  " * 8000,
])
def test_bounded_encode_gives_the_whole_texts_ids(tokenizer: Tokenizer, text: str) -> None:
    whole = tokenizer.encode(text)
    assert len(text) > PIECE_CHARS
    assert tokenizer.encode(text, max_tokens=len(whole)) == whole  # fits exactly: the same ids
    with pytest.raises(TooManyTokens):
        tokenizer.encode(text, max_tokens=len(whole) // 3)  # far over: refused while counting


def test_bounded_encode_stops_early(tokenizer: Tokenizer) -> None:
    """A text of 1.56 M tokens against a limit of 511 is refused after its first piece."""
    calls: list[int] = []
    ids = tokenizer._ids
    tokenizer._ids = lambda text: calls.append(len(text)) or ids(text)  # type: ignore[method-assign]
    try:
        with pytest.raises(TooManyTokens):
            tokenizer.encode(HUGE, max_tokens=CONTEXT - 1)
    finally:
        del tokenizer._ids
    assert len(calls) == 1 and calls[0] <= PIECE_CHARS


@pytest.mark.slow
def test_eight_huge_prompts_at_once_keep_the_http_process_small(tiny_chat_model: Path) -> None:
    args = ["--model-path", str(tiny_chat_model), "--served-model-name", "m", "--context-length", str(CONTEXT),
            "--max-total-tokens", "2048"]
    with running_server(args) as server:
        _eight_huge_prompts(server)


def _eight_huge_prompts(server: ServerProcess) -> None:
    assert server.proc is not None
    pid = server.proc.pid  # the HTTP process (the engine is its child)
    raws = [json.dumps(body).encode() for _, body in ROUTES]
    with httpx.Client(timeout=300) as client:
        for path, body in ROUTES:  # each route once with a small prompt: lazy set-up is done
            body = json.loads(json.dumps(body).replace(HUGE, "hi"))
            assert client.post(server.url + path, json=body).status_code == 200
        before = proc_status(pid)["VmRSS"]
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS: the peak from here on

        def post(i: int) -> httpx.Response:
            return client.post(server.url + ROUTES[i][0], content=raws[i], headers={"content-type": "application/json"})

        with concurrent.futures.ThreadPoolExecutor(len(ROUTES)) as pool:
            answers = list(pool.map(post, range(len(ROUTES))))
        after = proc_status(pid)
        seen = f"VmRSS before {before // MB} MB, then VmHWM {after['VmHWM'] // MB} MB, VmRSS {after['VmRSS'] // MB} MB"
        # before the fix: +1.1 GB for one such prompt alone, ~9 GB for the 8; the bodies themselves are 60 MB
        assert after["VmHWM"] - before < 400 * MB, seen
        assert after["VmRSS"] - before < 300 * MB, seen  # before the fix: +4.2 GB stayed
        for (path, _), r in zip(ROUTES, answers, strict=True):
            assert r.status_code == 400, (path, r.text[:300])
            assert f"context length is {CONTEXT}" in error_message(r), (path, r.text[:300])
        assert client.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}
                           ).status_code == 200
