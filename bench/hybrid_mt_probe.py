"""Where a hybrid model's multi-turn run loses its hits: bench/hybrid.py's multi-turn section (L1+L2+L3,
concurrent turns) with each request's prompt length and cached tokens per tier, and the host window pool's
counters after each turn (backups that found no host window page: ``not_kept``).

    python3 bench/hybrid_mt_probe.py [--model gemma3] [--small --device cpu] [--slow-write S] [--json PATH]

``--slow-write S``: every LMDB batch write sleeps S seconds first (a disk slower than the prefill, as on
the GPU, on a CPU where the prefill is the slow side). The defaults are the H200 run's (16 conversations of
4k tokens, 3 turns, L1 16k tokens, L2 4 GB, the window pool at 0.2); ``--small`` uses the small shape.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from argparse import Namespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402
from bench.gpu_tiers_sections import _multiturn_run  # noqa: E402
from bench.hybrid import MODELS, swa_kw  # noqa: E402
from bench.hybrid_shapes import write_model_dir  # noqa: E402
from hicache.tiers.storage import default_read_threads  # noqa: E402


def slow_writes(seconds: float) -> None:
    """Every LMDB batch write sleeps ``seconds`` first."""
    from hicache.tiers.lmdb.store import LMDBStore

    for name in ("batch_set", "batch_set_parts"):
        real = getattr(LMDBStore, name)

        def slow(self, *a, _real=real, **kw):
            time.sleep(seconds)
            return _real(self, *a, **kw)

        setattr(LMDBStore, name, slow)


def watch_losses(eng) -> list[dict]:
    """Record, at each backup that finds no host window page, who holds the host window pool: pages of nodes
    ``locked`` (running or fetched requests), ``loading``, ``pinned`` (L3 writes waiting or in flight), and
    the ``rest`` (the path a match is being admitted on, which reclaim spares)."""
    hw, tree = eng.core.host_pool.windows, eng.core.tree
    seen: list[dict] = []
    if hw is None:
        return seen
    take = hw.take

    def watched(pages):
        before = hw.not_kept
        got = take(pages)
        if hw.not_kept > before:
            held = {"lost": hw.not_kept - before, "locked": 0, "loading": 0, "pinned": 0, "rest": 0}
            for nd in tree.nodes():
                k = 0 if nd.host_pages is None else sum(1 for p in nd.host_pages if hw.map[p] >= 0)
                if k:
                    kind = "locked" if nd.lock_ref else "loading" if nd.loading else \
                        "pinned" if tree.pins.any_pinned(nd.host_pages) else "rest"
                    held[kind] += k
            seen.append(held)
        return got

    hw.take = watched
    return seen


class TurnRows:
    """The per-turn rows (an observer of ``_multiturn_run``): wall, forward passes, conversations recomputed
    whole, tokens missed and cached per tier, the host window pool's counters and losses."""

    def __init__(self) -> None:
        self.turns: list[dict] = []
        self.storage: dict = {}
        self._losses: list[dict] = []

    def start(self, eng) -> None:  # noqa: ANN001 (an Engine)
        self._losses = watch_losses(eng)

    def turn(self, t: int, dt: float, outs: list[dict], forwards: int, eng) -> None:  # noqa: ANN001
        hw = eng.core.host_pool.windows
        rows = [(o["meta_info"]["prompt_tokens"], o["meta_info"]["cached_tokens_details"]) for o in outs]
        self.turns.append({"wall_s": round(dt, 3), "forwards": forwards,
                           "recomputed_whole": sum(1 for _, d in rows if not sum(d.values())),
                           "missed": [n - sum(d.values()) for n, d in rows], "cached": [d for _, d in rows],
                           "host_window_not_kept": hw.not_kept if hw is not None else None,
                           "host_window_reclaimed": hw.reclaimed if hw is not None else None,
                           "losses": list(self._losses)})
        self._losses.clear()
        eng.core.tree.check_integrity()

    def end(self, eng) -> None:  # noqa: ANN001
        self.storage = {k: v for k, v in eng.core.storage_stats().items() if isinstance(v, (int, float))}


def run(a) -> dict:
    cfg = MODELS[a.model](a.small)
    args = Namespace(device=a.device, dtype="bfloat16" if a.device == "cuda" else "float32", eager=False,
                     l3_gb=1.0 if a.small else 40.0, read_threads=default_read_threads(), engine_init_s=[],
                     swa_full_tokens_ratio=a.swa, vocab=cfg["vocab_size"], conversations=a.conversations,
                     turns=a.turns, context=a.context, mt_user=a.mt_user, mt_answer=a.mt_answer,
                     mt_l1_tokens=a.mt_l1_tokens, warm_tokens=128 if a.small else 1024)
    work = tempfile.mkdtemp(prefix="mt-probe-")
    rows = TurnRows()
    try:
        model_dir = write_model_dir(os.path.join(work, "model"), cfg)
        _multiturn_run(args, model_dir, os.path.join(work, "l3"),
                       {"hicache_size": a.mt_l2_gb, **swa_kw(args), **json.loads(a.extra)}, True, rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"model": a.model, "small": a.small, "device": a.device, "slow_write_s": a.slow_write,
            "turns": rows.turns, "storage": rows.storage}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3", choices=sorted(MODELS))
    p.add_argument("--small", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--context", type=int, default=None, help="first turn's tokens (4096; --small 512)")
    p.add_argument("--mt-user", type=int, default=None, help="user tokens a turn adds (256; --small 32)")
    p.add_argument("--mt-answer", type=int, default=None, help="answer tokens a turn adds (32; --small 4)")
    p.add_argument("--mt-l1-tokens", type=int, default=None, help="L1 tokens (16384; --small 2048)")
    p.add_argument("--mt-l2-gb", type=float, default=None, help="L2 GiB (4; --small 0.008: the same share)")
    p.add_argument("--swa", type=float, default=0.2, help="--swa-full-tokens-ratio")
    p.add_argument("--slow-write", type=float, default=0.0)
    p.add_argument("--extra", default="{}", help="more engine arguments, a JSON object")
    a = p.parse_args()
    small = dict(context=512, mt_user=32, mt_answer=4, mt_l1_tokens=2048, mt_l2_gb=0.008)
    big = dict(context=4096, mt_user=256, mt_answer=32, mt_l1_tokens=16384, mt_l2_gb=4.0)
    for k, v in (small if a.small else big).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.small and a.extra == "{}":
        a.extra = json.dumps({"chunked_prefill_size": 1024})  # two prompts a chunk, as 8192 holds two 4k ones
    if a.slow_write:
        slow_writes(a.slow_write)
    res = run(a)
    held = ("locked", "loading", "pinned", "rest")
    print_table(["turn", "wall s", "forwards", "recomputed whole", "backups without a window (total)",
                 "host window pages held at those losses: " + " / ".join(held)],
                [[i, t["wall_s"], t["forwards"], t["recomputed_whole"], t["host_window_not_kept"],
                  " / ".join(str(sum(x[k] for x in t["losses"])) for k in held)]
                 for i, t in enumerate(res["turns"])])
    write_json(a.json, res)


if __name__ == "__main__":
    main()
