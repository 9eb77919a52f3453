"""Tensor parallelism in the engine (CPU, gloo, fp32): TP=2 greedy outputs are token-identical
to TP=1 with L1 and L2 hits, after preemption, and after a restart from L3."""

from __future__ import annotations

import pytest

from harness.engine_cases import GREEDY, ids_of, prompts, tier_prompts
from harness.model_utils import tiny_model
from hicache.keys import page_keys, tp_shard_key
from hicache.tiers.lmdb.store import LMDBStore
from serving.engine import Engine

PS = 4


@pytest.fixture(scope="module", params=["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def tiny(request, tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp(f"tp-{request.param}"), arch=request.param, num_key_value_heads=2)
    ps, others = tier_prompts()
    return path, ps, others


def run_rounds(path, ps, others, **kw) -> tuple[list, list, Engine]:
    """Three rounds: ``ps``, ``others`` (pushes ps out of L1), ``ps`` again (L2 hits)."""
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=160, hicache_ratio=4.0,
                 write_through_threshold=1, max_running_requests=2, **kw)
    first = eng.generate(input_ids=ps, sampling_params=GREEDY)
    eng.check_integrity()
    eng.generate(input_ids=others, sampling_params=GREEDY)
    again = eng.generate(input_ids=ps, sampling_params=GREEDY)
    eng.check_integrity()
    return first, again, eng


def test_tp2_l2_hits_token_identical(tiny):
    path, ps, others = tiny
    ref_first, ref_again, eng1 = run_rounds(path, ps, others)
    eng1.shutdown()
    first, again, eng = run_rounds(path, ps, others, tp_size=2)
    procs = eng.core.tp.procs
    try:
        assert ids_of(first) == ids_of(ref_first)
        assert ids_of(again) == ids_of(ref_again) == ids_of(ref_first)
        host_hits = sum(o["meta_info"]["cached_tokens_details"]["host"] for o in again)
        assert host_hits > 0, [o["meta_info"] for o in again]
        assert eng.core.controller.pages_loaded > 0
    finally:
        eng.shutdown()
    assert all(not p.is_alive() for p in procs)


def test_tp2_preemption_token_identical(tiny):
    path, ps, others = tiny
    batch = ps + others
    ref = Engine(model_path=str(path), page_size=PS, max_total_tokens=4096)
    want = ids_of(ref.generate(input_ids=batch, sampling_params=GREEDY))
    ref.shutdown()
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=160, tp_size=2)
    try:
        assert ids_of(eng.generate(input_ids=batch, sampling_params=GREEDY)) == want
        assert eng.core.scheduler.stats.retractions > 0
        eng.check_integrity()
    finally:
        eng.shutdown()


def l3_engine(path, db, **kw) -> Engine:
    return Engine(model_path=str(path), page_size=PS, max_total_tokens=256, hicache_ratio=2.0,
                  hicache_storage_backend="lmdb",
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1},
                  hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=8,
                  hicache_storage_load_policy="always_load", **kw)


