"""``EngineBackend``: the offline :class:`serving.engine.Engine` in this process.

``Engine.generate`` blocks its caller until its own requests finish, so calls from several
program states would run one after another. This backend instead owns the engine's core on
one driver thread: states' worker threads hand it jobs (build requests, or a session / flush
operation) through a queue and wait on a future; the driver adds the requests, steps the
scheduler while any are running -- so forks and batch programs share forward batches as on
the server -- and completes each job when its requests finish (streaming jobs get their new
text after every step).

Concurrency contract: only the driver thread touches ``engine.core``; the queue and the
futures are the only shared state.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from serving.lang import chat_template as ct
from serving.lang.backends.base import HEAL, Backend, choice_rows, logprob_values
from serving.lang.choices import ChoiceLogprobs
from serving.lang.errors import BackendError

IDLE_WAIT_S = 0.0005


class _Job:
    def __init__(self, make: Callable[[Any], list[Any] | Any], on_step: Callable[[list[Any]], None] | None = None):
        self.make = make
        self.on_step = on_step
        self.future: cf.Future = cf.Future()
        self.reqs: list[Any] = []


class EngineBackend(Backend):
    """Concurrency contract: only the driver thread touches ``engine.core`` (requests, steps,
    sessions, flushes, integrity checks); callers on any thread hand it jobs through ``_inbox``
    and block on each job's future; a streaming job's callback runs on the driver thread and
    only puts text into its reader's queue."""

    def __init__(self, engine: Any = None, chat_template: Any = None, **engine_kwargs: Any) -> None:
        from serving.engine import Engine

        self.engine = engine if engine is not None else Engine(**engine_kwargs)
        self.owns_engine = engine is None
        core = self.engine.core
        if core.tokenizer is None:
            raise ValueError("EngineBackend needs a model with a tokenizer")
        tpl = chat_template if chat_template is not None else getattr(core.tokenizer.hf, "chat_template", None)
        self.chat_template = ct.resolve(tpl)
        self._inbox: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="sgl-engine-driver", daemon=True)
        self._thread.start()

    # -- the driver ---------------------------------------------------------------------------
    def _submit(self, make: Callable[[Any], Any], on_step: Callable[[list[Any]], None] | None = None) -> Any:
        if not self._thread.is_alive():
            raise BackendError("the in-process engine is shut down")
        job = _Job(make, on_step)
        self._inbox.put(job)
        return job.future.result()

    def _loop(self) -> None:
        core = self.engine.core
        active: list[_Job] = []
        while True:
            try:
                job = self._inbox.get_nowait() if active else self._inbox.get()
            except queue.Empty:
                job = None
            else:
                if job is None:
                    for j in active:
                        j.future.set_exception(BackendError("the in-process engine is shut down"))
                    return
                try:
                    made = job.make(core)
                    if isinstance(made, list):
                        job.reqs = made
                        for r in made:
                            core.add(r)
                        active.append(job)
                    else:
                        job.future.set_result(made)
                except Exception as e:  # noqa: BLE001 - a bad request fails its job, not the driver
                    job.future.set_exception(BackendError(str(e), 404 if isinstance(e, KeyError) else 400))
                continue  # take every queued job before stepping
            if core.scheduler.has_work:
                before = core.scheduler.stats.forward_passes
                try:
                    core.step()
                except Exception as e:  # noqa: BLE001 - the step's requests fail (the engine recovers)
                    for j in active:
                        if any(not r.finished for r in j.reqs):
                            j.future.set_exception(BackendError(f"the engine step failed: {e}", 500))
                    active = [j for j in active if not j.future.done()]
                if core.scheduler.stats.forward_passes == before:
                    time.sleep(IDLE_WAIT_S)
            for j in list(active):
                if j.on_step is not None:
                    j.on_step(j.reqs)
                if all(r.finished for r in j.reqs):
                    active.remove(j)
                    j.future.set_result(j.reqs)

    # -- the backend --------------------------------------------------------------------------
    def _req(self, core: Any, params: dict[str, Any], ex: Any, gen: Any = None, text: str | None = None,
             ids: list[int] | None = None) -> Any:
        from serving.runner.logprobs import LogprobState
        from serving.structs.logprob_options import LogprobOptions

        sid = ex.session_id if ex is not None else None
        req = core.make_request(text=text, input_ids=ids, sampling_params=params, session_id=sid)
        if gen is not None and gen.return_logprob:
            opts = LogprobOptions(gen.logprob_start_len, gen.top_logprobs_num or 0, ())
            req.logprob = LogprobState.from_request(opts, req.input_ids, core.runner.arch.vocab_size)
        return req

    def generate(self, ex: Any, params: dict[str, Any], gen: Any) -> tuple[str, dict[str, Any]]:
        from serving.engine.offline import output_dict

        text = ex.text
        [r] = self._submit(lambda core: [self._req(core, params, ex, gen, text=text)])
        if r.finish_reason and r.finish_reason.get("type") == "abort":
            raise BackendError(str(r.finish_reason.get("message")), r.finish_reason.get("status"))
        out = output_dict(self.engine.core, r)
        if r.logprob is not None:
            out["meta_info"]["input_token_logprobs"] = r.logprob.input
            out["meta_info"]["output_token_logprobs"] = r.logprob.output
        return out["text"], out["meta_info"]

    def generate_stream(self, ex: Any, params: dict[str, Any], gen: Any) -> Iterator[tuple[str, dict | None]]:
        from serving.engine.offline import output_dict

        tok = self.engine.core.tokenizer
        stops = params.get("stop") or ()
        hold = max((len(s) for s in ([stops] if isinstance(stops, str) else stops)), default=1) - 1
        chunks: queue.Queue[Any] = queue.Queue()
        sent = [0]

        def on_step(reqs: list[Any]) -> None:
            r = reqs[0]
            if r.finished:
                return
            text = tok.decode(r.output_ids)
            upto = len(text) - hold
            if upto > sent[0] and not text[:upto].endswith("\ufffd"):
                chunks.put(text[sent[0]:upto])
                sent[0] = upto

        text = ex.text
        done: cf.Future = cf.Future()

        def run() -> None:
            try:
                done.set_result(self._submit(lambda core: [self._req(core, params, ex, gen, text=text)], on_step))
            except BaseException as e:  # noqa: BLE001 - handed to the reader
                done.set_exception(e)
            chunks.put(None)

        threading.Thread(target=run, daemon=True).start()
        while (piece := chunks.get()) is not None:
            yield piece, None
        [r] = done.result()
        out = output_dict(self.engine.core, r)
        final = out["text"]
        yield final[sent[0]:], out["meta_info"]

    def cache_prefix(self, ex: Any) -> dict[str, Any]:
        from serving.engine.offline import output_dict

        text = ex.text
        [r] = self._submit(lambda core: [self._req(core, {"max_new_tokens": 1, "temperature": 0}, ex, text=text)])
        return output_dict(self.engine.core, r)["meta_info"]

    def choice_logprobs(self, ex: Any, choices: list[str], unconditional: bool) -> list[ChoiceLogprobs]:
        from serving.lang.ir import Gen

        start = max(self.cache_prefix(ex)["prompt_tokens"] - HEAL, 0)
        texts = [ex.text] + [ex.text + c for c in choices]
        one = {"max_new_tokens": 1, "temperature": 0}
        scored = Gen(None, {}, True, start)
        reqs = self._submit(lambda core: [self._req(core, one, None, scored, text=t) for t in texts])
        rows = [choice_rows(reqs[0].logprob.input, r.logprob.input) for r in reqs[1:]]
        toks = [[int(p[1]) for p in rs] for rs in rows]
        unc: list[Any] = [None] * len(choices)
        if unconditional:  # the same tokens without the text before them
            alone = Gen(None, {}, True, 0)
            ureqs = self._submit(lambda core: [self._req(core, one, None, alone, ids=t) for t in toks])
            unc = [logprob_values(u.logprob.input) for u in ureqs]
        return [ChoiceLogprobs(t, logprob_values(rs), u) for t, rs, u in zip(toks, rows, unc, strict=True)]

    def open_session(self) -> str:
        return self._submit(lambda core: core.open_session())

    def close_session(self, session_id: str) -> None:
        self._submit(lambda core: core.close_session(session_id))

    def flush_cache(self) -> None:
        self._submit(lambda core: core.flush_cache())

    def check_integrity(self) -> None:
        self._submit(lambda core: core.check_integrity())

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join()
        if self.owns_engine:
            self.engine.shutdown()
