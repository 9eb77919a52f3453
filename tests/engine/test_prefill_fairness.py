"""A long prompt prefilled in chunks never blocks the requests that arrive meanwhile (issue 42, 8).

With the real engine on the tiny model and a small ``chunked_prefill_size``: a long prompt runs its
first chunk, a short request arrives, and the short request's prefill runs in the very next forward
pass, beside the long prompt's next chunk; its decode steps run interleaved with the long prompt's
remaining chunks (it finishes before the long prompt's prefill does). The long prompt keeps at least
half of every step's prefill budget, so a short request arriving at every step cannot starve it. A
second long prompt waits for the first one's prefill (one prompt in chunks at a time). The same with
overlap scheduling (its tokens one pass late). Every greedy output is token-identical to the same
request run alone. Counted in forward passes (each ``step()`` runs one; ``Req.kv.kv_len`` says what
each pass computed), never timed.
"""

from __future__ import annotations

import random

import pytest

from harness.model_utils import tiny_model
from serving.engine import Engine
from serving.scheduler.overlap import OverlapScheduler

PS = 4
CHUNK = 32  # chunked_prefill_size: prompt tokens per forward pass
G = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("fair"))


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 511) for _ in range(n)]


def engine(path, policy: str = "fcfs") -> Engine:
    # on the CPU everywhere: a CUDA engine overlaps its steps (a pass ahead), which the test with
    # overlap forced on covers; the pass counts below are those of the plain loop
    return Engine(model_path=str(path), page_size=PS, max_total_tokens=4096, chunked_prefill_size=CHUNK,
                  schedule_policy=policy, device="cpu")


def alone(path, prompt: list[int], new: int) -> list[int]:
    """The request's greedy output run alone, on an engine of its own."""
    return engine(path).generate(input_ids=prompt, sampling_params={**G, "max_new_tokens": new})["output_ids"]


def submit(core, prompt: list[int], new: int):
    r = core.make_request(input_ids=prompt, sampling_params={**G, "max_new_tokens": new})
    core.add(r)
    return r


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_a_short_request_runs_beside_a_long_prefill(tiny, policy):
    long_p, short_p = ids(500, 1), ids(5, 2)  # the long prompt: 16 chunks
    core = engine(tiny, policy).core
    long_r = submit(core, long_p, 8)
    core.step()
    assert long_r.kv.kv_len == CHUNK  # its first chunk ran
    short_r = submit(core, short_p, 12)
    steps, first_at, done_at = 0, None, None
    while not long_r.finished:
        before = long_r.kv.kv_len
        core.step()
        steps += 1
        core.check_integrity()
        if not long_r.finished and long_r.kv.kv_len < len(long_p):  # prefilling: at least half of each pass
            assert long_r.kv.kv_len - before >= CHUNK // 2
        if first_at is None and short_r.output_ids:
            first_at = steps
            assert short_r.kv.kv_len == len(short_p)  # its whole prompt in that one pass
        if done_at is None and short_r.finished:
            done_at, long_then = steps, long_r.kv.kv_len
    assert first_at == 1, f"the short request's first token came {first_at} passes after it arrived"
    assert long_then < len(long_p), "its decode steps ran beside the long prompt's remaining chunks"
    assert done_at == 12  # one pass per token: prefill, then 11 decodes, none skipped
    assert short_r.output_ids == alone(tiny, short_p, 12)
    assert long_r.output_ids == alone(tiny, long_p, 8)
    assert core.scheduler.in_use_pages() == 0


def test_beside_a_long_prefill_with_overlap_scheduling(tiny):
    """Overlap scheduling (forced on, as tests/engine/test_gpu_paths.py does on a CPU): the short
    request's prefill runs in the next pass; its token, read one pass late, comes out in the one after."""
    long_p, short_p = ids(500, 7), ids(6, 8)
    core = engine(tiny).core
    core.scheduler._overlap = OverlapScheduler(core.scheduler)
    long_r = submit(core, long_p, 6)
    core.step()
    short_r = submit(core, short_p, 10)
    core.step()
    assert short_r.kv.kv_len == len(short_p) and long_r.kv.kv_len < len(long_p)
    core.step()
    assert short_r.output_ids
    while core.scheduler.has_work:
        core.step()
        core.check_integrity()
    assert core.scheduler._overlap.overlapped_steps > 0
    assert [short_r.output_ids, long_r.output_ids] == [alone(tiny, short_p, 10), alone(tiny, long_p, 6)]


def test_short_requests_every_step_cannot_starve_the_long_one(tiny):
    long_p = ids(300, 3)
    core = engine(tiny).core
    long_r = submit(core, long_p, 4)
    core.step()
    shorts: list[tuple[object, list[int], int]] = []  # (request, prompt, the pass it arrived before)
    steps = 0
    while long_r.kv.kv_len < len(long_p):
        p = ids(3 + steps % 5, 100 + steps)
        shorts.append((submit(core, p, 3), p, steps + 1))
        before = long_r.kv.kv_len
        core.step()
        steps += 1
        core.check_integrity()
        assert long_r.kv.kv_len - before >= CHUNK // 2 or long_r.kv.kv_len == len(long_p)
        for r, _, arrived in shorts:
            if steps - arrived >= 1:
                assert r.output_ids, f"a short request still waits {steps - arrived + 1} passes after it arrived"
    assert steps <= 2 * -(-(len(long_p) - CHUNK) // CHUNK)  # at most twice the passes it needs alone
    while core.scheduler.has_work:
        core.step()
    assert long_r.output_ids == alone(tiny, long_p, 4)
    for r, p, _ in shorts[::4]:
        assert r.output_ids == alone(tiny, p, 3)
    core.check_integrity()
    assert core.scheduler.in_use_pages() == 0


def test_a_second_long_prompt_waits_its_turn(tiny):
    a_p, b_p, s_p = ids(200, 4), ids(200, 5), ids(4, 6)
    core = engine(tiny).core
    a = submit(core, a_p, 3)
    core.step()
    b = submit(core, b_p, 3)  # before the short one: FCFS would admit it first
    s = submit(core, s_p, 3)
    core.step()
    assert s.output_ids, "the short request waits behind the long one queued before it"
    while a.kv.kv_len < len(a_p):
        assert b.kv.kv_len == 0 and b in core.scheduler.waiting  # one prompt in chunks at a time
        core.step()
    while core.scheduler.has_work:
        core.step()
    assert [a.output_ids, b.output_ids, s.output_ids] == [alone(tiny, a_p, 3), alone(tiny, b_p, 3),
                                                          alone(tiny, s_p, 3)]
    core.check_integrity()
