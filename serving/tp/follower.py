"""A tensor-parallel rank other than 0: runs what rank 0 sends, on its own shard and pools.

It owns no scheduler and no tree: rank 0 decides, this process moves bytes and computes.
Its main thread runs the command pipe in order (forward passes, L1 <-> L2 copies of pages and
state snapshots, a state model's slot zeroing and copies, a hybrid SWA L1's window map entries,
its part of a snapshot read from L3 into an L2 slot); a second thread answers L3 reads and writes
(pages, its part of a snapshot), each only after the command it follows has run. It exits
when rank 0's pipe closes (rank 0 gone) and non-zero when a command fails (rank 0's monitor
then stops the engine).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from serving.config import EngineConfig
from serving.parallel.window_map import map_digest
from serving.tp import messages as msg
from serving.tp.faults import open_crash_log, write_error
from serving.tp.rpc import serve_rpc

log = logging.getLogger(__name__)


@dataclass
class _Move:  # CacheController.execute reads these fields of a hicache Transfer
    kind: str
    src_pages: list[int]
    dst_pages: list[int]
    pending: None = None


class _Progress:
    """The last command sequence number the main thread finished (the storage thread waits on it)."""

    def __init__(self, done: int) -> None:
        self.done = done
        self.cond = threading.Condition()

    def advance(self) -> None:
        with self.cond:
            self.done += 1
            self.cond.notify_all()

    def wait(self, seq: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.done >= seq, timeout)


def follower_main(config: EngineConfig, rank: int, size: int, init: str, cmds: Connection,
                  rpc: Connection, err_path: str | None = None) -> None:
    """Rank ``rank``'s process; ``err_path``: where its traceback goes if it fails (rank 0's message)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    # a signal to the process group is rank 0's to handle: it persists the cache (every rank's part)
    # and then stops us; we exit on our own when its pipe closes
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    crash = open_crash_log(err_path)
    if crash is not None:  # a crash in native code (SIGSEGV, SIGBUS, ...): every thread's stack, for rank 0
        faulthandler.enable(file=crash, all_threads=True)
    try:
        _run(config, rank, size, init, cmds, rpc)
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        write_error(err_path)
        sys.stderr.flush()
        os._exit(1)


