"""The HiRadixTree: which token pages are cached on which tier (pure bookkeeping, no tensors)."""

from hicache.hiradix.match import MatchResult, PendingLoad, Transfer
from hicache.hiradix.node import TreeNode
from hicache.hiradix.sessions import UnknownSession
from hicache.hiradix.tiering import StaleMatch
from hicache.hiradix.tree import HiRadixTree

__all__ = ["HiRadixTree", "MatchResult", "PendingLoad", "StaleMatch", "Transfer", "TreeNode", "UnknownSession"]
