"""Page-locks ("pins") an L2 buffer in place, in chunks, so the engine can serve while L2 grows.

A 40 GiB L2 pinned in one ``cudaHostAlloc`` (and zeroed) held start-up for 37 s. Here the buffer
is allocated pageable and pinned in place chunk by chunk (``CHUNK_MAX``): the first chunk before
the pool is used (the page-move kernel needs pinned memory from the start), the rest on a
background thread while the engine already serves. Each chunk is first touched (zeroed by
torch's threads, outside the driver) and then registered (``cudaHostRegister``): registering
pages that are not yet resident faults them in inside the driver, at ~3 GB/s, and holds the
driver's lock meanwhile, which stalls every kernel launch of the engine for as long (measured on
an H200 host: 100 ms per 256 MiB chunk, and the engine turned once per chunk); registering
resident pages runs at ~19 GB/s and stalls launches for at most ~25 ms, at p99 0.2 ms. A pool
page joins L2 once every byte of it is pinned: chunks are cut at pool-page boundaries (rounded
down to ``ALIGN``, so that no OS page belongs to two registered ranges), across every row of a
``layer_first`` buffer alike, and never outside the buffer. The buffer itself starts on an
``ALIGN`` boundary and owns whole ``ALIGN`` blocks (:func:`aligned_empty`): registering memory that
holds other objects makes CUDA call them pinned, and torch then copies them without blocking as if
they were (``pin_memory()`` returns them as they are) while Python frees and reuses them. Its
storage starts there too: torch asks whether a tensor is pinned at its storage's first byte.

On a machine without CUDA nothing is pinned; a test can still run the same growth with a hold
(``HICACHE_TEST_HOLD_L2_PIN``: while that file exists each chunk waits, and "registering" does
nothing), so the engine's handling of a growing L2 is tested on CPU.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import warnings
from collections.abc import Callable

import torch

log = logging.getLogger("hicache.host")
ALIGN = 2 << 20  # registered ranges start at multiples of this (a huge page), but the buffer's own start
CHUNK_MIN, CHUNK_MAX = 64 << 20, 256 << 20
PIN_THREADS = 1  # measured on an H200 host: more threads register no faster (the driver serializes)
HOLD_ENV = "HICACHE_TEST_HOLD_L2_PIN"
Register = Callable[[int, int], None]


def cuda_register(ptr: int, size: int) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 1 | 2))  # portable | mapped
    if err:
        raise RuntimeError(f"cudaHostRegister of {size} bytes failed with CUDA error {err}")


def cuda_unregister(ptr: int) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err:
        raise RuntimeError(f"cudaHostUnregister failed with CUDA error {err}")


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor in memory of its own (an anonymous mapping, committed as it is
    touched) whose storage starts on an ``ALIGN`` boundary and owns whole ``ALIGN`` blocks: pinning
    it in place registers no byte of any other object. The storage itself starts there, not a view
    into a larger one: torch asks CUDA whether a tensor is pinned at its storage's first byte
    (``Tensor.is_pinned``, and with it every non-blocking copy and the page-move kernel)."""
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    padded = -(-nbytes // ALIGN) * ALIGN
    region = mmap.mmap(-1, padded + ALIGN)  # anonymous, private, page-aligned; the tensor keeps it alive
    start = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % ALIGN
    with warnings.catch_warnings():  # frombuffer warns about sharing memory with a buffer: that is the point
        warnings.simplefilter("ignore")
        raw = torch.frombuffer(region, dtype=torch.uint8, offset=start, count=padded)
    return raw[:nbytes].view(dtype).view(shape)


def unregister_all(ptrs: list[int], unregister: Callable[[int], None]) -> None:
    """Unregister every range in ``ptrs``; a failure is logged, not raised (the context may be gone already,
    and with it the registration: nothing left to give back)."""
    for ptr in ptrs:
        try:
            unregister(ptr)
        except Exception as e:  # noqa: BLE001
            log.warning("unpinning failed: %s", e)


class PinnedTensors:
    """Host tensors each in memory of its own (:func:`aligned_empty`), zeroed by torch's threads and then
    page-locked whole (``cudaHostRegister``, portable | mapped) when ``pin``; plain zeros otherwise.

    Not torch's ``pin_memory=True``: its caching host allocator rounds every allocation up to a power of
    two and keeps it pinned after the tensor is freed (measured on the H200 host: Qwen3.5's 28 GB L2 state
    pool, 48 tensors of 1.15 GB, pinned 48 GiB, and a restarted engine beside it was killed for memory).

    Contract: :meth:`zeros` and :meth:`close` are the owner's (one thread at a time); :meth:`close`
    unregisters every tensor made so far (idempotent) and must run before they are freed: owners call it
    from their ``release`` and from a ``weakref.finalize`` on themselves (run before their attributes go).
    """

    def __init__(self, pin: bool, register: Register | None = None,
                 unregister: Callable[[int], None] | None = None) -> None:
        """``register`` / ``unregister``: CUDA's by default (a test passes its own)."""
        self.pin = pin
        self._register = register or cuda_register
        self._unregister = unregister or cuda_unregister
        self._registered: list[int] = []

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if not self.pin:
            return torch.zeros(shape, dtype=dtype)
        t = aligned_empty(shape, dtype)
        nbytes = t.numel() * t.element_size()
        if nbytes:
            t.zero_()  # fault the pages in outside the driver (registering absent pages is ~6x slower)
            self._register(t.data_ptr(), -(-nbytes // ALIGN) * ALIGN)  # whole ALIGN blocks, all the tensor's own
            self._registered.append(t.data_ptr())
        return t

    def close(self) -> None:
        ptrs, self._registered = self._registered, []
        unregister_all(ptrs, self._unregister)


def no_register(ptr: int, size: int) -> None:
    """Stands in for cudaHostRegister where nothing is pinned (the CPU test hold)."""


class HostPinner:
    """Pins ``buffer`` (``rows`` x ``num_pages`` pool pages of ``page_bytes`` each, row-major) in chunks.

    Concurrency contract:
    - The pinning threads (``start``) register disjoint byte ranges and record finished chunks
      under ``_lock``; nothing else writes that state.
    - ``ready_pages()`` (any thread) is how many leading pool pages lie wholly in pinned memory;
      the pool's owner hands a page out only below it (HostKVPool.take_pinned, scheduler thread).
    - ``close()`` (the owner, once) stops the threads after their chunk in progress, waits for
      them, then unregisters every registered range; the buffer may be freed after it returns.
    """

    def __init__(self, buffer: torch.Tensor, rows: int, num_pages: int, register: Register = cuda_register,
                 unregister: Callable[[int], None] = cuda_unregister, threads: int = PIN_THREADS,
                 hold: str | None = None) -> None:
        """``hold``: a file path; while it exists the background chunks wait (tests)."""
        self.buffer, self.rows, self.num_pages = buffer, rows, num_pages
        self.total = buffer.numel() * buffer.element_size()
        self.page_bytes = self.total // (rows * num_pages)  # one page of one row
        self._register, self._unregister, self._threads_n, self._hold = register, unregister, threads, hold
        chunk = min(CHUNK_MAX, max(CHUNK_MIN, self.total // 16, 4 * ALIGN * rows))
        self.chunk_pages = max(1, min(num_pages, chunk // (rows * self.page_bytes)))
        self.num_chunks = -(-num_pages // self.chunk_pages)
        self._lock = threading.Lock()
        self._done = [False] * self.num_chunks
        self._prefix = 0  # chunks 0 .. _prefix-1 are all registered
        self._logged = 0  # quarters of the buffer reported pinned so far
        self._registered: list[int] = []  # base pointers of registered ranges
        self._next = 0
        self._stop = False
        self._threads: list[threading.Thread] = []
        self.error: BaseException | None = None
        self.started_at = time.monotonic()

    # -- geometry ---------------------------------------------------------------------
    def _cut(self, row: int, page: int) -> int:
        """Where a registered range starts or ends: an ``ALIGN`` multiple, kept inside the buffer.
        A cut rounded down past the buffer's start would register the memory below it: other
        objects' bytes, which CUDA then reports as pinned (torch's ``pin_memory()`` returns such a
        tensor itself, so its non-blocking copy reads memory that is freed and reused meanwhile)."""
        base = self.buffer.data_ptr()
        if row == 0 and page == 0:
            return base
        if row == self.rows - 1 and page == self.num_pages:
            return base + self.total
        cut = (base + (row * self.num_pages + page) * self.page_bytes) // ALIGN * ALIGN
        return min(base + self.total, max(base, cut))

    def _pieces(self, k: int) -> list[tuple[int, int]]:
        lo, hi = k * self.chunk_pages, min(self.num_pages, (k + 1) * self.chunk_pages)
        out = []
        for r in range(self.rows):
            a, b = self._cut(r, lo), self._cut(r, hi)
            if b > a:
                out.append((a, b - a))
        return out

    def ready_pages(self) -> int:
        """Leading pool pages whose bytes are all pinned (all of them once every chunk is)."""
        with self._lock:
            k = self._prefix
        if k >= self.num_chunks:
            return self.num_pages
        slack = -(-ALIGN // self.page_bytes)  # the last pages of a chunk may share an OS page with the next
        return max(0, k * self.chunk_pages - slack)

    @property
    def done(self) -> bool:
        with self._lock:
            return self._prefix >= self.num_chunks

    # -- pinning ----------------------------------------------------------------------
    def _pin_chunk(self, k: int) -> None:
        flat = self.buffer.reshape(-1).view(torch.uint8)
        base = self.buffer.data_ptr()
        for ptr, size in self._pieces(k):
            flat[ptr - base:ptr - base + size].zero_()  # resident before the driver locks it (see above)
            self._register(ptr, size)
            with self._lock:
                self._registered.append(ptr)
        with self._lock:
            self._done[k] = True
            while self._prefix < self.num_chunks and self._done[self._prefix]:
                self._prefix += 1
            quarter = 4 * self._prefix // self.num_chunks
            report, self._logged = quarter > self._logged and self.num_chunks > 1, max(quarter, self._logged)
        if report:
            log.info("L2: %d%% of %.1f GiB pinned (%.1f s)", 25 * quarter, self.total / 2**30,
                     time.monotonic() - self.started_at)

    def _work(self) -> None:
        while True:
            with self._lock:
                if self._stop or self._next >= self.num_chunks:
                    return
                k, self._next = self._next, self._next + 1
            while self._hold is not None and os.path.exists(self._hold) and not self._stop:
                time.sleep(0.01)
            try:
                self._pin_chunk(k)
            except BaseException as e:  # e.g. the host ran out of lockable memory: L2 stays as far as it got
                with self._lock:
                    self.error, self._stop = e, True
                log.error("L2: pinning stopped at chunk %d of %d: %s; L2 keeps the pages pinned so far",
                          k, self.num_chunks, e)
                return

    def start(self, background: bool) -> None:
        """Pin the first chunk now; the rest on threads, waited for unless ``background``."""
        self._next = 1
        self._pin_chunk(0)
        self._threads = [threading.Thread(target=self._work, name=f"hicache-l2-pin-{i}", daemon=True)
                         for i in range(min(self._threads_n, self.num_chunks - 1))]
        for t in self._threads:
            t.start()
        if not background:
            self.join()

    def join(self) -> None:
        for t in self._threads:
            t.join()

    def close(self) -> None:
        with self._lock:
            self._stop = True
        self.join()
        with self._lock:
            ptrs, self._registered = self._registered, []
        unregister_all(ptrs, self._unregister)
