"""The frontend language in process (EngineBackend over the offline Engine), on the tiny chat
model: the tutorial programs' cached tokens and constraints, forks batched by the driver
thread, the engine's integrity after every program; a bad regex names the call."""

from __future__ import annotations

import pytest

import serving.lang as sgl
from harness import lang_checks as checks


@pytest.fixture(scope="module")
def backend(lang_model):
    be = sgl.EngineBackend(model_path=str(lang_model), dtype="float32", page_size=4, max_total_tokens=8192,
                           hicache_ratio=0.0)
    yield be
    be.shutdown()


@pytest.fixture(autouse=True)
def integrity(backend):
    yield
    backend.check_integrity()


class TestTutorial(checks.TutorialPrograms):
    """The tutorial programs in process (harness/lang_checks.py), the engine checked after each."""


def test_bad_regex_names_the_call(backend) -> None:
    @sgl.function
    def bad(s):
        s += "Q: a number?\nA: " + sgl.gen("num", regex="([0-9", max_tokens=4)

    with pytest.raises(sgl.LangError, match=r"gen\('num'\) in program 'bad'") as e:
        bad.run(backend=backend)
    assert e.value.status == 400


def test_select_needs_choices(backend) -> None:
    with pytest.raises(ValueError, match="non-empty list of choices"):
        sgl.select("x", [])
    with pytest.raises(ValueError, match="unknown choices_method"):
        sgl.select("x", ["a"], choices_method="nope")


def test_run_batch_computes_the_shared_prefix_once(backend) -> None:
    """All 16 programs' first calls reach the engine while it is busy (a job holds the driver):
    still only the first of the group computes the few-shot header (serving.lang.batch)."""
    import threading
    import time

    from harness import lang_programs as p

    backend.flush_cache()
    release = threading.Event()
    busy = threading.Thread(target=backend._submit, args=(lambda core: release.wait(30),))
    busy.start()
    out: list = []
    runner = threading.Thread(target=lambda: out.append(p.text_qa.run_batch(
        [{"question": c} for c in p.COUNTRIES], backend=backend, temperature=0)))
    runner.start()
    time.sleep(1.0)  # every program has sent its first call or waits at the gate
    release.set()
    runner.join(120)
    busy.join()
    metas = [s.get_meta_info("answer") for s in out[0]]
    header = metas[0]["prompt_tokens"] - 10
    assert all(m["cached_tokens"] >= checks.full_pages(header) for m in metas), [m["cached_tokens"] for m in metas]
