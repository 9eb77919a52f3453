"""Rank 0 of a tensor-parallel engine: starts the other ranks and tells them what to do.

"The tree decides, controllers move": rank 0 owns the scheduler and the HiRadixTree (metadata
only). Each forward pass and each batch of tier moves the tree emits is sent, in order, down
every follower's command pipe before rank 0 runs its own part, so page ids, locks and the tree
are identical on every rank by construction (one tree). A model with state layers: each forward
carries its state slots, the tree's snapshot copies are moves, and rank 0's own writes into its L1
state pool outside a forward (a request's working slot zeroed or copied from its match's snapshot at
admission) are recorded by :meth:`TPLeader.setup`'s wrap of that pool and sent, as one ``StateOps``
command, before the next command: every rank's state slots hold its heads' state of the same
sequences. A hybrid SWA L1's window map likewise: rank 0's writes to it are sent, as one ``WindowMap``
command, before the next command (serving/parallel/window_map.py), so every rank's sliding layers
read and move the same window pages. L3 reads and writes (rank 0's
background threads) are mirrored by :class:`TPStorageTier`: every rank moves its own part of
the page under its own key (``hicache.keys.tp_shard_key``), and a page counts as read, written
or present only when every rank's part is; a part stored under rank 0's key (kv head 0 replicated,
and an MLA model's latent, the same on every rank: one L3 entry per page) is written by rank 0
alone and read by every rank; a state model's snapshots likewise, per rank
(serving/tp/state_l3.py).

Faults: a monitor thread watches the followers; one that exits takes the engine down with a
message naming it, and every collective has ``--dist-timeout``. In the server's engine process
"down" is ``os._exit`` (a scheduler blocked in a collective is never left hanging); in the offline
``Engine`` the process is the caller's, so the other ranks are killed (a collective then fails at
once) and the engine's next call raises :class:`RankDied` naming the rank.

Concurrency contract: ``forward`` and ``execute`` are called on the scheduler thread only (their
commands keep its order); ``TPStorageTier`` calls come from any thread and are serialised per
engine only per follower pipe (serving/tp/rpc.py: requests run concurrently on every rank).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import wait
from typing import Any

import torch

from serving.config import EngineConfig
from serving.parallel.group import TPGroup, destroy_tp_group, init_tp_group
from serving.parallel.shard import ShardPlan
from serving.parallel.window_map import map_digest, record_map, take_notes
from serving.tp import messages as msg
from serving.tp.faults import RankDied, claim_group, death_reason, error_path
from serving.tp.rank import cpu_threads_per_rank
from serving.tp.rpc import RpcClient
from serving.tp.state_l3 import TPStateStore, mirror_loads
from serving.tp.state_ops import record_writes

log = logging.getLogger(__name__)
EXIT_RANK_DIED = 3


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """``config`` for ``rank``: on CUDA rank r uses the r-th GPU after the configured one."""
    from serving.runner.model_runner import resolve_device

    dev = resolve_device(config.model.device)
    name = f"cuda:{(dev.index or 0) + rank}" if dev.type == "cuda" else dev.type
    return dataclasses.replace(config, model=dataclasses.replace(config.model, device=name))


def _shutdown_at_exit(ref: weakref.ref) -> None:
    leader = ref()
    if leader is not None:
        leader.shutdown()


class TPLeader:
    """Rank 0's side of tensor parallelism: the followers' processes, their command pipes
    (``_cmds``, one-way, in the scheduler's order) and request pipes (``_rpcs``).

    Concurrency contract. The scheduler thread calls everything but the L3 methods: ``setup``,
    the wrapped ``forward`` / ``execute`` (each sends its command down every command pipe, then
    runs rank 0's part; ``seq`` counts them and only this thread writes it), ``check_integrity``
    and ``shutdown``. ``mirrored`` (through :class:`TPStorageTier`) is called from L3's reader and
    writer threads as well; each :class:`serving.tp.rpc.RpcClient` serialises its sends
    under its own lock and answers on its ``tp-rpc<r>`` reader thread. Waits: a collective waits
    at most ``--dist-timeout``; ``_answers`` waits for each follower's answer at most
    ``2 * dist_timeout + 10`` s, then takes the engine down (``_die``). The ``tp-monitor`` thread
    only waits for a follower to exit and then takes the engine down (unless ``_stopping``, set
    by ``shutdown`` before the followers are told to stop). ``dead`` is written by whichever of the
    monitor and the scheduler thread (a collective that failed: ``_collective_failed``) names a dead
    rank first; both only set it from None to a reason, and readers raise it. No lock of its own: ``_cmds`` is
    used by the scheduler thread only, the rest is fixed at construction.
    """

    def __init__(self, config: EngineConfig, exit_on_death: bool = True) -> None:
        from serving.runner.model_runner import resolve_device
        from serving.tp.follower import follower_main

        self.size = config.model.tp_size
        self.config = rank_config(config, 0)
        device = resolve_device(self.config.model.device)
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + self.size:
            raise ValueError(f"--tp-size {self.size} needs {self.size} GPUs from {device}; "
                             f"this host has {torch.cuda.device_count()}")
        from serving.models.arch_config import ModelArchConfig
        from serving.models.loader import get_model_class  # (the loader registers the families)

        arch = ModelArchConfig.from_pretrained(config.model.model_path)
        self.plans = [ShardPlan.for_model(arch, r, self.size) for r in range(self.size)]  # checks the heads
        check_tp = getattr(get_model_class(arch.architectures), "check_tp", None)
        if check_tp is not None:  # a family's own layers (the state layers' heads and groups)
            check_tp(arch, self.size)
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(self.size))
        else:
            torch.cuda.set_device(device)
        self._stopping = False
        self.dead: str | None = None  # why the engine stopped (a rank died), when it did not exit
        claim_group(self)  # the process's default group, before any rank starts (serving/tp/faults.py)
        self._dir = tempfile.mkdtemp(prefix="hicache-tp-")
        init = f"file://{self._dir}/init"
        ctx = mp.get_context("spawn")
        self._cmds, self._rpcs, self.procs = [], [], []
        for r in range(1, self.size):
            rx, tx = ctx.Pipe(duplex=False)
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=follower_main, name=f"hicache-tp{r}", daemon=True,
                            args=(rank_config(config, r), r, self.size, init, rx, theirs, error_path(self._dir, r)))
            p.start()
            rx.close()
            theirs.close()
            self._cmds.append(tx)
            self._rpcs.append(RpcClient(mine, r))
            self.procs.append(p)
        self._exit_on_death = exit_on_death
        threading.Thread(target=self._monitor, name="tp-monitor", daemon=True).start()
        # an engine never shut down still stops its ranks when the interpreter exits (they ignore the
        # SIGTERM multiprocessing would send them, so its exit would wait for them for ever)
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        self.group: TPGroup = init_tp_group(0, self.size, init, device, config.model.dist_timeout)
        self.seq = 0  # commands sent
        self._state_ops: list[tuple[str, int, int]] = []  # L1 state slot writes not sent yet (see setup)
        self._win_notes: dict[int, int] = {}  # window map entries written, not sent yet (see setup)
        self._windows: Any = None  # a hybrid SWA L1's WindowPages (setup)
        self._state_slots = (0, 0)  # a state model's L1 / L2 state slot counts (setup)
        self.check_wait_s: float | None = None  # how long a check waits for a follower (None: dist_timeout)

    # -- what the scheduler thread calls -----------------------------------------------------
    def _send(self, cmd: Any) -> None:
        if self.dead is not None:
            raise RankDied(self.dead)
        self._flush_notes()
        for c in self._cmds:
            c.send(cmd)
        self.seq += 1

    def _flush_notes(self) -> None:
        """What rank 0 wrote outside a command since the last one (L1 state slots, window map entries):
        the followers do the same before the next command."""
        if self._state_ops:
            ops = list(self._state_ops)
            self._state_ops.clear()  # (the list record_writes appends to)
            self._send(msg.StateOps(ops))
        notes = take_notes(self._win_notes)
        if notes is not None:
            self._send(msg.WindowMap(*notes))

    def _send_each(self, make: Callable[[int], Any]) -> None:
        """One command, ``make(r)`` to follower ``r`` (its own part of something)."""
        if self.dead is not None:
            raise RankDied(self.dead)
        self._flush_notes()
        for r, c in enumerate(self._cmds, start=1):
            c.send(make(r))
        self.seq += 1

    def setup(self, host_pages: int, state_pool: Any = None, host_state_pool: Any = None,
              windows: Any = None) -> None:
        """The first command: the pools' sizes. A state model's L1 ``state_pool`` (a DeviceStatePool)
        gets its writes outside a forward recorded (serving/tp/state_ops.py), a hybrid SWA L1's
        ``windows`` (its WindowPages) its map writes (serving/parallel/window_map.py); the records go to
        the followers before the next command (:meth:`_send`)."""
        slots = state_pool.num_slots if state_pool is not None else 0
        host_slots = host_state_pool.num_slots if host_state_pool is not None else 0
        self._state_slots = (slots, host_slots)
        if state_pool is not None:
            record_writes(state_pool, self._state_ops)
        self._windows = windows
        if windows is not None:
            record_map(windows, self._win_notes)
        if host_state_pool is not None:  # a snapshot from L3 comes in with every rank's part
            mirror_loads(host_state_pool, self._send_each)
        self._send(msg.Setup(host_pages, slots, host_slots))

    def wrap_forward(self, forward: Callable) -> Callable:
        def tp_forward(batch: Any) -> torch.Tensor:
            i64, i32, t, b, width = batch.host
            rows = None if batch.logit_rows is None else batch.logit_rows.tolist()
            # overlap scheduling (CUDA): ids of the previous step's tokens are still placeholders on the
            # host; rank 0 has filled them in on the GPU and broadcasts them (GPU to GPU, no host sync)
            placeholders = bool((i64[:t] < 0).any())
            state = None if batch.state_slots_list is None else \
                (batch.state_slots_list, batch.snap_slots_list, batch.snap_offsets_list)
            self._send(msg.Forward(i64.numpy(), i32.numpy(), t, b, width, batch.page_size,
                                   batch.prefix_lens_list, batch.extend_lens_list, rows, placeholders, state))
            try:
                if placeholders:
                    self.group.broadcast(batch.input_ids)
                return forward(batch)
            except RuntimeError as e:
                self._collective_failed(e)
                raise

        return tp_forward

    def wrap_execute(self, execute: Callable) -> Callable:
        def tp_execute(transfers: list) -> Any:
            if transfers:
                self._send(msg.Moves([(t.kind, list(t.src_pages), list(t.dst_pages)) for t in transfers]))
            try:
                return execute(transfers)
            except RuntimeError as e:
                self._collective_failed(e)
                raise

        return tp_execute

    # -- L3 --------------------------------------------------------------------------------
    def wrap_tier(self, tier: Any) -> TPStorageTier:
        return TPStorageTier(tier, self)

    def rank_keys(self, keys: Sequence[str], rank: int) -> list[str]:
        from hicache.keys import tp_shard_key

        plan = self.plans[rank]
        return [tp_shard_key(k, plan.kv_head_start, plan.num_kv_heads) for k in keys]

    def _answers(self, futures: list, what: str) -> list:
        # a follower first waits up to dist_timeout for the commands a request follows, then answers
        limit = 2 * self.config.model.dist_timeout + 10
        out = []
        for r, fut in enumerate(futures, start=1):
            try:
                out.append(fut.result(limit))
            except FutureTimeout:
                self._die(f"tensor-parallel rank {r} did not answer {what} in {limit:.0f} s")
        return out

    def shares_rank0_key(self, rank: int) -> bool:
        """Rank ``rank``'s part of a page is stored under rank 0's key: the same bytes (kv head 0, an
        MLA model's latent), so rank 0's write stores it."""
        return self.plans[rank].kv_head_start == 0

    def mirrored(self, make: Callable[[int], Any], local: Callable[[], int], writes: bool = False) -> int:
        """Send ``make(rank)`` to every follower, run ``local()``, return the smallest count;
        ``writes``: not to the followers whose part rank 0 writes (:meth:`shares_rank0_key`)."""
        futures = [c.call(make(r)) for r, c in enumerate(self._rpcs, start=1)
                   if not (writes and self.shares_rank0_key(r))]
        done = local()
        return min([done, *(int(n) for n in self._answers(futures, "an L3 request"))])

    def check_integrity(self, device_pages: int, host_pages: int) -> None:
        """Every follower has run every command sent so far and has the same pools; AssertionError else."""
        self._flush_notes()  # a window map's latest writes: the followers' maps must be rank 0's
        wait_s = self.check_wait_s or self.config.model.dist_timeout
        answers = self._answers([c.call(msg.Check(self.seq, wait_s)) for c in self._rpcs], "an integrity check")
        want = (self.seq, device_pages, host_pages, *self._state_slots, map_digest(self._windows))
        for r, answer in enumerate(answers, start=1):
            if tuple(answer) != want:
                raise AssertionError(
                    f"tensor-parallel rank {r}: ran {answer[0]} of {self.seq} commands, L1 / L2 pages, state "
                    f"slots and window map digest {tuple(answer[1:])} (rank 0: {want[1:]})")

    # -- faults and shutdown ---------------------------------------------------------------
    def _monitor(self) -> None:
        sentinels = {p.sentinel: (r, p) for r, p in enumerate(self.procs, start=1)}
        ready = wait(list(sentinels))
        if self._stopping:
            return
        r, p = sentinels[ready[0]]
        p.join(10)  # its exit code: a rank's interpreter can take over a second to end after its sentinel is
        # ready on a loaded machine (CI saw "exited with code None" with 1 s)
        try:
            self._die(death_reason(r, p, error_path(self._dir, r)))
        except RankDied:
            pass  # the offline engine: its next call raises it

    @property
    def stopping(self) -> bool:
        return self._stopping

    def _collective_failed(self, e: RuntimeError) -> None:
        """Rank 0's part failed (a collective's "Connection reset by peer", ...): if a follower is gone,
        raise :class:`RankDied` naming it and why (its exit code, its traceback) instead."""
        if isinstance(e, RankDied):
            return
        # a peer's socket closes as it exits: the monitor thread (which may reap it first, so that
        # is_alive() here still says True for a moment) or this loop names it; 5 s of neither: not a death
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if self.dead is not None:
                raise RankDied(self.dead)
            for r, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    self._die(death_reason(r, p, error_path(self._dir, r)))  # raises RankDied (or exits)
            time.sleep(0.05)

    def _die(self, why: str) -> None:
        log.error("%s: the engine stops (every rank is needed for every forward pass)", why)
        print(f"hicache engine: {why}; stopping", file=sys.stderr, flush=True)
        if self._exit_on_death:
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            os._exit(EXIT_RANK_DIED)
        if self.dead is None:  # the first death names the engine's end (the others are killed for it)
            self.dead = why
        for p in self.procs:
            if p.is_alive():
                p.kill()
        raise RankDied(self.dead)

    def shutdown(self) -> None:
        if self._stopping:
            return  # shut down already
        self._stopping = True
        for c in self._cmds:
            try:
                c.send(msg.Stop())
            except OSError:
                pass
        destroy_tp_group(self.group)
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


class TPStorageTier:
    """Rank 0's StorageTier, mirrored on every rank (see the module docstring); everything
    else (codec, stats, close, ...) is rank 0's tier."""

    def __init__(self, tier: Any, leader: TPLeader) -> None:
        self._tier, self._leader = tier, leader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tier, name)

    def state_store(self, layout: Any) -> TPStateStore:
        """A state model's snapshot store: every rank writes its part (serving/tp/state_l3.py)."""
        from hicache.tiers.storage_state import StateStore

        return TPStateStore(StateStore(self._tier.backend, layout, 0, self._leader.size), self._leader)

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Leading pages whose every part is in the store (rank 0 asks the shared store)."""
        n = self._tier.batch_exists(keys)
        for r in range(1, self._leader.size):
            if n == 0:
                break
            if self._leader.shares_rank0_key(r):
                continue  # rank 0's keys, just asked
            n = min(n, self._tier.batch_exists(self._leader.rank_keys(keys[:n], r)))
        return n

    def batch_get(self, keys: Sequence[str], host_pool: Any, host_pages: Sequence[int]) -> int:
        ld, pages = self._leader, list(host_pages)
        return ld.mirrored(lambda r: msg.L3Get(ld.seq, ld.rank_keys(keys, r), pages),
                           lambda: self._tier.batch_get(keys, host_pool, host_pages))

    def batch_set(self, keys: Sequence[str], host_pool: Any, host_pages: Sequence[int]) -> int:
        ld, pages = self._leader, list(host_pages)
        return ld.mirrored(lambda r: msg.L3Set(ld.seq, ld.rank_keys(keys, r), pages),
                           lambda: self._tier.batch_set(keys, host_pool, host_pages), writes=True)
