"""Order of the waiting queue: small strategy classes chosen by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from serving.structs.request import Req


class SchedulePolicy(ABC):
    @abstractmethod
    def order(self, waiting: list[Req], prefix_len: Callable[[Req], int]) -> list[Req]:
        """Return the waiting requests in admission order (the input is FCFS order)."""


class FCFS(SchedulePolicy):
    def order(self, waiting: list[Req], prefix_len: Callable[[Req], int]) -> list[Req]:
        return list(waiting)


class LongestPrefixFirst(SchedulePolicy):
    """Cache-aware: the longest cached prefix first (SGLang's ``lpm``). Stable, so ties
    stay FCFS. Past ``max_queue`` waiting requests the matching cost is not worth it
    and the order falls back to FCFS, as SGLang does."""

    def __init__(self, max_queue: int = 128) -> None:
        self.max_queue = max_queue

    def order(self, waiting: list[Req], prefix_len: Callable[[Req], int]) -> list[Req]:
        if len(waiting) > self.max_queue:
            return list(waiting)
        return sorted(waiting, key=lambda r: -prefix_len(r))


SCHEDULE_POLICIES: dict[str, type[SchedulePolicy]] = {"fcfs": FCFS, "lpm": LongestPrefixFirst}


def make_schedule_policy(name: str) -> SchedulePolicy:
    try:
        return SCHEDULE_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown schedule_policy {name!r}; choose from {sorted(SCHEDULE_POLICIES)}") from None
