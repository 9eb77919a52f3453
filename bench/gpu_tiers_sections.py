"""Helpers and sections 1 (ceilings) and 3 (multi-turn) of bench/gpu_tiers.py; see that file."""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time

import lmdb
import numpy as np
import torch

from bench.common import raw_write
from bench.gpu_model import rand_prompts
from bench.gpu_sections import sync
from hicache.tiers.lmdb.config import DEFAULT_SHARDS

CHUNK = 2 << 20  # one 8B-shape page (16 tokens x 128 KiB)
ONE = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 1}


def drop_page_cache(path: str) -> None:
    """Drop a file's pages from the page cache (they are read from disk next time); a directory:
    every file under it (a sharded LMDB store: its shards' maps and value files)."""
    if os.path.isdir(path):
        for root, _, names in os.walk(path):
            for name in names:
                drop_page_cache(os.path.join(root, name))
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def pinned(nbytes: int) -> np.ndarray:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available()).numpy()


def in_threads(n: int, fn, total: int) -> float:
    """Run ``fn(i, n)`` on ``n`` threads; GB/s for ``total`` bytes."""
    ts = [threading.Thread(target=fn, args=(i, n)) for i in range(n)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return total / (time.perf_counter() - t0) / 1e9


# -- engines ----------------------------------------------------------------------------------
def make_engine(args, model_dir, l3_dir: str | dict | None, *, wait_pinned: bool = True, **kw):
    """An offline Engine with the engine's default graph and overlap settings (what a user
    serves with; ``--eager`` turns both off for a comparison). ``l3_dir``: a path (LMDB there),
    a dict (Mooncake Store with these options) or None (no L3). ``wait_pinned``: return once L2
    is fully pinned (False: at once, as a server starts serving)."""
    from serving.engine import Engine

    base = dict(model_path=model_dir, load_format="dummy", dtype=args.dtype, device=args.device, page_size=16,
                hicache_mem_layout="page_first", chunked_prefill_size=8192, max_running_requests=16)
    if args.eager:
        base.update(disable_cuda_graph=True, disable_overlap_schedule=True)
    if getattr(args, "quantization", None):  # bench/models.py: every engine of a section quantized alike
        base.update(quantization=args.quantization)
    if l3_dir is not None:
        backend, extra = ("mooncake", dict(l3_dir)) if isinstance(l3_dir, dict) else \
            ("lmdb", {"path": l3_dir, "capacity_gb": args.l3_gb, "sync": False})
        base.update(hicache_storage_backend=backend, hicache_storage_prefetch_policy="wait_complete",
                    hicache_storage_prefetch_timeout_base=60.0, hicache_storage_prefetch_threshold=256,
                    hicache_storage_read_threads=args.read_threads, hicache_storage_backend_extra_config=extra)
    base.update(kw)
    t0 = time.perf_counter()
    eng = Engine(**base)
    args.engine_init_s.append(round(time.perf_counter() - t0, 2))
    eng.started_at = t0  # bench/gpu_tiers_l3.py: requests timed from the engine's start
    # L2 is pinned in chunks on a background thread while the engine already serves (issue 27);
    # each cudaHostRegister holds the driver's lock and stalls kernel launches (measured on the
    # H200: 15 ms and 12 ms stalls inside one L3 hit right after a restart, 57 vs 36 ms). The
    # tiers are timed in the steady state: wait until every L2 page is pinned.
    t1 = time.perf_counter()
    host = eng.core.host_pool
    if wait_pinned and host is not None and host.pinner is not None:
        host.pinner.join()
    if wait_pinned:
        args.__dict__.setdefault("l2_pin_wait_s", []).append(round(time.perf_counter() - t1, 2))
    return eng


def server_warmup(eng) -> None:
    """What a server does before it reports ready (serving/server/serve.py ``_warmup``): one
    token of a one-token prompt."""
    eng.generate(input_ids=[0], sampling_params=ONE)


def bytes_per_token(shape: dict, dtype: str) -> int:
    """L1's KV bytes per token of a bench model (K and V of every layer; L2 and L3 hold the same raw)."""
    elem = 2 if dtype in ("bfloat16", "float16") else 4
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * elem


def close(eng, persist: bool = False) -> None:
    """Shut an engine down; ``persist``: write every cached page to L3 first (as a server's
    shutdown does), else skip that (a bench engine whose store is thrown away)."""
    core, eng.core = eng.core, None
    try:
        core.shutdown(persist=persist)
    finally:
        core.release()


def timed(eng, ids) -> tuple[float, dict]:
    sync()
    t0 = time.perf_counter()
    out = eng.generate(input_ids=ids, sampling_params=ONE)
    sync()
    return time.perf_counter() - t0, out


def tier_gbps(eng, before: dict, kind: str) -> float:
    """GB/s inside the tier's reads (``kind="read"``) or writes (``"write"``) since ``before``."""
    st = eng.core.storage.tier.stats()
    nbytes_key = "bytes_read" if kind == "read" else "bytes_written"
    nbytes = st[nbytes_key] - before.get(nbytes_key, 0)
    secs = st[f"{kind}_s"] - before.get(f"{kind}_s", 0)
    return nbytes / secs / 1e9 if secs > 0 else 0.0


# -- 1. ceilings ------------------------------------------------------------------------------
def ceilings(res: dict, args, work: str) -> None:
    nbytes = int(args.ceiling_gb * 2**30) // CHUNK * CHUNK
    chunks = nbytes // CHUNK
    dst = pinned(nbytes)
    threads = args.read_threads
    if torch.cuda.is_available():
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        src = torch.from_numpy(dst)
        dev.copy_(src, non_blocking=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            dev.copy_(src, non_blocking=True)
        sync()
        res["pinned_h2d_gbps"] = 5 * nbytes / (time.perf_counter() - t0) / 1e9
        del dev
    # a file in the page cache / on disk, read into pinned memory
    path = os.path.join(work, "ceiling.bin")
    block = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8)
    with open(path, "wb") as f:
        for _ in range(chunks):
            f.write(block)

    def file_reader(i, n):
        fd = os.open(path, os.O_RDONLY)
        try:
            for c in range(i, chunks, n):
                os.preadv(fd, [memoryview(dst[c * CHUNK:(c + 1) * CHUNK])], c * CHUNK)
        finally:
            os.close(fd)

    in_threads(1, file_reader, nbytes)  # warm
    res["file_read_1t_gbps"] = in_threads(1, file_reader, nbytes)
    res[f"file_read_{threads}t_gbps"] = in_threads(threads, file_reader, nbytes)
    drop_page_cache(path)
    res["disk_read_gbps"] = in_threads(threads, file_reader, nbytes)
    os.unlink(path)
    # LMDB raw: one write transaction of page-sized values, then view reads copied into pinned memory
    db = os.path.join(work, "ceiling-lmdb")

    def open_env():
        return lmdb.open(db, map_size=2 * nbytes + (64 << 20), sync=False, metasync=False, readahead=False,
                         max_readers=256)

    env = open_env()
    keys = [f"{i:032x}".encode() for i in range(chunks)]
    t0 = time.perf_counter()
    with env.begin(write=True) as txn:
        for k in keys:
            txn.put(k, block)
    res["lmdb_put_gbps"] = nbytes / (time.perf_counter() - t0) / 1e9
    # the disk's raw write rate (the L3 write goal's reference): the same bytes written sequentially
    # to 1 file and to one file per shard of the store at once, then fdatasync; the faster counts, each
    # the best of 2 rounds (a first write can be several times slower: bench/l3_write.py's medians).
    # Each starts on an idle disk (os.sync: no other dirty pages, such as LMDB's, written back beside it)
    for files in sorted({1, DEFAULT_SHARDS}):
        secs = []
        for _ in range(2):
            os.sync()
            secs.append(raw_write(work, nbytes, files, sync=True))
        res[f"disk_write_{files}f_gbps"] = nbytes / min(secs) / 1e9
    res["disk_write_gbps"] = max(res[f"disk_write_{f}f_gbps"] for f in {1, DEFAULT_SHARDS})
    os.sync()
    res["page_cache_write_gbps"] = nbytes / raw_write(work, nbytes, 1, sync=False) / 1e9  # no fdatasync

    def lmdb_reader(i, n):
        with env.begin(buffers=True) as txn:
            for c in range(i, chunks, n):
                np.copyto(dst[c * CHUNK:(c + 1) * CHUNK], np.frombuffer(txn.get(keys[c]), np.uint8))

    in_threads(1, lmdb_reader, nbytes)
    res["lmdb_read_1t_gbps"] = in_threads(1, lmdb_reader, nbytes)
    res[f"lmdb_read_{threads}t_gbps"] = in_threads(threads, lmdb_reader, nbytes)
    res["lmdb_read_16t_gbps"] = in_threads(16, lmdb_reader, nbytes)
    env.close()
    env = open_env()  # a cold map (as after an engine restart): every page faults in again
    res[f"lmdb_read_{threads}t_cold_map_gbps"] = in_threads(threads, lmdb_reader, nbytes)
    env.close()
    res["l3_read_threads"] = threads
    res["lmdb_raw_read_gbps"] = res[f"lmdb_read_{threads}t_gbps"]  # the L3 read goal's reference
    print(f"ceilings: { {k: round(v, 2) for k, v in res.items() if k.endswith('gbps')} }", flush=True)


# -- 3. multi-turn ----------------------------------------------------------------------------
def _multiturn_run(args, model_dir: str, l3: str | None, extra: dict, concurrent: bool, observer=None) -> dict:
    """One setup, one mode. Serial: conversations take turns one request at a time (a user
    waits for the answer) and every returning request's TTFT is timed. Concurrent: each turn
    sends all conversations at once (one batch) and its wall time is timed. Throughput =
    prompt tokens of returning turns over the time they took (sum of TTFTs / of turn walls).
    ``observer`` (bench/hybrid_mt_probe.py): ``start(eng)`` after the warm-up, ``turn(t, dt, outs,
    forwards, eng)`` after each turn (concurrent) once its write-backs drained, ``end(eng)`` before the
    engine closes. ``args.warm_tokens``: the warm-up prompts' length (1024)."""
    vocab, convs, turns = args.vocab, args.conversations, args.turns
    eng = make_engine(args, model_dir, l3, max_total_tokens=args.mt_l1_tokens, **extra)
    hist = rand_prompts(convs, args.context, vocab, seed=31)
    more = rand_prompts(convs * turns, args.mt_user + args.mt_answer, vocab, seed=32)
    for p in rand_prompts(4, getattr(args, "warm_tokens", 1024), vocab, 33):
        eng.generate(input_ids=p, sampling_params=ONE)
    if observer is not None:
        observer.start(eng)
    times, tokens, hits, forwards = [], 0, {"device": 0, "host": 0, "storage": 0}, 0
    stats = eng.core.scheduler.stats
    for t in range(turns):
        before = stats.forward_passes
        if concurrent:
            dt, outs = timed(eng, hist)
            per = [(dt, o) for o in outs]
            if t > 0:
                times.append(dt)
        else:
            per = [timed(eng, hist[c]) for c in range(convs)]
            if t > 0:
                times.extend(dt for dt, _ in per)
        fwd = stats.forward_passes - before
        if t > 0:
            forwards += fwd
        for c, (_, o) in enumerate(per):
            if t > 0:
                tokens += len(hist[c])
                for k, v in o["meta_info"]["cached_tokens_details"].items():
                    hits[k] += v
            hist[c] = hist[c] + o["output_ids"] + more[c * turns + t]
        if eng.core.storage is not None:  # the users think; write-backs drain (not timed)
            eng.core.storage.poll(wait=True)
        if observer is not None:
            observer.turn(t, per[0][0], [o for _, o in per], fwd, eng)
    out = {"prompt_tok_s": tokens / sum(times), "hit_tokens": hits, "prompt_tokens": tokens,
           "hit_share": sum(hits.values()) / tokens if tokens else 0.0,
           "forwards_per_turn": forwards / max(1, turns - 1)}  # forward passes of a returning turn (all requests)
    if not concurrent:
        out.update(ttft_p50_s=statistics.median(times), ttft_mean_s=statistics.mean(times), ttft_max_s=max(times))
    else:
        out["turn_wall_p50_s"] = statistics.median(times)
    if eng.core.storage is not None:
        st = eng.core.storage_stats()
        out["storage"] = {k: st.get(k, 0) for k in (
            "pages_written", "hits", "pages_prefetched", "read_s", "write_pages_dropped", "cost_l3_refusals",
            "cost_l3_read_gbps", "cost_prefill_tok_s", "fetches_followed", "pages_loaded_early",
            "l2_backups_skipped_pages")}
        out["storage"]["write_pages_waiting_max"] = st.get("write_pages_waiting_max", 0)
    eng.check_integrity()
    if observer is not None:
        observer.end(eng)
    close(eng)
    return out


def multiturn_section(res: dict, args, model_dir: str, work: str) -> None:
    """The modes of ``--mt-modes`` (concurrent: the goal's; serial: returning-turn TTFT) for L1
    only / L1+L2 / L1+L2+L3."""
    modes = [m for m in ("serial", "concurrent") if m in args.mt_modes]
    out: dict = {m: {} for m in modes}
    setups = {"l1_only": ({}, False), "l1_l2": ({"hicache_size": args.mt_l2_gb}, False),
              "l1_l2_l3": ({"hicache_size": args.mt_l2_gb}, True)}
    for mode in modes:
        for name, (extra, with_l3) in setups.items():
            l3 = os.path.join(work, f"mt-{mode}-{name}") if with_l3 else None
            t0 = time.perf_counter()
            out[mode][name] = _multiturn_run(args, model_dir, l3, dict(extra), mode == "concurrent")
            out[mode][name]["wall_s"] = round(time.perf_counter() - t0, 1)
            print(f"multi-turn {mode} {name}: {out[mode][name]}", flush=True)
            if l3:
                shutil.rmtree(l3, ignore_errors=True)
    res["multiturn"] = {"conversations": args.conversations, "turns": args.turns, "context": args.context,
                        "l1_tokens": args.mt_l1_tokens, "l2_gb": args.mt_l2_gb, **out}
    for name, key in (("l1_only", "l1"), ("l1_l2", "l2"), ("l1_l2_l3", "l3")):
        if "concurrent" in out:
            res[f"multiturn_tput_{key}_tok_s"] = out["concurrent"][name]["prompt_tok_s"]
        if "serial" in out:
            res[f"multiturn_serial_tput_{key}_tok_s"] = out["serial"][name]["prompt_tok_s"]
            res[f"multiturn_serial_ttft_p50_{key}_s"] = out["serial"][name]["ttft_p50_s"]
