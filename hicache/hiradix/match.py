"""Value objects the tree hands out: the result of a prefix match and a page transfer order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hicache.hiradix.node import TreeNode


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a token sequence.

    - ``device_pages``: L1 page ids of the prefix that is on L1, in order
      (``len(device_pages) * page_size == device_hit_tokens``).
    - ``host_hit_tokens``: tokens after the L1 hit that are cached on L2 only; they
      run from ``last_device_node`` (exclusive) down to ``last_host_node``.
    - ``storage_hit_tokens``: tokens after that found on L3 (0 until L3 exists).
    - ``last_device_node``: deepest matched node on L1 (the root when there is no hit);
      lock this one for a request that reads ``device_pages``.
    - ``last_host_node``: deepest matched node on L1 or L2.
    """

    device_pages: list[int]
    device_hit_tokens: int
    host_hit_tokens: int
    storage_hit_tokens: int
    last_device_node: TreeNode
    last_host_node: TreeNode

    @property
    def cached_tokens(self) -> int:
        """Tokens cached on any tier (L1 + L2 + L3)."""
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens


@dataclass(frozen=True)
class Transfer:
    """An order for the cache controller to copy pages between tiers.

    ``kind == "backup"``: L1 ``src_pages`` → L2 ``dst_pages``;
    ``kind == "load"``: L2 ``src_pages`` → L1 ``dst_pages``. Same length, in order.
    Transfers must be executed in the order the tree emitted them.
    """

    kind: Literal["backup", "load"]
    src_pages: list[int]
    dst_pages: list[int]
    # backups: the nodes whose pages these are, in order (so a controller can write
    # them on to L3 under their page keys); empty for loads
    nodes: tuple[TreeNode, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in ("backup", "load"):
            raise ValueError(f"unknown transfer kind {self.kind!r}")
        if len(self.src_pages) != len(self.dst_pages):
            raise ValueError("src_pages and dst_pages differ in length")
