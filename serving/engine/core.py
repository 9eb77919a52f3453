"""Everything one engine process owns: model runner, tree, scheduler, tokenizer.

Both the offline :class:`serving.engine.Engine` and the server's engine process build
one of these and drive ``step()``.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
import uuid
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from hicache import salt, sizing
from hicache.hiradix import HiRadixTree
from hicache.hiradix.quota import TenantLedger
from hicache.hiradix.sessions import SessionTable
from hicache.keys import namespace_for
from hicache.tiers.host import HostKVPool, make_host_pool
from hicache.tiers.host_state import HostStatePool
from hicache.tiers.host_windows import host_window_split
from hicache.tiers.kv_codec import get_encoding
from hicache.tiers.storage import StorageTier, make_storage
from serving.cache.cache_controller import CacheController
from serving.cache.cost_model import make_load_policy, prefill_backlog
from serving.cache.l3_windows import L3Windows
from serving.cache.prefill_timer import PrefillTimer
from serving.cache.req_cache import ReqCache
from serving.cache.request_windows import RequestWindows
from serving.cache.storage_controller import StorageController
from serving.cache.transfers import TransferRunner, TransferSink
from serving.config import EngineConfig
from serving.disagg.role import make_role
from serving.disagg.role_base import PDRole, RoleContext
from serving.grammar.runner import make_grammar_runner
from serving.runner.model_runner import ModelRunner
from serving.runner.sampler import Sampler
from serving.scheduler.prompt_check import check_prompt
from serving.scheduler.scheduler import Scheduler
from serving.scheduler.stop import StopChecker
from serving.structs.request import Req
from serving.structs.sampling_params import InvalidRequest, SamplingParams
from serving.tokenizer import Tokenizer, eos_token_ids, has_tokenizer
from serving.tp.leader import TPLeader

if TYPE_CHECKING:
    from serving.process_config import EngineProcessConfig
    from serving.speculative.worker import SpeculativeWorker

log = logging.getLogger(__name__)
GIL_SWITCH_S = 0.0005  # the interpreter's switch interval while an engine runs (see EngineCore.__init__)


class EngineCore:
    """Everything one engine process owns (see the module docstring), built in this order: the
    model runner (L1), L2, the tree, L3, the request cache, the scheduler, the grammar runner.

    Concurrency contract: one thread, the scheduler thread (the engine loop, or the offline
    Engine's caller), calls every method; the tree, the pools' bookkeeping and the scheduler
    are touched by it alone, so there is no lock here. The background threads the parts start
    (the ``hicache-load`` loader, L3 readers and writers, grammar compiles and mask fills, the
    tensor-parallel monitor) are each described by their class. :meth:`step` waits for one
    forward pass; :meth:`shutdown` waits for the L3 writes (``persist``) and the threads' exit.
    """

    @property
    def weights_tag(self) -> str:
        """What the weights' --quantization makes of the KV: ``none`` or the method's tag (``:gguf``
        when int4 took a GGUF's blocks as they are: scales that differ in the last bits), which
        quantize_model recorded on the model."""
        return getattr(self.runner.model, "quant_tag", "none")  # "none" too where auto resolved to fp32

    @property
    def kv_model_tag(self) -> str:
        """The weights' tag and the L1 round trip: PD peers must agree on both (KVGeometry)."""
        return f"q:{self.weights_tag}|rt:{self.config.cache.kv_round_trip}"

    @property
    def kv_namespace(self) -> str:
        """The namespace of this engine's page keys (hicache.keys), its one owner: L3 stores
        pages under it and the cache events (serving/engine/cache_events.py) announce them
        under it, with or without L3: model, L1 layout, rank 0, cache_salt, page size, the
        lower tiers' KV encoding, and the weights' tag (KV of quantized weights is another
        model's KV: keys apart)."""
        cache, model = self.config.cache, self.config.model
        model_id = model.served_model_name or os.path.basename(os.path.normpath(model.model_path))
        namespace = namespace_for(model_id, self.runner.pool.layout, 0, cache.cache_salt, cache.page_size) + \
            cache.kv_namespace_suffix
        return namespace if self.weights_tag == "none" else f"{namespace}|q:{self.weights_tag}"

    def __init__(self, config: EngineConfig, exit_on_rank_death: bool = True,
                 role_settings: EngineProcessConfig | None = None) -> None:
        """``exit_on_rank_death``: a dead tensor-parallel rank ends this process (the server's engine
        process) or makes the engine's calls raise (False: the offline Engine, in its caller's process).
        ``role_settings``: the server's settings, whose ``disaggregation_mode`` picks the PD role
        (serving/disagg; None or ``null``: colocated)."""
        self.config = config
        # The scheduler thread holds the GIL between kernel launches; a background thread (an L3
        # reader, a write-back, a PD transfer) that wakes up would otherwise wait up to 5 ms (Python's
        # default switch interval) for it on every hand-off. Process-wide: the offline Engine shares
        # its caller's interpreter, the server's engine process is its own.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        # tensor parallelism: this process is rank 0 (scheduler, tree); the other ranks follow it
        self.tp = TPLeader(config, exit_on_rank_death) if config.model.tp_size > 1 else None
        try:
            self._build(config, role_settings)
        except BaseException:
            if self.tp is not None:  # the other ranks and the process group go with this engine
                self.tp.shutdown()
            raise

    def _build(self, config: EngineConfig, role_settings: EngineProcessConfig | None) -> None:
        model_cfg = self.tp.config.model if self.tp else config.model
        self.runner = ModelRunner(model_cfg, config.scheduler, config.cache.page_size,
                                  self.tp.group if self.tp else None, config.cache.kv_round_trip)
        tok_path = config.model.tokenizer_path or config.model.model_path
        self.tokenizer = Tokenizer(tok_path) if has_tokenizer(tok_path) else None
        pool = self.runner.pool
        cache = config.cache
        self.host_pool: HostKVPool | None = None
        self.host_state_pool: HostStatePool | None = None  # L2 state snapshots (a model with state layers)
        self.controller: CacheController | None = None
        state = self.runner.state_pool
        if cache.host_enabled:
            self.host_pool = self._make_host_pool()
            if state is not None:
                self.host_state_pool = self._make_host_state_pool(state.num_slots)
            self.controller = CacheController(
                pool, self.host_pool, (state, self.host_state_pool) if state is not None else None)
        if self.tp is not None:
            self.tp.setup(self.host_pool.num_pages if self.host_pool else 0, state, self.host_state_pool,
                          pool.windows)
        self.tree = HiRadixTree.from_config(
            cache, pool.allocator, self.host_pool.allocator if self.host_pool else None,
            state_device=state, state_host=self.host_state_pool)
        self.ledger = TenantLedger(cache.page_size)  # per-tenant pages; quotas: set_quotas
        self.tree.set_ledger(self.ledger)
        execute = self.controller.execute if self.controller else None
        forward = self.runner.forward
        if self.tp is not None:
            execute = execute and self.tp.wrap_execute(execute)
            forward = self.tp.wrap_forward(forward)
        self.storage = self._make_storage(execute) if cache.storage_enabled else None
        transfers = self.storage.transfers if self.storage is not None else TransferRunner(self.tree, execute)
        windows = None
        if pool.windows is not None:  # a hybrid SWA L1: the sliding layers keep their windows only
            window = max(w for w in self.runner.layer_stack.windows if w is not None)
            windows = RequestWindows(pool.windows, self.tree, cache.page_size, window, self.host_pool, transfers)
            if self.storage is not None:  # L3 fetches bring the windows where their matches resume
                L3Windows(windows).attach(self.storage.prefetcher, self.storage.writeback)
        self.req_cache = ReqCache(self.tree, pool.allocator, cache.page_size, transfers, self.storage,
                                  self.runner.state_pool, windows)
        self.req_cache.reuse_prefixes = not cache.disable_radix_cache
        decode = (lambda ids: self.tokenizer.decode(ids)) if self.tokenizer else None
        self.eos_ids = eos_token_ids(config.model.model_path, self.tokenizer)
        self.grammar = make_grammar_runner(config.scheduler, self.tokenizer, self.runner.arch.vocab_size,
                                           self.eos_ids)
        # the load-vs-recompute model learns the prefill rate
        prefill_timer = None if self.storage is None else \
            PrefillTimer(self.storage.load_policy.observe_prefill, self.runner.device)
        sampler = Sampler()
        self.speculative: SpeculativeWorker | None = None  # NGRAM: drafts from the tree (serving/speculative)
        if config.scheduler.speculative_algorithm is not None:
            from serving.speculative.worker import SpeculativeWorker

            self.speculative = SpeculativeWorker(
                config.scheduler, self.req_cache, sampler, self.runner.context_len, self.runner.device,
                overlap=not config.scheduler.disable_overlap_schedule and self.runner.device.type == "cuda",
                grammar=self.grammar)
        self.role: PDRole | None = None  # a prefill / decode server's role (serving/disagg)
        if role_settings is not None:
            self.role = make_role(role_settings, RoleContext(pool, state, self.kv_model_tag, self.req_cache))
        self.scheduler = Scheduler(
            config.scheduler, self.req_cache, forward, StopChecker(self.eos_ids, decode),
            self.runner.context_len, self.runner.device, self.grammar, prefill_timer,
            sampler=sampler, spec=self.speculative, pd=self.role)

    def _make_host_pool(self) -> HostKVPool:
        """L2, sized against the memory the host can pin (hicache.sizing: --hicache-size past it is an
        error, a ratio is clamped with a warning). Pinned in the background (it grows while the
        engine serves, see ``step``) unless tensor-parallel ranks must hold the same pages from the start."""
        cache, pool = self.config.cache, self.runner.pool
        enc = get_encoding(cache.hicache_l2_encoding)
        page_bytes = enc.page_nbytes(pool.layout, cache.page_size)
        nbytes, warning = sizing.plan_l2(cache.hicache_ratio, cache.hicache_size, cache.effective_hicache_ratio,
                                         pool.num_pages * pool.bytes_per_page, page_bytes,
                                         share=self.config.model.tp_size)
        if warning is not None:
            log.warning("%s", warning)
        n = max(1, nbytes // page_bytes)
        win_layers, win_pages = (), 0
        if pool.windows is not None and not enc.lossy and self.tp is None:  # L2 keeps windows as L1 does
            win_layers = pool.window_layers
            n, win_pages = host_window_split(n, nbytes, page_bytes, len(win_layers) / pool.layout.num_layers,
                                             self.config.scheduler.swa_full_tokens_ratio, cache.hicache_size > 0)
        t0 = time.perf_counter()
        host = make_host_pool(cache.hicache_mem_layout, pool.layout, n, cache.page_size, enc.name,
                              background=self.tp is None, pin_memory=self.runner.device.type == "cuda",
                              window_layers=win_layers, window_pages=win_pages)
        log.info("L2 host pool: %d pages, %s, %s (%.2f GiB)%s in %.1f s%s", n, cache.hicache_mem_layout, enc.name,
                 host.nbytes() / 2**30, " pinned" if host.pin else "", time.perf_counter() - t0,
                 f"; host window pool: {win_pages} pages" if win_pages else "")
        if host.growing:
            log.info("L2: %d of its %d pages pinned; the rest are pinned in the background and join L2 as they are",
                     host.allocator.available, n)
        return host

    def _make_host_state_pool(self, device_slots: int) -> HostStatePool:
        """L2 state snapshots: as many slots, relative to L1's, as L2 has pages relative to L1's
        (``--hicache-ratio``, at least L1's count: a demoted snapshot needs a slot), as far as the host's
        memory holds them beside L2's KV (hicache.sizing.plan_l2_state: clamped with a warning)."""
        ratio = self.host_pool.num_pages / max(1, self.runner.pool.num_pages)
        n, warning = sizing.plan_l2_state(max(device_slots, round(device_slots * ratio)), device_slots,
                                          self.runner.state_pool.layout.bytes_per_slot(), self.host_pool.nbytes(),
                                          share=self.config.model.tp_size)
        if warning is not None:  # (a pool past the host's memory got the process killed: Qwen3.5 9B, 32 GB L2)
            log.warning("%s", warning)
        host = HostStatePool(self.runner.state_pool.layout, n, pin_memory=self.runner.device.type == "cuda")
        log.info("L2 state pool: %d slots (%.2f GiB)", n, host.nbytes() / 2**30)
        return host

    def _make_storage(self, execute: TransferSink) -> StorageController:
        cache = self.config.cache
        extra, warning = sizing.plan_l3(cache.hicache_storage_backend, cache.hicache_storage_backend_extra_config)
        if warning is not None:  # a default capacity larger than the disk has room for
            log.warning("%s", warning)
        backend = make_storage(cache.hicache_storage_backend, extra)
        layout = self.runner.pool.layout
        tier = StorageTier(backend, layout, cache.page_size, read_threads=cache.hicache_storage_read_threads,
                           encoding=cache.hicache_l3_encoding)
        if self.tp is not None:  # every rank reads and writes its part of each page
            tier = self.tp.wrap_tier(tier)
        namespace = self.kv_namespace
        log.info("L3 storage: %s, namespace %s", cache.hicache_storage_backend, namespace)
        load_policy = make_load_policy(cache.hicache_storage_load_policy, tier.codec.value_nbytes, cache.page_size)
        return StorageController(
            self.tree, self.host_pool, tier, namespace, execute, cache.hicache_storage_prefetch_policy,
            cache.hicache_storage_prefetch_threshold, cache.hicache_storage_prefetch_timeout_base,
            cache.hicache_storage_prefetch_timeout_per_ki_token, load_policy,
            cache.hicache_storage_write_queue_pages, cache.hicache_storage_write_rate_mb_s,
            backlog=lambda req: prefill_backlog(req, self.scheduler.running, self.scheduler.waiting, cache.page_size))

    # -- requests -------------------------------------------------------------------------
    def make_request(self, input_ids: list[int] | None = None, text: str | None = None,
                     sampling_params: dict[str, Any] | SamplingParams | None = None,
                     session_id: str | None = None, rid: str | None = None,
                     cache_salt: str | None = None, tenant: str | None = None) -> Req:
        """``cache_salt``: the request's effective salt (hicache.salt; None: unsalted);
        ``tenant``: who it counts against (quotas, per-tenant counters)."""
        if (input_ids is None) == (text is None):
            raise InvalidRequest("give exactly one of text or input_ids")
        if text is not None:  # only the offline Engine sends text (in its caller's thread); the server sends ids
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer; send input_ids")
            if not isinstance(text, str):
                raise InvalidRequest("text must be a string")
            input_ids = self.tokenizer.prompt_ids(self.tokenizer.encode(text))  # BOS as vLLM / SGLang add it
        check_prompt(input_ids, self.runner.arch.vocab_size, self.runner.context_len)  # scheduler/prompt_check.py
        params = sampling_params if isinstance(sampling_params, SamplingParams) else \
            SamplingParams.from_dict(sampling_params)
        if session_id is not None and session_id not in self.sessions:
            raise KeyError(f"unknown session_id {session_id!r}")
        error = salt.salt_error(cache_salt)
        if error is not None:
            raise InvalidRequest(error)
        req = Req(rid=rid or uuid.uuid4().hex, input_ids=list(input_ids), sampling=params, session_id=session_id,
                  salt_tags=salt.salt_tags(cache_salt), tenant=tenant)
        self.ledger.register(req.salt_tags, tenant)
        self.scheduler.validate(req)  # the one rule only the engine knows: it fits in the KV cache
        # size-checked here (400); parsed and compiled off this thread, within the time budget, while
        # the request waits in the queue (the scheduler admits it once its grammar is ready)
        req.grammar = self.grammar.new_state(params)
        return req

    def add(self, req: Req) -> None:
        self.scheduler.add(req)

    def set_quotas(self, quotas: dict[str, dict[str, int]]) -> None:
        """Soft per-tenant page quotas (tenant -> {"device" | "host" | "storage": pages})."""
        self.ledger.quotas = TenantLedger(self.config.cache.page_size, quotas).quotas

    def step(self) -> list[Req]:
        if self.host_pool is not None and self.host_pool.growing:  # pages pinned since the last step join L2
            self.host_pool.take_pinned()
        return self.scheduler.step()

    # -- sessions -------------------------------------------------------------------------
    @property
    def sessions(self) -> SessionTable:
        """The open sessions: the tree's table is their one owner (a request's ``session_id`` is
        checked against it; it holds each session's soft references). When a session was last
        used, and its retention hints, are the KV control's (serving/cache/kv_sessions.py)."""
        return self.tree.sessions

    def open_session(self, session_id: str | None = None) -> str:
        """Open ``session_id`` (a fresh id when None); ValueError when it is open already (as
        SGLang refuses it). The server's caps and id rules are checked before it gets here
        (serving/cache/kv_sessions.py, serving/server/session_ids.py)."""
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise ValueError(f"session_id {sid!r} is already open")
        self.tree.open_session(sid)
        return sid

    def close_session(self, session_id: str) -> None:
        if session_id not in self.sessions:
            raise KeyError(f"unknown session_id {session_id!r}")
        self.tree.close_session(session_id)

    # -- maintenance ----------------------------------------------------------------------
    def flush_cache(self, keep: Collection[int] = (), clear_storage: bool = False) -> bool:
        """Drop the cache (False while requests run or wait). ``keep``: L2 pages of the KV
        control's pin leases, whose nodes stay on L2 (``HiRadixTree.reset``). ``clear_storage``:
        L3 too, every page of this server's store (:meth:`StorageController.clear`: it waits for the
        writes in flight, an operator's call); ValueError without L3."""
        if self.scheduler.has_work:
            return False
        if clear_storage and self.storage is None:
            raise ValueError("this server has no L3 tier to clear (--hicache-storage-backend)")
        if clear_storage:
            self.storage.poll(wait=True)  # the writes in flight land first: none lands after the clear
        self.tree.reset(keep)
        if clear_storage:
            self.storage.clear()
        return True

    @property
    def storage_busy(self) -> bool:
        """L3 writes or fetches still settling (see :attr:`StorageController.busy`)."""
        return self.storage is not None and self.storage.busy

    def poll_storage(self) -> None:
        """Settle finished L3 writes and fetches without a step (the loop calls it while idle)."""
        self.scheduler.cache.poll()

    def storage_stats(self) -> dict[str, float]:
        """L3 counters (pages): hits, misses, corrupt, stored, errors ...; empty without L3."""
        return {} if self.storage is None else self.storage.stats()

    def check_integrity(self) -> None:
        host_in_use = 0
        if self.storage is not None:
            reqs = self.scheduler.waiting + self.scheduler.running
            host_in_use = self.storage.in_flight_host_pages(reqs)
            self.storage.check_integrity(reqs)
        states = self.req_cache.states  # L1 state slots: the tree's snapshots and the requests' slots
        state_in_use = states.in_use(self.scheduler.running + self.scheduler.waiting) if states else 0
        self.tree.check_integrity(device_in_use=self.scheduler.in_use_pages(), host_in_use=host_in_use,
                                  state_device_in_use=state_in_use)
        self.runner.pool.allocator.check_integrity()
        if self.runner.pool.windows is not None:  # every window page free or mapped from one L1 page
            self.runner.pool.windows.check_integrity(self.runner.pool.allocator.is_allocated)
        if self.host_pool is not None:
            self.host_pool.check_integrity()  # its allocator, and its encoded pages' scales
        if self.tp is not None:  # the other ranks ran every command and hold the same pools
            self.tp.check_integrity(self.runner.pool.num_pages, self.host_pool.num_pages if self.host_pool else 0)

    def shutdown(self, persist: bool = True) -> None:
        """Stop background work and unpin L2. With L3 and ``persist``, every cached page is
        written to L3 first, so a restarted server finds the whole conversation, not only the
        turns that were hit before. The tree and the counters stay readable; :meth:`release`
        then gives the memory back."""
        try:
            if self.storage is not None:
                if persist:
                    for r in [*self.scheduler.waiting, *self.scheduler.running]:
                        self.scheduler.abort(r.rid)  # their computed pages go into the tree
                    self.tree.backup_all()
                    self.req_cache.flush_transfers()  # runs the backups, then writes them on to L3
                    self.storage.persist_all()
                self.storage.shutdown()
            if self.controller is not None:
                self.controller.shutdown()
            self.grammar.shutdown()
        finally:
            if self.tp is not None:  # the other ranks stop whatever failed above
                self.tp.shutdown()
            if self.host_pool is not None:  # pinned pages go back to the host (nothing copies any more)
                self.host_pool.release()
            if self.host_state_pool is not None:
                self.host_state_pool.release()

    def release(self) -> None:
        """After :meth:`shutdown`: drop every reference this engine holds (the model, L1 and its
        CUDA graphs, L2, the tree, the scheduler and their caches) and hand the memory back
        (``gc.collect``, the CUDA caching allocator's free blocks), so that another engine in
        this process gets the capacity this one had. The object is unusable afterwards."""
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.release()
        self.__dict__.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
