"""The offline Engine's streaming and asyncio faces, as sgl.Engine has them: ``generate(...,
stream=True)`` yields incremental chunks whose texts and ids concatenate to the non-streamed answer
(stop strings included: nothing of a stop string leaks into a chunk), ``async_generate`` awaited and
streamed, and concurrent async requests sharing the scheduler's batches."""

from __future__ import annotations

import asyncio

import pytest

from serving.engine import Engine
from serving.structs.sampling_params import InvalidRequest

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
PROMPTS = ["The quick brown fox jumps over", "Once upon a time, in a land far away,",
           "def fibonacci(n):", "Paris is the capital of"]


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    eng = Engine(model_path=str(tiny_chat_model), max_total_tokens=2048, page_size=4)
    yield eng
    eng.shutdown()


def joined(chunks: list[dict]) -> tuple[str, list[int]]:
    return "".join(c["text"] for c in chunks), [t for c in chunks for t in c["output_ids"]]


def test_stream_concatenates_to_the_plain_answer(engine) -> None:
    for p in PROMPTS:
        plain = engine.generate(p, GREEDY)
        chunks = list(engine.generate(p, GREEDY, stream=True))
        assert len(chunks) > 1
        assert joined(chunks) == (plain["text"], plain["output_ids"])
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        last = chunks[-1]["meta_info"]
        assert last["finish_reason"] == plain["meta_info"]["finish_reason"]
        assert last["completion_tokens"] == len(plain["output_ids"]) == GREEDY["max_new_tokens"]
    engine.check_integrity()


def test_stream_with_a_stop_string_leaks_none_of_it(engine) -> None:
    text = engine.generate(PROMPTS[0], GREEDY)["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip()
    params = {**GREEDY, "stop": [stop]}
    plain = engine.generate(PROMPTS[0], params)
    assert plain["meta_info"]["finish_reason"]["type"] == "stop" and stop not in plain["text"]
    chunks = list(engine.generate(PROMPTS[0], params, stream=True))
    assert joined(chunks) == (plain["text"], plain["output_ids"])
    assert all(stop not in c["text"] for c in chunks)


def test_stream_takes_one_prompt(engine) -> None:
    with pytest.raises(InvalidRequest, match="one prompt"):
        engine.generate(PROMPTS, GREEDY, stream=True)


def test_async_generate_plain_streamed_and_concurrent(engine) -> None:
    plain = [engine.generate(p, GREEDY) for p in PROMPTS]
    engine.flush_cache()

    async def streamed(p: str) -> list[dict]:
        return [c async for c in await engine.async_generate(p, GREEDY, stream=True)]

    async def main() -> tuple[list, list]:
        one = await asyncio.gather(*(engine.async_generate(p, GREEDY) for p in PROMPTS))
        engine.flush_cache()
        before = engine.core.scheduler.stats.forward_passes
        two = await asyncio.gather(*(streamed(p) for p in PROMPTS))
        passes = engine.core.scheduler.stats.forward_passes - before
        # the four ran in shared batches: about one request's steps, far from four requests' in a row
        assert passes < 2 * GREEDY["max_new_tokens"], passes
        return one, two

    one, two = asyncio.run(main())
    assert [o["output_ids"] for o in one] == [o["output_ids"] for o in plain]
    assert [o["text"] for o in one] == [o["text"] for o in plain]
    for chunks, o in zip(two, plain, strict=True):
        assert joined(chunks) == (o["text"], o["output_ids"])
    engine.check_integrity()