def _run(config: EngineConfig, rank: int, size: int, init: str, cmds: Connection, rpc: Connection) -> None:
    from hicache.tiers.host import make_host_pool
    from hicache.tiers.host_state import HostStatePool
    from serving.cache.cache_controller import CacheController
    from serving.parallel.group import destroy_tp_group, init_tp_group
    from serving.parallel.window_map import MapMirror
    from serving.runner.model_runner import ModelRunner
    from serving.structs.forward_batch import ForwardBatch
    from serving.tp.rank import cpu_threads_per_rank, make_rank_tier
    from serving.tp.state_ops import apply_ops

    device = torch.device(config.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu":  # the ranks share the cores
        torch.set_num_threads(cpu_threads_per_rank(size))
    tp = init_tp_group(rank, size, init, device, config.model.dist_timeout)
    runner = ModelRunner(config.model, config.scheduler, config.cache.page_size, tp, config.cache.kv_round_trip)
    setup = cmds.recv()
    assert isinstance(setup, msg.Setup)
    cache = config.cache
    host_pool = make_host_pool(cache.hicache_mem_layout, runner.pool.layout, setup.host_pages, cache.page_size,
                               cache.hicache_l2_encoding, pin_memory=runner.device.type == "cuda") \
        if setup.host_pages else None
    state = runner.state_pool
    if (state.num_slots if state is not None else 0) != setup.state_slots:
        raise RuntimeError(f"rank {rank} has {state.num_slots if state else 0} L1 state slots, rank 0 "
                           f"{setup.state_slots}")
    host_state = HostStatePool(state.layout, setup.host_state_slots, pin_memory=runner.device.type == "cuda") \
        if state is not None and setup.host_state_slots else None
    controller = CacheController(runner.pool, host_pool, (state, host_state) if host_state is not None else None) \
        if host_pool is not None else None
    tier = make_rank_tier(config, runner.pool.layout) if host_pool is not None and cache.storage_enabled else None
    states = None  # a state model's L2 state pool and this rank's part of the snapshots on L3
    if tier is not None and host_state is not None:
        from hicache.tiers.storage_state import StateStore

        states = (host_state, StateStore(tier.backend, host_state.layout, rank, size))
    mirror = MapMirror(runner.pool.windows) if runner.pool.windows is not None else None  # a hybrid SWA L1
    progress = _Progress(1)  # Setup was command 1
    workers = 2 + cache.hicache_storage_read_threads  # rank 0's reader threads, its writer, a check
    counts = (runner.pool.num_pages, host_pool.num_pages if host_pool is not None else 0,
              setup.state_slots, setup.host_state_slots)
    threading.Thread(target=_serve_requests, args=(rpc, counts, mirror, tier, host_pool, states, progress,
                                                   config.model.dist_timeout, workers),
                     name="tp-requests", daemon=True).start()
    try:
        while True:
            try:
                cmd = cmds.recv()
            except EOFError:  # rank 0 is gone
                return
            if isinstance(cmd, msg.Stop):
                return
            if isinstance(cmd, msg.Forward):
                fb = ForwardBatch.from_host(torch.from_numpy(cmd.i64), torch.from_numpy(cmd.i32), cmd.t, cmd.b,
                                            cmd.width, cmd.page_size, cmd.prefix_lens, cmd.extend_lens, device)
                if cmd.ids_from_rank0:
                    tp.broadcast(fb.input_ids)
                if cmd.logit_rows is not None:
                    fb.logit_rows = torch.tensor(cmd.logit_rows, dtype=torch.int64, device=device)
                if cmd.state is not None:
                    fb.set_state(*cmd.state)
                if mirror is not None:  # the sliding layers' view, through rank 0's window map
                    mirror.window_view(fb, cmd.i64, cmd.i32)
                runner.forward(fb)  # the logits are rank 0's to sample from
            elif isinstance(cmd, msg.StateOps):
                apply_ops(state, cmd.ops)
            elif isinstance(cmd, msg.WindowMap):
                mirror.apply(cmd.pages, cmd.values)
            elif isinstance(cmd, msg.StateLoad):
                host_state.load_slot_bytes(cmd.slot, cmd.payload)
            elif isinstance(cmd, msg.Moves):
                last = controller.execute([_Move(*m) for m in cmd.moves])
                if last is not None:
                    last.result()  # in order with the next command (a forward may read these pages)
            progress.advance()
    finally:
        if controller is not None:
            controller.shutdown()
        if tier is not None:
            tier.close()
        destroy_tp_group(tp)


def _serve_requests(rpc: Connection, counts: tuple, mirror, tier, host_pool, states,  # noqa: ANN001
                    progress: _Progress, timeout: float, workers: int) -> None:
    """Rank 0's requests that are not commands: L3 reads and writes (pages, this rank's part of a state
    snapshot), integrity checks."""

    def handle(req: msg.L3Get | msg.L3Set | msg.L3StateSet | msg.Check) -> object:
        ran = progress.wait(req.after, min(timeout, req.wait_s) if isinstance(req, msg.Check) else timeout)
        if isinstance(req, msg.Check):
            return (progress.done, *counts, map_digest(mirror.windows if mirror is not None else None))
        if not ran or tier is None:
            return 0  # never read a page whose backup has not run: a miss / a failed write
        if isinstance(req, msg.L3StateSet):
            return 0 if states is None else int(states[1].put_slot(req.page_key, states[0], req.slot))
        if isinstance(req, msg.L3Get):
            return tier.batch_get(req.keys, host_pool, req.pages)
        return tier.batch_set(req.keys, host_pool, req.pages)

    serve_rpc(rpc, handle, workers)