def test_tp2_restart_from_l3_token_identical(tiny, tmp_path):
    path, ps, _ = tiny
    ref = Engine(model_path=str(path), page_size=PS, max_total_tokens=4096)
    want = ids_of(ref.generate(input_ids=ps, sampling_params=GREEDY))
    ref.shutdown()
    db = tmp_path / "l3"
    eng = l3_engine(path, db, tp_size=2)
    try:
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == want
        namespace = eng.core.storage.writeback.namespace
    finally:
        eng.shutdown()  # persists every page (every rank's part) to L3
    # rank 1's parts of the first prompt's pages go bad (corrupt: they exist, but fail the check on
    # read) and of the second prompt's go missing; rank 0's parts are intact. Those pages are not
    # in L3 any more: both prompts are recomputed, never served half-loaded
    store = LMDBStore.from_config({"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1})
    bad, gone = ([tp_shard_key(k, 1, 1) for k in page_keys(p, PS, namespace)] for p in ps[:2])
    assert all(store.exists(k) for k in page_keys(ps[0], PS, namespace) + bad + gone)
    for k in bad:
        value = bytearray(store.get(k))
        value[0] ^= 0xFF
        assert store.set(k, bytes(value))
    assert sum(store.delete(k) for k in gone) == len(gone)
    store.close()
    eng = l3_engine(path, db, tp_size=2, max_running_requests=1)  # a restart: L1 and L2 empty
    try:
        outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(outs) == want
        hits = [o["meta_info"]["cached_tokens_details"]["storage"] for o in outs]
        assert hits[:2] == [0, 0] and all(h > 0 for h in hits[2:]), hits
        eng.check_integrity()
    finally:
        eng.shutdown()
    # a TP=1 engine on the same store finds none of it: its keys are other keys (rank 0's part
    # of a TP=2 page holds one of the two kv heads)
    eng = l3_engine(path, db, max_running_requests=1)
    try:
        outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(outs) == want
        assert sum(o["meta_info"]["cached_tokens_details"]["storage"] for o in outs) == 0
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_smollm2_tp3_l2_hits_token_identical():
    """SmolLM2-135M (9 heads, 3 kv heads: TP=3, one kv head per rank), L2 hits and preemption."""
    from harness.model_utils import smollm2_path

    path = smollm2_path()
    ps = prompts(3, 49152, seed=11, lo=20, hi=30)
    others = prompts(4, 49152, seed=12, lo=20, hi=30)
    greedy = {**GREEDY, "max_new_tokens": 6}
    ref = Engine(model_path=str(path), page_size=PS, max_total_tokens=4096)
    want = ids_of(ref.generate(input_ids=ps, sampling_params=greedy))
    ref.shutdown()
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=96, hicache_ratio=4.0,
                 write_through_threshold=1, max_running_requests=2, tp_size=3)
    try:
        assert ids_of(eng.generate(input_ids=ps, sampling_params=greedy)) == want
        eng.generate(input_ids=others, sampling_params=greedy)
        again = eng.generate(input_ids=ps, sampling_params=greedy)
        assert ids_of(again) == want
        assert sum(o["meta_info"]["cached_tokens_details"]["host"] for o in again) > 0
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_integrity_check_covers_the_other_ranks(tiny):
    """check_integrity fails when a follower has not run every command (here: one rank 0 claims to
    have sent, so the follower's count is one short), and passes again once they agree."""
    path, ps, _ = tiny
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=160, hicache_ratio=2.0, tp_size=2)
    eng.core.tp.check_wait_s = 2.0  # the follower waits 2 s for the command that never comes, not dist_timeout
    try:
        eng.generate(input_ids=ps[:2], sampling_params=GREEDY)
        eng.check_integrity()
        eng.core.tp.seq += 1
        with pytest.raises(AssertionError, match="tensor-parallel rank 1: ran"):
            eng.check_integrity()
        eng.core.tp.seq -= 1
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_tp2_overlap_schedule_token_identical(tiny):
    """Overlap scheduling (on by default on CUDA; switched on here on CPU): a batch's ids hold
    placeholders for tokens still being sampled; rank 0 fills them in and broadcasts them."""
    from serving.scheduler.overlap import OverlapScheduler

    path, ps, others = tiny
    batch = ps + others
    ref = Engine(model_path=str(path), page_size=PS, max_total_tokens=4096)
    want = ids_of(ref.generate(input_ids=batch, sampling_params=GREEDY))
    ref.shutdown()
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=4096, tp_size=2)
    try:
        sched = eng.core.scheduler
        sched._overlap = OverlapScheduler(sched)
        assert ids_of(eng.generate(input_ids=batch, sampling_params=GREEDY)) == want
        assert sched._overlap.overlapped_steps > 0
        eng.check_integrity()
    finally:
        eng.shutdown()


DEAD_RANK = """
import sys
from serving.engine import Engine
from serving.tp.leader import RankDied
eng = Engine(model_path=sys.argv[1], page_size=4, max_total_tokens=160, tp_size=2)
eng.generate(input_ids=[[1, 2, 3, 4, 5]], sampling_params={"max_new_tokens": 2})
eng.core.tp.procs[0].kill()
eng.core.tp.procs[0].join(30)
try:
    for _ in range(50):  # the monitor notices within moments; a collective with a dead peer fails
        eng.generate(input_ids=[[1, 2, 3, 4, 5]], sampling_params={"max_new_tokens": 2})
except Exception as e:
    print("raised", type(e).__name__, e, flush=True)
eng.shutdown()
print("still running", flush=True)
"""


