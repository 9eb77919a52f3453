"""Routing policies: strategy classes in a registry (``--policy NAME``).

Every policy picks one worker among the ``available`` ones (never empty) for a
:class:`RouteRequest`. Session affinity is applied by the router on top of any policy
(router/proxy.py); policies only see requests whose session has no live worker yet.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from router.approx_tree import ApproxTree
from router.workers import Worker

if TYPE_CHECKING:
    from router.cache_view import CacheView
    from router.config import RouterConfig


@dataclass
class RouteRequest:
    key: str  # routing key: token ids as characters, or the request's text (router/approx_tree.py)
    token_ids: list[int] | None = None  # exact ids when the router tokenized like the worker
    session_id: str | None = None  # affinity key: the worker's id, scoped by tenant (router/tenancy.py)
    worker_session_id: str | None = None  # the id the worker knows, when session_id is scoped
    # worker url -> characters of ``key`` the routing tree credited it with before this request
    # was sent there (so a failed attempt can be taken back: Policy.on_failed)
    held_before: dict[str, int] = field(default_factory=dict)

    @property
    def wire_session_id(self) -> str | None:
        """The session id to send a worker (re-opening the session on a new one)."""
        return self.worker_session_id if self.worker_session_id is not None else self.session_id


class Policy:
    name: ClassVar[str]

    def __init__(self, cfg: RouterConfig, view: CacheView | None = None) -> None:
        self.cfg = cfg
        self.view = view

    def select(self, req: RouteRequest, workers: Sequence[Worker]) -> Worker:
        raise NotImplementedError

    def on_sent(self, req: RouteRequest, worker: Worker) -> None:
        """The request was sent to ``worker`` (remember it)."""

    def on_failed(self, req: RouteRequest, worker: Worker) -> None:
        """The attempt on ``worker`` failed: it holds nothing new (forget what ``on_sent`` noted)."""

    def forget(self, url: str) -> None:
        """The worker was removed or lost its cache."""

    def maintain(self) -> None:
        """Periodic upkeep (tree eviction)."""

    def stats(self) -> dict[str, object]:
        return {}


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(cfg: RouterConfig, view: CacheView | None = None) -> Policy:
    return POLICIES[cfg.policy](cfg, view)


def least_loaded(workers: Sequence[Worker]) -> Worker:
    return min(workers, key=lambda w: (w.load, w.in_flight))


@register
class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, cfg: RouterConfig, view: CacheView | None = None) -> None:
        super().__init__(cfg, view)
        self._next = 0

    def select(self, req: RouteRequest, workers: Sequence[Worker]) -> Worker:
        w = workers[self._next % len(workers)]
        self._next += 1
        return w


@register
class Random(Policy):
    name = "random"

    def select(self, req: RouteRequest, workers: Sequence[Worker]) -> Worker:
        return random.choice(workers)


@register
class PowerOfTwo(Policy):
    name = "power_of_two"

    def select(self, req: RouteRequest, workers: Sequence[Worker]) -> Worker:
        if len(workers) == 1:
            return workers[0]
        return least_loaded(random.sample(list(workers), 2))


@register
class CacheAware(Policy):
    """SGLang's cache-aware policy over :class:`ApproxTree`, optionally refined by the
    workers' cache events (``cache_view: events``): see ``select``."""

    name = "cache_aware"

    def __init__(self, cfg: RouterConfig, view: CacheView | None = None) -> None:
        super().__init__(cfg, view)
        self.tree = ApproxTree()
        self.decisions: dict[str, int] = {"balance": 0, "exact": 0, "prefix": 0, "smallest": 0}
        self.retracted = 0  # characters taken back from the tree after failed attempts

    def select(self, req: RouteRequest, workers: Sequence[Worker]) -> Worker:
        if len(workers) == 1:
            return workers[0]
        loads = [w.load for w in workers]
        hi, lo = max(loads), min(loads)
        cfg = self.cfg
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            self.decisions["balance"] += 1
            return least_loaded(workers)
        by_url = {w.url: w for w in workers}
        if self.view is not None and req.token_ids:
            best = self.view.best(req.token_ids, by_url, cfg.cache_threshold)
            if best is not None:
                self.decisions["exact"] += 1
                return by_url[best]
        n = len(req.key)
        matched, tenants = self.tree.match(req.key, by_url) if n else (0, [])
        if tenants and matched / n >= cfg.cache_threshold:
            self.decisions["prefix"] += 1
            return least_loaded([by_url[t] for t in tenants])
        self.decisions["smallest"] += 1
        sizes = self.tree.sizes
        return min(workers, key=lambda w: (sizes.get(w.url, 0), w.load))

    def on_sent(self, req: RouteRequest, worker: Worker) -> None:
        if req.key:
            req.held_before[worker.url] = self.tree.match(req.key, (worker.url,))[0]
            self.tree.insert(req.key, worker.url)

    def on_failed(self, req: RouteRequest, worker: Worker) -> None:
        keep = req.held_before.pop(worker.url, None)
        if req.key and keep is not None:
            self.retracted += self.tree.retract(req.key, worker.url, keep)

    def forget(self, url: str) -> None:
        self.tree.remove_tenant(url)

    def maintain(self) -> None:
        for tenant in list(self.tree.sizes):
            self.tree.evict(tenant, self.cfg.max_tree_size)

    def stats(self) -> dict[str, object]:
        return {"decisions": dict(self.decisions), "tree_sizes": dict(self.tree.sizes), "retracted": self.retracted}
