"""What the HTTP process and the engine process share: the typed messages between them
(msgpack-encoded) and the layout of the engine's heartbeat. Both processes import this module.

One wire frame is a run of concatenated msgpack objects, one per message, each
``[tag, {field: value}]``; the engine process sends everything one step produced in a single
frame, and the HTTP side coalesces what queued up while its writer was busy.

HTTP -> engine: GenerateReq, AbortReq, OpenSession, CloseSession, FlushCache, CheckIntegrity,
Stats, CacheEvents, Shutdown.  Engine -> HTTP: Ready (once, at start-up), Received, TokenOut,
Result, Error.

Requests are matched by ``rid``; control calls (sessions, flush, integrity, stats) by
``call_id``. A control call carries its caller's ``deadline`` (``time.monotonic()``, one clock
for both processes on Linux): the engine does not run a call whose caller already gave up (it
answered 504), so a timed-out /flush_cache never flushes later. TokenOut carries only the ids
that are new since the previous TokenOut of that request (``offset`` says where they start):
the HTTP side keeps the cumulative list, so a long generation does not resend its whole
output every step. The first TokenOut of a request
(``offset`` 0, maybe no ids) is sent as soon as the engine accepted it: the HTTP side waits
for it, or for an Error, before it answers, so validation errors get a proper status even on
streaming requests. Before that, the engine's receiver thread acknowledges each frame's
requests at once with a ``Received`` (their rids), even while a forward pass runs: the HTTP
side then knows the request is queued in a live engine, and waits for its acceptance for as
long as the engine makes progress rather than for ``engine_call_timeout_s``.

The heartbeat (the watchdog's view of the engine, see serving.server.watchdog) is ``SLOTS``
doubles in shared memory (``make_heartbeat``), each written by the engine alone
(serving.engine.heartbeat) and read by the HTTP process:

- ``PROGRESS``: ``time.monotonic()`` when the engine last made progress: a step that ran a
  forward pass or finished a request, or a turn of its loop with nothing to do;
- ``BEAT``: when its loop last went round (whether or not it made progress);
- ``BUSY``: 1.0 while the scheduler has requests (running or waiting), else 0.0;
- ``FORWARD_PASSES``: the scheduler's forward-pass count.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from serving.structs.bootstrap import Bootstrap
from serving.structs.logprob_options import LogprobOptions
from serving.structs.sampling_params import SamplingParams

EXIT_BROKEN = 3  # the engine process's exit status when its cache invariants broke (EngineLoop._fail_step)

# -- the heartbeat's slots ------------------------------------------------------------------
PROGRESS, BEAT, BUSY, FORWARD_PASSES = range(4)
SLOTS = 4
Heartbeat = ctypes.Array[ctypes.c_double]  # SLOTS doubles in shared memory (make_heartbeat)


def make_heartbeat(ctx: Any) -> Heartbeat:
    """A fresh heartbeat in shared memory (``ctx``: a multiprocessing context), stamped now."""
    hb = ctx.RawArray("d", SLOTS)
    now = time.monotonic()
    hb[PROGRESS] = hb[BEAT] = now
    return hb


# -- HTTP process -> engine process ---------------------------------------------------------
@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams  # parsed and checked once, by the HTTP process
    session_id: str | None = None
    bootstrap: Bootstrap | None = None  # PD: SGLang's bootstrap_* fields (None: not a PD request)
    logprobs: LogprobOptions | None = None  # what it asks of logprobs (None: none)
    cache_salt: str | None = None  # the effective salt (tenant + the request's cache_salt; hicache.salt)
    tenant: str | None = None  # the API key's tenant (None: the default tenant)
    capture_at: list[int] | None = None  # its cache_control breakpoints' prompt lengths (Req.capture_at)


@dataclass
class AbortReq:
    rid: str


@dataclass
class OpenSession:
    call_id: int
    session_id: str | None = None
    deadline: float = 0.0  # time.monotonic() after which the caller no longer waits (0: none)
    tenant: str | None = None  # the session belongs to it (serving.cache.kv_control)
    retention: dict[str, Any] | None = None  # {"demote_on_idle": bool, "ttl_s": float}


@dataclass
class CloseSession:
    call_id: int
    session_id: str
    deadline: float = 0.0  # time.monotonic() after which the caller no longer waits (0: none)
    tenant: str | None = None


@dataclass
class KVControlCall:
    """The KV control API (serving.cache.kv_control): ``op`` is lookup | pin | unpin; ``args`` its
    arguments (input_ids, cache_salt (effective), ttl_s, lease_id)."""

    call_id: int
    op: str
    args: dict[str, Any]
    tenant: str | None = None
    deadline: float = 0.0  # time.monotonic() after which the caller no longer waits (0: none)


@dataclass
class FlushCache:
    call_id: int
    clear_storage: bool = False  # also remove every page of L3 (/flush_cache?clear_storage=true)
    deadline: float = 0.0  # time.monotonic() after which the caller no longer waits (0: none)


@dataclass
class CheckIntegrity:
    call_id: int
    deadline: float = 0.0  # time.monotonic() after which the caller no longer waits (0: none)


@dataclass
class Stats:
    call_id: int
    deadline: float = 0.0  # time.monotonic() after which the caller no longer waits (0: none)


@dataclass
class CacheEvents:
    call_id: int
    since: int = 0
    epoch: str | None = None
    deadline: float = 0.0  # time.monotonic() after which the caller no longer waits (0: none)


@dataclass
class Shutdown:
    pass


# -- engine process -> HTTP process ---------------------------------------------------------
@dataclass
class Ready:
    info: dict[str, Any]  # model_path, served_model_name, context_len, vocab_size, page_size, ...


@dataclass
class Received:
    rids: list[str]  # the GenerateReqs of one frame, read by the engine's receiver thread (not yet accepted)


@dataclass
class TokenOut:
    rid: str
    offset: int  # number of output ids the HTTP side already has
    new_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    finish_reason: dict[str, Any] | None = None  # SGLang's shape; None while running
    l3_decision: dict[str, Any] | None = None  # load vs recompute of its L3 pages (see cost_model.py)
    logprobs: dict[str, Any] | None = None  # new since the last TokenOut (LogprobState.take_new)
    spec: dict[str, Any] | None = None  # speculative decoding's meta_info fields (SpecState.meta); None: off


@dataclass
class Result:
    call_id: int
    value: Any = None


@dataclass
class Error:
    status: int  # the HTTP status the API layer answers with
    message: str
    rid: str | None = None
    call_id: int | None = None


Message = (
    GenerateReq
    | AbortReq
    | OpenSession
    | CloseSession
    | KVControlCall
    | FlushCache
    | CheckIntegrity
    | Stats
    | CacheEvents
    | Shutdown
    | Ready
    | Received
    | TokenOut
    | Result
    | Error
)

_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        GenerateReq,
        AbortReq,
        OpenSession,
        CloseSession,
        KVControlCall,
        FlushCache,
        CheckIntegrity,
        Stats,
        CacheEvents,
        Shutdown,
        Ready,
        Received,
        TokenOut,
        Result,
        Error,
    )
}
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _TYPES.values()
}


# Fields whose value is a typed record: how it travels (to_wire) and comes back (from_wire).
_RECORDS: dict[type, dict[str, Any]] = {GenerateReq: {"sampling_params": SamplingParams.from_wire,
                                                      "bootstrap": Bootstrap.from_wire,
                                                      "logprobs": LogprobOptions.from_wire}}


def _wire(v: Any) -> Any:
    return v.to_wire() if hasattr(v, "to_wire") else v  # a record of _RECORDS


def pack(msg: Message) -> bytes:
    """One message as msgpack bytes; raises (TypeError / OverflowError) on unencodable values."""
    return msgpack.packb(
        [type(msg).__name__, {k: _wire(getattr(msg, k)) for k in _FIELDS[type(msg)]}], use_bin_type=True
    )


def encode(msgs: list[Message]) -> bytes:
    return b"".join(pack(msg) for msg in msgs)


def decode(frame: bytes) -> list[Message]:
    out: list[Message] = []
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(frame)
    for tag, fields in unpacker:
        cls = _TYPES.get(tag)
        if cls is None:
            raise ValueError(f"unknown message type {tag!r}")
        for name, back in _RECORDS.get(cls, {}).items():
            if fields.get(name) is not None:
                fields[name] = back(fields[name])
        out.append(cls(**fields))
    return out
