"""Owns the model, its L1 KV pool and the attention backend; runs forward passes."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TypeVar

import torch

from hicache import sizing
from hicache.tiers.device import DeviceKVPool, KVLayout
from hicache.tiers.kv_codec import round_trip_encoding
from hicache.tiers.state_pool import DeviceStatePool, verify_scratch_slots
from hicache.tiers.window_pages import min_window_pages
from serving.config import ModelConfig, SchedulerConfig
from serving.kernels import cpu_ext
from serving.kernels.attention import get_attention_backend
from serving.models.loader import load_model
from serving.models.state_graph import ExtendStatePlan
from serving.models.state_kernels import backend_for
from serving.models.state_scan import StatePlan
from serving.parallel.group import TPGroup
from serving.runner.cuda_graph import CudaGraphRunner, capture_sizes
from serving.runner.cuda_graph_extend import ExtendGraphRunner, extend_buckets, extend_token_budget
from serving.startup_log import timed
from serving.structs.forward_batch import ForwardBatch

log = logging.getLogger(__name__)
R = TypeVar("R")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn}  # --kv-cache-dtype (auto: the model's dtype)
CPU_DEFAULT_KV_TOKENS = 16384


STATE_FLOOR_BYTES = 256 * 2**20  # the default state slots may always take this much (tiny models: every slot)


def state_slots_for(max_running_requests: int, slot_bytes: int = 0, kv_bytes: int = 0, ratio: float = 0.0) -> int:
    """The default L1 state slots of a model with state layers: three for every running request (its
    working slot and two captures, serving/cache/request_states.py), as many again for the tree's
    snapshots, and a few spare; with ``slot_bytes``, at most what fits in ``ratio`` x ``kv_bytes`` (L1's
    KV bytes; --mamba-full-memory-ratio) or STATE_FLOOR_BYTES, whichever is more, and never fewer than
    4 (one request's 3 and a snapshot)."""
    slots = 4 * max_running_requests + 8
    if slot_bytes <= 0:
        return slots
    fit = int(max(ratio * kv_bytes, STATE_FLOOR_BYTES)) // slot_bytes
    return min(slots, max(fit, 4))


def swa_layers(layers: int, window_layers: int, sched: SchedulerConfig) -> float:
    """How many layers' KV a logical token takes in a hybrid SWA pool: its full layers, and
    --swa-full-tokens-ratio of each window layer (the window pool's share)."""
    return (layers - window_layers) + sched.swa_full_tokens_ratio * window_layers


def swa_pages(num_pages: int, layers: int, window_layers: int, sched: SchedulerConfig,
              page_size: int) -> tuple[int, int]:
    """(logical pages, window pages) of a hybrid SWA pool with ``num_pages`` pages' worth of every layer:
    --max-total-tokens sets the logical pages (the full layers' tokens), the window pool gets
    --swa-full-tokens-ratio of them; else the same bytes are split so (SGLang's sizing)."""
    r = sched.swa_full_tokens_ratio
    if sched.max_total_tokens is not None:
        logical = num_pages
    else:
        logical = max(1, int(num_pages * layers / swa_layers(layers, window_layers, sched)))
    return logical, max(1, math.ceil(logical * r - 1e-9))


def swa_bytes_per_token(per_token: int, layers: int, window_layers: int, sched: SchedulerConfig) -> int:
    """Bytes of L1 a logical token takes in a hybrid SWA pool: every full layer's KV, and
    --swa-full-tokens-ratio of a window layer's (the window pool's share), out of ``per_token`` (every
    layer's). What --max-total-tokens (the full layers' tokens, as SGLang counts them) asks of the GPU."""
    if not window_layers:
        return per_token
    return max(1, math.ceil(per_token * (swa_layers(layers, window_layers, sched) / layers)))


def check_window_pool(win_pages: int, window: int, page_size: int, sched: SchedulerConfig) -> None:
    """A window pool smaller than one request needs would leave every request waiting for window pages
    for ever: refused, with the sizes and the flags that change them."""
    need = min_window_pages(window, page_size)
    if win_pages < need:
        raise sizing.TierSizeError(
            f"L1 window pool: {win_pages} pages of {page_size} tokens (--swa-full-tokens-ratio "
            f"{sched.swa_full_tokens_ratio} of L1's pages) hold less than one request needs: {need} pages (the two "
            f"windows of {window} tokens it keeps and the page it computes into); raise --swa-full-tokens-ratio or "
            "--max-total-tokens, or keep one pool (--disable-hybrid-swa-memory)")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, attention_backend: str) -> torch.dtype:
    """L1's KV dtype (every backend stores into it, saturating for fp8, and upcasts what it reads)."""
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class ModelRunner:
    """One rank's model shard, L1 pool and attention backend. Under tensor parallelism (``tp``)
    every rank builds one; the L1 page count is the smallest any rank can hold, so page ids mean
    the same pages on every rank."""

    def __init__(self, model: ModelConfig, sched: SchedulerConfig, page_size: int,
                 tp: TPGroup | None = None, kv_round_trip: str = "raw") -> None:
        """``kv_round_trip``: the lossy lower-tier encoding (hicache.tiers.kv_codec) whose round
        trip K and V take before they are stored in L1; ``raw``: none."""
        self.tp = tp or TPGroup()
        self.device = resolve_device(model.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # streams, graphs and Triton launches follow the current device
        self.dtype = resolve_dtype(model.dtype, self.device)
        torch.manual_seed(model.random_seed)
        with timed(f"loading the weights of {model.model_path} ({str(self.dtype).removeprefix('torch.')}, "
                   f"{self.device}, {model.load_format}, quantization {model.quantization})"):
            self.model, self.arch = load_model(
                model.model_path, dtype=self.dtype, device=self.device, load_format=model.load_format, tp=tp,
                quantization=model.quantization)
        self.model.eval()
        backend = model.attention_backend
        if self.arch.is_mla:  # MLA's attention over the latent is torch code (serving/models/mla.py)
            if backend not in ("auto", "torch"):
                raise ValueError(f"--attention-backend {backend}: a multi-head latent attention model "
                                 f"({self.arch.architectures[0]}) runs the torch backend only for now; "
                                 "use --attention-backend torch (or auto)")
            backend = "torch"
        elif backend == "auto" and self.device.type != "cuda":
            with timed("building / loading the C++ CPU kernels"):
                backend = "cpu" if cpu_ext.extension() else "torch"
        elif backend == "auto":
            backend = "triton"
        self.attn = get_attention_backend(backend)
        self.kv_dtype = resolve_kv_dtype(model.kv_cache_dtype, self.dtype, backend)
        self.context_len = model.context_length or self.arch.max_position_embeddings
        self.kv_heads = self.model.plan.num_kv_heads  # this rank's (all of them without TP)
        self.layer_stack = self.model.layer_stack  # L1 holds KV for its KV layers (full and sliding) only
        layout = self.arch.kv_layout(self.kv_dtype, len(self.layer_stack.kv_layers), self.kv_heads)  # MLA: the latent
        enc = round_trip_encoding(self.kv_dtype, kv_round_trip, "raw")
        self.attn.kv_round_trip = enc.round_trip if enc.lossy else None
        # L1 for the state layers' recurrent state (before the KV pages: a GPU budget counts it as used)
        self.state_pool: DeviceStatePool | None = None
        if self.layer_stack.state_layers:
            state_layout = self.model.state_layout(self.dtype)
            slot_bytes = state_layout.bytes_per_slot()
            slots = self._min_over_ranks(self._state_slots(slot_bytes, layout.bytes_per_token(), sched))
            # speculative decoding: scratch for the states after each draft (serving/cache/request_states.py)
            scratch = verify_scratch_slots(sched.speculative_algorithm and sched.speculative_num_draft_tokens,
                                           sched.max_running_requests)
            self.state_pool = DeviceStatePool(state_layout, slots, self.device, scratch)
            log.info("L1 state pool: %d slots x %d state layers (%.2f MiB a slot, %.2f GiB)", slots,
                     len(self.layer_stack.state_layers), self.state_pool.bytes_per_slot / 2**20,
                     self.state_pool.nbytes() / 2**30)
        win_layers = self._window_layers(sched)
        num_pages = self._min_over_ranks(self._num_pages(layout, sched, page_size, len(win_layers)))
        win_pages = 0
        if win_layers:
            num_pages, win_pages = swa_pages(num_pages, layout.num_layers, len(win_layers), sched, page_size)
            check_window_pool(win_pages, max(w for w in self.layer_stack.windows if w is not None), page_size, sched)
        self.pool = DeviceKVPool(layout, num_pages, page_size, self.device, win_layers, win_pages)
        log.info("L1 KV pool: %d pages x %d tokens (%.2f GiB)%s", num_pages, page_size, self.pool.nbytes() / 2**30,
                 f"; the {len(win_layers)} sliding layers' window pool: {win_pages} pages "
                 f"(--swa-full-tokens-ratio {sched.swa_full_tokens_ratio})" if win_layers else "")
        self.graphs: CudaGraphRunner | None = None
        self.extend_graphs: ExtendGraphRunner | None = None
        syncing = sorted({type(m).__name__ for m in self.model.modules() if getattr(m, "syncs_host", False)})
        if syncing and self.device.type == "cuda" and not model.disable_cuda_graph:
            log.info("CUDA graphs: off (%s read values back to the host in every forward)", ", ".join(syncing))
        elif self.device.type == "cuda" and backend == "triton" and not model.disable_cuda_graph:
            with timed("capturing CUDA graphs"):
                self.graphs = self._decode_graphs(capture_sizes(model.cuda_graph_max_bs, sched.max_running_requests))
                if not model.disable_extend_cuda_graph and self._state_extend_graphs_ok():
                    max_seqs = min(model.cuda_graph_max_bs, sched.max_running_requests)
                    budget = extend_token_budget(model.cuda_graph_max_extend_tokens, self.layer_stack)
                    buckets = extend_buckets(budget, max_seqs)
                    # speculative verification asks for every position's logits: small buckets get graphs for that too
                    rows = [(t, s) for t, s in buckets if t <= 128 and s <= 16] if sched.speculative_algorithm else []
                    self.extend_graphs = self._extend_graphs(buckets, rows)

    def _capture(self, make: Callable[[], R], what: str) -> R | None:
        """``make()``: graphs captured. A model with state layers whose graphs fail to capture (their state
        plans on static buffers have not all run on a GPU) runs ``what`` eagerly, with a warning."""
        if self.state_pool is None:
            return make()
        try:
            return make()
        except RuntimeError as e:
            log.warning("CUDA graphs for a model with state layers did not capture (%s: %s): %s runs eagerly",
                        type(e).__name__, str(e)[:300], what)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return None

    def _decode_graphs(self, sizes: list[int]) -> CudaGraphRunner | None:
        """The decode graphs (a state model's may fall back to eager decode: :meth:`_capture`)."""
        return self._capture(lambda: self.make_graph_runner(sizes), "decode")

    def _state_extend_graphs_ok(self) -> bool:
        """Extend graphs for this model: any without state layers; with them only on fla-core's kernels (the
        torch scan cuts its steps on the host, serving/models/state_kernels.py)."""
        return self.state_pool is None or backend_for(torch.empty(0, device=self.device)) == "fla"

    def _extend_graphs(self, buckets: list[tuple[int, int]], rows: list[tuple[int, int]]) -> ExtendGraphRunner | None:
        """The extend graphs (a state model's may fall back to eager extends: :meth:`_capture`)."""
        return self._capture(lambda: self.make_extend_graph_runner(buckets, row_buckets=rows), "extend")

    def _window_layers(self, sched: SchedulerConfig) -> tuple[int, ...]:
        """The KV layers that go to a window pool (hicache/tiers/window_pages.py): the sliding ones with
        --enable-hybrid-swa-memory, unless --disable-hybrid-swa-memory. Under tensor parallelism every rank
        has one (rank 0 sends its window map: serving/parallel/window_map.py). On CUDA too: the graphs have
        a static window view and the page mover moves window pages. Opt-in for now (docs/models.md says why)."""
        if not sched.enable_hybrid_swa_memory or sched.disable_hybrid_swa_memory:
            return ()
        return tuple(j for j, w in enumerate(self.layer_stack.windows) if w is not None)

    def make_graph_runner(self, sizes: list[int], capture: bool = True) -> CudaGraphRunner:
        """Static decode buffers (and, with ``capture``, CUDA graphs) for batch sizes ``sizes``."""
        make_plan, scratch = None, -1
        if self.state_pool is not None:  # the state layers' plan on the graphs' static slot buffers
            width = self.model.conv_kernel

            def make_plan(slots: torch.Tensor, snaps: torch.Tensor) -> StatePlan:
                return StatePlan.for_decode(slots, snaps, width)
            scratch = self.state_pool.pad_slot
        runner = CudaGraphRunner(
            self._forward_eager, sizes, self.context_len, self.pool.page_size, self.kv_heads,
            self.device, capture=capture, make_state_plan=make_plan, pad_slot=scratch,
            windows=self.pool.windows is not None)
        rotary = getattr(self.model, "rotary", None)
        if rotary is not None:  # the graphs read these cos/sin tables: keep them even if regrown
            runner.keep_alive = rotary.built_tables()
        return runner

    def make_extend_graph_runner(self, buckets: list[tuple[int, int]], capture: bool = True,
                                 row_buckets: list[tuple[int, int]] = ()) -> ExtendGraphRunner:
        """Static extend buffers (and, with ``capture``, CUDA graphs) for (tokens, sequences) ``buckets``
        (``row_buckets``: also for batches asking the logits of every position, see ExtendGraphRunner)."""
        make_plan = None
        if self.state_pool is not None:  # each bucket's state plan on static buffers, padding on the scratch row
            width, scratch = self.model.conv_kernel, self.state_pool.pad_slot

            def make_plan(t: int, s: int) -> ExtendStatePlan:
                return ExtendStatePlan(t, s, width, scratch, self.device)
        runner = ExtendGraphRunner(
            self._forward_eager, buckets, self.context_len, self.pool.page_size, len(self.layer_stack.kv_layers),
            self.device, capture=capture, row_buckets=row_buckets, windows=self.pool.windows is not None,
            make_state_plan=make_plan)
        rotary = getattr(self.model, "rotary", None)
        if rotary is not None:  # the graphs read these cos/sin tables (built by the capture): keep them
            runner.keep_alive = rotary.built_tables()
        return runner

    def _min_over_ranks(self, n: int) -> int:
        """The smallest ``n`` of any tensor-parallel rank (pages, state slots: their ids mean the same everywhere)."""
        if not self.tp.is_parallel:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp.group)
        return int(t.item())

    def _state_slots(self, slot_bytes: int, per_token: int, sched: SchedulerConfig) -> int:
        """L1 state slots: --max-mamba-cache-size, else :func:`state_slots_for`; on CUDA with L1 sized by
        the GPU's budget, at most the share ``r / (1 + r)`` of that budget (``r``: --mamba-full-memory-ratio,
        the state's bytes against the KV cache's), so the KV pages keep the rest; else at most ``r`` x the
        KV bytes L1 is asked for (--max-total-tokens, --kv-cache-gb, the CPU default)."""
        if sched.max_mamba_cache_size is not None:
            return sched.max_mamba_cache_size
        if self.device.type != "cuda" or sched.max_total_tokens is not None or sched.kv_cache_gb is not None:
            kv_bytes = sizing.l1_request(sched.max_total_tokens, sched.kv_cache_gb, per_token,
                                         CPU_DEFAULT_KV_TOKENS * per_token, "").nbytes
            return state_slots_for(sched.max_running_requests, slot_bytes, kv_bytes, sched.mamba_full_memory_ratio)
        slots = state_slots_for(sched.max_running_requests)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = max(0, int(free - total * (1 - sched.mem_fraction_static)))
        ratio = sched.mamba_full_memory_ratio
        fit = int(budget * ratio / (1 + ratio)) // max(1, slot_bytes)
        if fit < 4:
            raise sizing.TierSizeError(
                f"L1 state pool: {fit} state slots of {slot_bytes / 2**20:.1f} MiB fit the GPU's budget "
                f"({sizing.gpu_budget_text(free, total, sched.mem_fraction_static)}); a running request needs 3 "
                "and a cached snapshot 1: raise --mem-fraction-static or --mamba-full-memory-ratio")
        return min(slots, fit)

    def _num_pages(self, layout: KVLayout, sched: SchedulerConfig, page_size: int, window_layers: int) -> int:
        """L1's pages (hicache.sizing decides): --max-total-tokens / --kv-cache-gb when given (a
        TierSizeError when the device has less; with a window pool, --max-total-tokens costs each token
        its full layers' KV and the pool's share of its window layers': :func:`swa_bytes_per_token`),
        else the GPU's budget (CPU: CPU_DEFAULT_KV_TOKENS, clamped, with a warning, to what the host has)."""
        per_token = layout.bytes_per_token()
        asked_per_token = swa_bytes_per_token(per_token, layout.num_layers, window_layers, sched)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - sched.mem_fraction_static))
            text = sizing.gpu_budget_text(free, total, sched.mem_fraction_static)
            default, what = budget, "the GPU's budget for the KV cache"
        else:
            mem = sizing.HostMemory.probe()
            budget, text = mem.budget(share=self.tp.size), mem.explain(share=self.tp.size)
            default = CPU_DEFAULT_KV_TOKENS * per_token
            what = f"the CPU default of {CPU_DEFAULT_KV_TOKENS} tokens ({sizing.gib(default)})"
        req = sizing.l1_request(sched.max_total_tokens, sched.kv_cache_gb, asked_per_token, default, what)
        nbytes, warning = sizing.fit("L1", req, budget, text, minimum=sizing.L1_MIN_TOKENS * per_token)
        if warning is not None:
            log.warning("%s", warning)
        if sched.max_total_tokens is not None:
            return max(1, -(-sched.max_total_tokens // page_size))
        return max(1, nbytes // (per_token * page_size))

    def release(self) -> None:
        """Shutdown: drop the CUDA graphs, the model and L1's buffers (their memory goes back once
        nothing else holds them; EngineCore.release collects and empties the CUDA cache)."""
        self.graphs = self.extend_graphs = None
        self.model = None  # type: ignore[assignment]
        self.pool.kv_buffer = torch.empty(0, dtype=self.kv_dtype, device=self.device)
        self.pool.win_buffer = None
        self.pool.k_buffers, self.pool.v_buffers = [], []
        if self.state_pool is not None:
            self.state_pool.release()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """``[B, vocab]`` float32 logits. Decode and small extend batches replay a CUDA graph when
        one fits (the result is then the graph's output buffer, valid until the next forward)."""
        if self.graphs is not None and self.graphs.can_run(batch):
            if batch.layer_waits is not None:
                batch.layer_waits.before_all()
            return self.graphs.run(batch)
        if self.extend_graphs is not None and self.extend_graphs.can_run(batch):
            return self.extend_graphs.run(batch)  # waits per layer inside the replay
        return self._forward_eager(batch)

    def _forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        if self.state_pool is not None:  # state layers: the batch's state_slots index this pool
            return self.model.forward(batch, self.pool, self.attn, self.state_pool)
        return self.model.forward(batch, self.pool, self.attn)
