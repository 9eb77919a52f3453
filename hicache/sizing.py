"""Tier budgets from the machine's facts: the one owner of how big L1, L2 and L3 may be.

Facts: host memory (``MemAvailable`` / ``MemTotal`` from /proc/meminfo, lowered to what the
process's cgroup still allows), the free space of a directory's file system
(``shutil.disk_usage`` of its nearest existing ancestor) and, for a CUDA L1, what the engine
measured on its GPU (passed in). Tests stand in for the host through the environment, read at
each probe: ``HICACHE_TEST_MEM_TOTAL_GB``, ``HICACHE_TEST_MEM_AVAILABLE_GB``,
``HICACHE_TEST_DISK_FREE_GB`` (GiB; unset in production).

The rule, for every tier: a size the user gave in bytes or tokens (``--hicache-size``,
``--max-total-tokens``, ``--kv-cache-gb``, ``capacity_gb`` in
``--hicache-storage-backend-extra-config``) that does not fit is a :class:`TierSizeError`, one
line naming the number, what is available and the flag. A derived size (``hicache_ratio`` x L1,
the L2 that L3 implies, the CPU L1 default, LMDB's default capacity) that does not fit is
clamped to what is, with a warning that says so and names the flag that chooses it.

The host keeps headroom for the process (Python, the tokenizer, CUDA's context, staging
buffers): ``max(2 GiB, 10%)`` of its memory is never given to a tier. Torch-free: the launcher's
pre-flight (serving/server/preflight.py) and the engine use the same functions.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GiB = 1 << 30
HEADROOM_MIN = 2 * GiB
HEADROOM_FRACTION = 0.10
L1_MIN_TOKENS = 1024  # a derived L1 smaller than this is an error, not a server
MEM_TOTAL_ENV = "HICACHE_TEST_MEM_TOTAL_GB"
MEM_AVAILABLE_ENV = "HICACHE_TEST_MEM_AVAILABLE_GB"
DISK_FREE_ENV = "HICACHE_TEST_DISK_FREE_GB"
_UNLIMITED = 1 << 60
_DISK_TIERS = {"lmdb": ("path", "capacity_gb", 64.0)}  # backend -> (dir key, size key, default GiB)
L3_DISK_HEADROOM = 0.1  # of a disk's free space that a derived (not explicit) L3 capacity leaves alone


class TierSizeError(ValueError):
    """A tier asked for more than the machine has; the message is one line (number, what is
    available, the flag to change)."""


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if abs(n) >= GiB else f"{n / 2**20:.0f} MiB"


def _env_gib(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    return None if not value else int(float(value) * GiB)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text) if text.isdigit() else None


def _cgroup_room() -> tuple[int, int] | None:
    """(limit, room left) of this process's memory cgroup (v2, else v1); None when unlimited."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    paths = {}
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        paths[controllers] = rel
    candidates = []
    if "" in paths:  # v2: memory.max, memory.current, reclaimable file pages in memory.stat
        candidates += [(Path("/sys/fs/cgroup") / paths[""].lstrip("/"), "memory.max", "memory.current")]
    for key, rel in paths.items():
        if "memory" in key.split(","):
            base = Path("/sys/fs/cgroup/memory")
            candidates += [(base / rel.lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes"),
                           (base, "memory.limit_in_bytes", "memory.usage_in_bytes")]
    for base, limit_name, usage_name in candidates:
        limit, usage = _read_int(base / limit_name), _read_int(base / usage_name)
        if limit is None or usage is None:
            continue
        if limit >= _UNLIMITED:
            return None
        return limit, max(0, limit - usage + _inactive_file(base / "memory.stat"))
    return None


def _inactive_file(stat: Path) -> int:
    try:
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file"):
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


@dataclass(frozen=True)
class HostMemory:
    """What the host can give the tiers that live in its memory (L2; L1 on a CPU engine)."""

    total: int
    available: int
    source: str  # what ``available`` is: MemAvailable, the cgroup's room, or a test's variable

    @classmethod
    def probe(cls, environ: Mapping[str, str] = os.environ) -> HostMemory:
        total, avail = _env_gib(environ, MEM_TOTAL_ENV), _env_gib(environ, MEM_AVAILABLE_ENV)
        if total is not None or avail is not None:
            total = total if total is not None else avail
            return cls(total, avail if avail is not None else total, MEM_AVAILABLE_ENV)
        info = {}
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        avail, source = info.get("MemAvailable", total), "MemAvailable"
        room = _cgroup_room()
        if room is not None and room[1] < avail:
            total, avail, source = min(total, room[0]), room[1], "the cgroup's memory limit less its usage"
        return cls(total, avail, source)

    @property
    def headroom(self) -> int:
        return max(HEADROOM_MIN, int(HEADROOM_FRACTION * self.total))

    def budget(self, share: int = 1) -> int:
        """Bytes a tier may take: what is available less the headroom, split over ``share``
        processes (tensor-parallel ranks, each with its own)."""
        return max(0, (self.available - self.headroom) // max(1, share))

    def explain(self, share: int = 1) -> str:
        text = f"the host has {gib(self.budget(share))} for it ({self.source} {gib(self.available)} " \
               f"less {gib(self.headroom)} headroom for the process"
        return text + (f", split over {share} ranks)" if share > 1 else ")")


@dataclass(frozen=True)
class SizeRequest:
    """What a tier asks for: ``explicit`` sizes fail when they do not fit, derived ones clamp."""

    nbytes: int
    explicit: bool
    asked: str  # e.g. "--hicache-size 400 GiB", "hicache_ratio 2 x L1 (103.0 GiB) = 206.0 GiB"
    flag: str  # the flag that sets it


def fit(tier: str, req: SizeRequest, budget: int, budget_text: str, minimum: int = 1) -> tuple[int, str | None]:
    """(bytes the tier gets, the warning to log when it was clamped). TierSizeError for an
    explicit request that does not fit, or for a derived one when not even ``minimum`` bytes are."""
    if req.explicit and req.nbytes > budget:
        raise TierSizeError(f"{tier}: {req.asked} does not fit: {budget_text}; lower {req.flag}")
    if req.explicit or minimum <= req.nbytes <= budget:
        return req.nbytes, None
    if min(req.nbytes, budget) < minimum:
        raise TierSizeError(f"{tier}: not even {gib(minimum)} is available: {budget_text}; free memory, "
                            f"or set {req.flag}")
    return budget, (f"{tier}: {req.asked} does not fit: {budget_text}; clamped to {gib(budget)} "
                    f"(set {req.flag} to choose the size)")


# -- L1 ---------------------------------------------------------------------------------------
def l1_request(max_total_tokens: int | None, kv_cache_gb: float | None, bytes_per_token: int,
               default_bytes: int, default_what: str) -> SizeRequest:
    """L1's size: the tokens or GiB asked for, else ``default_bytes`` (derived; ``default_what`` says
    what it is)."""
    if max_total_tokens is not None:
        return SizeRequest(max_total_tokens * bytes_per_token, True,
                           f"--max-total-tokens {max_total_tokens} ({gib(max_total_tokens * bytes_per_token)} of KV)",
                           "--max-total-tokens")
    if kv_cache_gb is not None:
        return SizeRequest(int(kv_cache_gb * GiB), True, f"--kv-cache-gb {kv_cache_gb:g}", "--kv-cache-gb")
    return SizeRequest(default_bytes, False, default_what, "--max-total-tokens")


def gpu_budget_text(free: int, total: int, fraction: float) -> str:
    budget = int(free - total * (1 - fraction))
    return (f"the GPU has {gib(max(budget, 0))} for the KV cache ({gib(free)} free after the weights, less the "
            f"{1 - fraction:.0%} of its {gib(total)} that --mem-fraction-static {fraction:g} keeps)")


# -- L2 ---------------------------------------------------------------------------------------
def l2_request(hicache_ratio: float, hicache_size: float, effective_ratio: float, l1_bytes: int) -> SizeRequest:
    """L2's size: ``--hicache-size`` GiB (explicit), else ``ratio`` x L1's bytes (derived; with
    neither given, the ratio of 2 that L3 implies)."""
    if hicache_size > 0:
        return SizeRequest(int(hicache_size * GiB), True, f"--hicache-size {hicache_size:g} GiB", "--hicache-size")
    why = f"hicache_ratio {effective_ratio:g}" if hicache_ratio > 0 else f"the L2 that L3 needs ({effective_ratio:g}"
    why += " x L1" if hicache_ratio > 0 else " x L1)"
    nbytes = int(effective_ratio * l1_bytes)
    return SizeRequest(nbytes, False, f"{why} = {gib(nbytes)}", "--hicache-size")


def plan_l2(hicache_ratio: float, hicache_size: float, effective_ratio: float, l1_bytes: int,
            min_bytes: int, share: int = 1, mem: HostMemory | None = None) -> tuple[int, str | None]:
    """(L2 bytes, the clamp warning or None) against the host's memory (see the module docstring).
    Read when L2 is allocated: L1 and the weights, when on the host, are already in it."""
    mem = mem or HostMemory.probe()
    req = l2_request(hicache_ratio, hicache_size, effective_ratio, l1_bytes)
    return fit("L2", req, mem.budget(share), mem.explain(share), min_bytes)


def plan_l2_state(slots: int, min_slots: int, slot_bytes: int, l2_kv_bytes: int, share: int = 1,
                  mem: HostMemory | None = None) -> tuple[int, str | None]:
    """(L2 state slots, the clamp warning or None): ``slots`` (derived from L2's page ratio) as far as they fit
    beside L2's ``l2_kv_bytes`` in the host's memory (L2's pages are committed as they are pinned or
    touched, so they are counted as taken); fewer than ``min_slots`` (one per L1 state slot: a demoted
    snapshot needs one) is a TierSizeError."""
    mem = mem or HostMemory.probe()
    room = max(0, mem.budget(share) - l2_kv_bytes)
    fits = room // max(1, slot_bytes)
    if fits >= slots:
        return slots, None
    what = f"{gib(slot_bytes)} each beside L2's {gib(l2_kv_bytes)} of KV: {mem.explain(share)}"
    if fits < min_slots:
        raise TierSizeError(f"L2 state pool: {min_slots} slots (one per L1 state slot) of {what}; lower "
                            "--hicache-size / --hicache-ratio or --max-mamba-cache-size")
    return fits, (f"L2 state pool: {slots} slots of {what}; clamped to {fits} (lower --hicache-size / "
                  "--hicache-ratio to keep more L2 room for state)")


# -- L3 ---------------------------------------------------------------------------------------
def disk_free(path: str | os.PathLike[str], environ: Mapping[str, str] = os.environ) -> int:
    """Free bytes on the file system that holds ``path`` (or would: its nearest existing ancestor)."""
    forced = _env_gib(environ, DISK_FREE_ENV)
    if forced is not None:
        return forced
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _allocated(path: Path) -> int:
    """The bytes a store's files take on disk, its shard folders' (``shard-N``, a sharded LMDB) too."""
    try:
        return sum(f.stat().st_blocks * 512 if f.is_file() else _allocated(f) if f.is_dir() else 0
                   for f in path.iterdir())
    except OSError:
        return 0


def plan_l3(backend: str | None, extra: Mapping[str, Any],
            environ: Mapping[str, str] = os.environ) -> tuple[dict[str, Any], str | None]:
    """(the backend's options, with a derived capacity clamped to the disk; the warning or None).
    Only disk-backed stores (LMDB) are sized here; what the store holds already counts as its own."""
    out = dict(extra)
    spec = _DISK_TIERS.get(backend or "")
    if spec is None or not isinstance(out.get(spec[0]), str):
        return out, None
    dir_key, size_key, default_gb = spec
    explicit = size_key in out
    capacity = float(out.get(size_key, default_gb))
    directory = Path(out[dir_key])
    held = _allocated(directory) if directory.is_dir() else 0
    free = disk_free(directory, environ)
    # a derived size leaves L3_DISK_HEADROOM of the free space to everything else on the disk (an
    # LMDB store grows to its capacity; with writemap it reserves all of it at open)
    budget = free + held if explicit else int(free * (1 - L3_DISK_HEADROOM)) + held
    text = f"{directory} has {gib(free + held)} free on its disk" + (
        f" ({gib(held)} of it its store's files)" if held else "") + (
        "" if explicit else f", {L3_DISK_HEADROOM:.0%} of the free space left to the rest of the disk")
    req = SizeRequest(int(capacity * GiB), explicit,
                      f"{size_key} {capacity:g} GiB" + ("" if explicit else " (the default)"),
                      f"{size_key} in --hicache-storage-backend-extra-config")
    nbytes, warning = fit("L3", req, budget, text, minimum=64 << 20)
    if warning is not None:
        out[size_key] = nbytes / GiB
    return out, warning
