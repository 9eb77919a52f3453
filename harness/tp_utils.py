"""Helpers for tensor-parallel tests: run our model sharded over N gloo ranks (one process each)."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from pathlib import Path

PAGE_SIZE = 4


def greedy(path: str, prompts: list[list[int]], steps: int, rank: int = 0, size: int = 1,
           init: str | None = None) -> list[list[int]]:
    """Greedy tokens of every prompt (one batch: prefill, then ``steps - 1`` decode steps) with
    our model sharded as rank ``rank`` of ``size``."""
    import torch

    from hicache.tiers.device import DeviceKVPool
    from serving.kernels.attention import get_attention_backend
    from serving.models.loader import load_model
    from serving.parallel.group import destroy_tp_group, init_tp_group
    from serving.structs.forward_batch import ForwardBatch

    torch.set_num_threads(1)
    tp = init_tp_group(rank, size, init, torch.device("cpu"), timeout_s=60) if size > 1 else None
    try:
        model, cfg = load_model(path, tp=tp)
        plan = model.plan
        layout = cfg.kv_layout(torch.float32, kv_heads=plan.num_kv_heads)  # MLA: the latent
        pool = DeviceKVPool(layout, 256, PAGE_SIZE, "cpu")
        attn = get_attention_backend("torch")
        pages, nxt, lens = [], 1, []
        for p in prompts:
            need = -(-(len(p) + steps) // PAGE_SIZE)
            pages.append(list(range(nxt, nxt + need)))
            nxt += need
            lens.append(0)
        outs: list[list[int]] = [[] for _ in prompts]
        new = [list(p) for p in prompts]
        for _ in range(steps):
            fb = ForwardBatch.build([(ids, lens[i], pages[i]) for i, ids in enumerate(new)], PAGE_SIZE)
            logits = model(fb, pool, attn)
            assert logits.shape == (len(prompts), cfg.vocab_size)
            for i, ids in enumerate(new):
                lens[i] += len(ids)
                tok = int(logits[i].argmax())
                outs[i].append(tok)
                new[i] = [tok]
        return outs
    finally:
        if tp is not None:
            destroy_tp_group(tp)


def _rank_main(q, rank: int, size: int, init: str, path: str, prompts, steps: int) -> None:
    try:
        q.put((rank, greedy(path, prompts, steps, rank, size, init)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, traceback.format_exc()))


def greedy_tp(path: Path, prompts: list[list[int]], steps: int, size: int, tmp: Path) -> list[list[list[int]]]:
    """Every rank's greedy tokens with the model split over ``size`` gloo ranks (spawned)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp}/tp-init-{os.getpid()}-{size}"
    procs = [ctx.Process(target=_rank_main, args=(q, r, size, init, str(path), prompts, steps))
             for r in range(size)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for r in range(size):
        if isinstance(results[r], str):
            raise AssertionError(f"rank {r} failed:\n{results[r]}")
    return [results[r] for r in range(size)]
