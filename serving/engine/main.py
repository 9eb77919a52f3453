"""The engine process's entry point: started with multiprocessing ``spawn`` by
:class:`serving.server.engine_client.EngineClient`; builds the EngineCore (and, for PD, its
role), announces readiness, runs :class:`serving.engine.loop.EngineLoop`, shuts down
(persisting to L3) and exits with the loop's status."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from serving import ipc as m
from serving.config import EngineConfig
from serving.process_config import EngineProcessConfig

if TYPE_CHECKING:
    from serving.engine.core import EngineCore

# The engine's own modules (torch, the model, the cache) are imported in the spawned process only:
# the HTTP process imports this module for the entry point and never needs them.

log = logging.getLogger("hicache.engine")


def ready_info(core: EngineCore, config: EngineConfig) -> dict[str, Any]:
    tok = core.tokenizer
    return {
        "model_path": config.model.model_path,
        "tokenizer_path": (config.model.tokenizer_path or config.model.model_path) if tok else None,
        "served_model_name": config.model.served_model_name or config.model.model_path,
        "context_len": core.runner.context_len,
        "vocab_size": core.runner.arch.vocab_size,
        "page_size": config.cache.page_size,
        "num_pages": core.runner.pool.allocator.num_pages,
        "num_window_pages": core.runner.pool.window_pages,  # a hybrid SWA L1's window pool (0: none)
        "device": str(core.runner.device),
        "pid": os.getpid(),
        "dtype": str(core.runner.dtype).removeprefix("torch."),
        "quantization": getattr(core.runner.model, "quantization", "none"),  # what --quantization auto resolved to
        "layers": layer_mix(core.runner.layer_stack),
    }


def layer_mix(stack: Any) -> dict[str, int]:
    """The model's layers by kind (LayerKind values: full_attention, sliding_attention, ...): the cache's components."""
    mix: dict[str, int] = {}
    for spec in stack.specs:
        mix[spec.kind.value] = mix.get(spec.kind.value, 0) + 1
    return mix


def engine_main(
    config: EngineConfig, settings: EngineProcessConfig, rx: Connection, tx: Connection,
    heartbeat: m.Heartbeat | None = None,
) -> None:
    """Entry point of the spawned engine process. Exits non-zero when the loop failed
    (EXIT_BROKEN: the cache's invariants broke after a failed step) or persisting failed.
    ``settings``: the server's settings for this process (ServerConfig.engine_process()).
    ``heartbeat``: the watchdog's shared array (serving.ipc.make_heartbeat), beaten every turn."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the HTTP process, which stops us
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s engine %(levelname)s %(message)s")
    from serving.engine.loop import EngineLoop
    from serving.engine.shutdown import shutdown_core

    try:
        from serving.engine.core import EngineCore

        # with PD: the prefill / decode role (its bootstrap channel, the KV transport), built with the core
        core = EngineCore(config, role_settings=settings)
    except Exception as e:
        from hicache.sizing import TierSizeError
        from hicache.tiers.base import StorageOpenError
        from serving.models.quant import QuantizationError

        # a flag this machine cannot run, an L3 store that cannot be opened: one line
        if isinstance(e, QuantizationError | TierSizeError | StorageOpenError):
            tx.send_bytes(m.encode([m.Error(400, str(e))]))  # the HTTP process logs it, exits with status 2
            return
        log.exception("engine failed to start")
        tx.send_bytes(m.encode([m.Error(500, f"engine failed to start: {type(e).__name__}: {e}")]))
        return
    loop = EngineLoop(core, rx, tx, settings, heartbeat)

    def _stop(sig: int, frame: Any) -> None:  # e.g. SIGTERM sent to the whole process group
        loop.running = False

    signal.signal(signal.SIGTERM, _stop)
    tx.send_bytes(m.encode([m.Ready(ready_info(core, config))]))
    code = 0
    try:
        loop.run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception:
        log.exception("the engine loop failed")
        code = 1
    if code:
        tx.close()  # the HTTP side sees the engine gone now (503s), not after the shutdown below
    try:
        # waits for L3 write-backs in flight, persists the cache (never a broken one), closes the store
        report = shutdown_core(core, persist=loop.broken is None)
    except Exception:
        log.exception("engine shutdown failed")
        code = code or 1
    else:
        if report is not None and report.error is not None:
            code = code or 1
    if core.role is not None:
        # everything is shut down; a PD transport's native libraries (UCX's libnl under NIXL) can
        # crash in the C exit handlers, so leave without running them
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    # Everything is shut down: what is left is the interpreter's exit, whose final collections walk
    # every object torch and the model made (~1.5 s of CPU); frozen, they are left to the OS.
    gc.freeze()
    if code:
        raise SystemExit(code)