def test_a_dead_rank_raises_in_the_offline_engine_not_exits_the_callers_process(tiny):
    """The offline Engine runs in its caller's process (a notebook, a test run): a dead rank makes its
    calls raise; ``os._exit`` is the server's engine process's answer only (test_tp_server.py)."""
    import subprocess
    import sys

    path = tiny[0]
    out = subprocess.run([sys.executable, "-c", DEAD_RANK, str(path)], capture_output=True, text=True, timeout=300)
    assert "still running" in out.stdout, (out.returncode, out.stdout, out.stderr[-3000:])
    assert "raised" in out.stdout, out.stdout


FAILED_RANK = """
import sys
from serving.engine import Engine
from serving.tp import messages as msg
path, ps = sys.argv[1], [[1, 2, 3, 4, 5]]
eng = Engine(model_path=path, page_size=4, max_total_tokens=160, tp_size=2)
eng.generate(input_ids=ps, sampling_params={"max_new_tokens": 2})
eng.core.tp._cmds[0].send(msg.WindowMap([1], [2]))  # a command rank 1 of a model without windows cannot run
try:
    for _ in range(50):
        eng.generate(input_ids=ps, sampling_params={"max_new_tokens": 2})
except Exception as e:
    print("raised", type(e).__name__, repr(str(e)), flush=True)
# the dead engine is not shut down: the next one starts anyway (the dead one's group is destroyed) ...
eng2 = Engine(model_path=path, page_size=4, max_total_tokens=160, tp_size=2)
print("second", eng2.generate(input_ids=ps, sampling_params={"max_new_tokens": 2})[0]["output_ids"], flush=True)
try:  # ... but not beside a live one
    Engine(model_path=path, page_size=4, max_total_tokens=160, tp_size=2)
except Exception as e:
    print("third refused", type(e).__name__, repr(str(e)), flush=True)
print("second again", eng2.generate(input_ids=ps, sampling_params={"max_new_tokens": 2})[0]["output_ids"], flush=True)
# eng2 is not shut down either: the process still exits (its rank stopped at exit)
"""


def test_a_failed_rank_is_named_with_its_traceback_and_the_next_engine_starts(tiny):
    """A rank that fails (here: a command it cannot run) makes the offline engine raise RankDied naming
    the rank, its exit code and its traceback (CI once saw only rank 0's "Connection reset by peer",
    and every later TP test in that process then failed with "trying to initialize the default process
    group twice"): an engine left dead and not shut down does not block the next one in the process;
    a live one does, with a message saying so."""
    import subprocess
    import sys

    path = tiny[0]
    out = subprocess.run([sys.executable, "-c", FAILED_RANK, str(path)], capture_output=True, text=True, timeout=300)
    lines = {ln.split(" ", 1)[0]: ln for ln in out.stdout.splitlines()}
    shown = (out.returncode, out.stdout, out.stderr[-3000:])
    assert out.returncode == 0, shown
    raised = lines.get("raised", "")
    assert raised.startswith("raised RankDied") and "tensor-parallel rank 1" in raised, shown
    assert "exited with code 1" in raised and "AttributeError" in raised, shown
    assert "\nsecond [" in out.stdout and "\nsecond again [" in out.stdout, shown
    assert "already running in this process" in lines.get("third", ""), shown


CRASHED_RANK = """
import ctypes, sys
from serving.engine import Engine
ps = [[1, 2, 3, 4, 5]]
eng = Engine(model_path=sys.argv[1], page_size=4, max_total_tokens=160, tp_size=2)
eng.generate(input_ids=ps, sampling_params={"max_new_tokens": 2})

class Crash:  # unpickled by rank 1's command loop: a read of address 8 (SIGSEGV), in native code
    def __reduce__(self):
        return (ctypes.string_at, (8, 1))

eng.core.tp._cmds[0].send(Crash())
try:
    for _ in range(50):
        eng.generate(input_ids=ps, sampling_params={"max_new_tokens": 2})
except Exception as e:
    print("raised", type(e).__name__, repr(str(e)), flush=True)
"""


def test_a_rank_crashed_in_native_code_is_named_with_its_stack(tiny):
    """A rank killed by a signal in native code runs no ``except`` block: its faulthandler report (the
    stack of every thread) is what RankDied names (CI once saw only "exited with code -11")."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CRASHED_RANK, str(tiny[0])], capture_output=True, text=True,
                         timeout=300)
    raised = next((ln for ln in out.stdout.splitlines() if ln.startswith("raised")), "")
    shown = (out.returncode, out.stdout, out.stderr[-3000:])
    assert raised.startswith("raised RankDied") and "exited with code -11" in raised, shown
    assert "Segmentation fault" in raised and "follower.py" in raised, shown
