"""NGRAM speculative decoding's parts on their own: the tree's n-gram index (fed by a real
HiRadixTree's events: inserts, splits, evictions, salts, the capacity bound), a request's own
history, the drafter's rankings, greedy acceptance, the draft policy and the cost estimate."""

from __future__ import annotations

import pytest

from hicache import salt
from hicache.hiradix import HiRadixTree
from hicache.tiers.allocator import PageAllocator
from serving.config import SchedulerConfig
from serving.speculative.cost import StepCost
from serving.speculative.drafter import NgramDrafter, levels_for, rank_prob
from serving.speculative.history import RequestHistory
from serving.speculative.ngram_index import TreeNgramIndex
from serving.speculative.policy import PROBE_DRAFTS, DraftPolicy, SpecState
from serving.speculative.verify import accept_greedy

PS = 4


def tree_and_index(pages: int = 64, capacity: int = 1 << 16, levels=(2,)):
    alloc = PageAllocator(pages)
    tree = HiRadixTree(PS, alloc)
    return tree, alloc, TreeNgramIndex(tree, levels, capacity)


def insert(tree: HiRadixTree, alloc: PageAllocator, tokens: list[int], index: TreeNgramIndex | None = None) -> None:
    n = len(tokens) // PS
    pages = alloc.alloc(n)
    alloc.free(tree.insert(tokens, pages))
    if index is not None:
        index.catch_up(1 << 30)


def conts(matches):
    return [c for _, c in matches]


def test_index_finds_continuations_across_nodes_and_splits():
    tree, alloc, index = tree_and_index()
    a = list(range(100, 124))  # 6 pages
    insert(tree, alloc, a, index)
    assert conts(index.find((), [7, 104, 105], 12, 5)) == [[106, 107, 108, 109, 110]]
    size = index.size
    # a sequence sharing 2 pages splits the first node; the split-off upper part is not indexed again
    b = a[:8] + list(range(200, 208))
    insert(tree, alloc, b, index)
    assert tree.num_nodes == 3 and index.stats()["index_nodes"] == 2  # the split's upper part had no event
    assert index.size == size + 8  # the new node's positions (its first key spans the boundary)
    # positions recorded before the split still resolve (the lower part now starts at depth 8)
    assert conts(index.find((), [104, 105], 12, 3)) == [[106, 107, 108]]
    # a continuation past the recorded node goes down the most recently used child
    got = index.find((), [206, 207], 12, 4)
    assert got == [(2, [])]  # the end of a leaf: nothing follows
    got = conts(index.find((), [103, 104], 12, 6))
    assert got == [[105, 106, 107, 108, 109, 110]]
    # the match length counts the tokens compared back beyond the key
    assert index.find((), [101, 102, 103, 104], 12, 1)[0][0] == 4
    assert index.find((), [9, 102, 103, 104], 12, 1)[0][0] == 3


def test_index_forgets_nodes_the_tree_drops_and_resets():
    tree, alloc, index = tree_and_index(pages=8)
    insert(tree, alloc, list(range(100, 116)), index)
    assert index.find((), [105, 106], 12, 2)
    tree.evict_device(4)  # no L2: the node leaves the tree
    assert tree.num_nodes == 0
    assert index.find((), [105, 106], 12, 2) == []
    assert index.size < 16  # the stale positions met were dropped
    insert(tree, alloc, list(range(300, 316)), index)
    assert index.find((), [301, 302], 12, 1) == [(2, [303])]
    tree.reset()
    assert index.size == 0 and index.find((), [301, 302], 12, 1) == []


def test_index_partitions_by_cache_salt():
    tree, alloc, index = tree_and_index()
    tags = salt.salt_tags("tenant-a")
    seq = list(range(100, 116))
    insert(tree, alloc, salt.apply(seq, tags), index)
    assert index.find((), [101, 102], 12, 2) == []  # unsalted requests never see a salted sequence
    assert conts(index.find(tags, [101, 102], 12, 2)) == [[103, 104]]
    # the salted first tokens come back raw (a match at the very start)
    assert conts(index.find(tags, [100], 12, 3)) == [] and conts(index.find(tags, [100, 101], 12, 3)) == [[102, 103,
                                                                                                            104]]


def test_index_capacity_bounds_positions():
    tree, alloc, index = tree_and_index(pages=256, capacity=50)
    for i in range(8):
        insert(tree, alloc, list(range(1000 * i, 1000 * i + 16)), index)
    assert index.size <= 50
    assert index.evicted > 0
    assert index.find((), [7001, 7002], 12, 1) == [(2, [7003])]  # the latest survive
    assert index.find((), [1, 2], 12, 1) == []


def test_history_longest_latest_match():
    h = RequestHistory((8, 4, 2), per_key=4)
    seq = [1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    h.update(seq)
    got = h.find(seq, 12, 3)
    assert got[0] == (3, [4, 5, 6])  # the latest occurrence of [1, 2, 3] first
    assert got[1] == (3, [9, 1, 2])
    seq += [4, 5]
    h.update(seq)
    assert h.find(seq, 12, 2)[0] == (5, [6, 1])  # [2 3 4 5] at level 4, then compared back
    assert RequestHistory((2,)).find([1], 12, 2) == []


def test_drafter_prefers_longer_matches_and_ranks():
    d = NgramDrafter(None, 2, 12, "BFS")
    h = d.new_history()
    seq = [5, 6, 7, 8, 1, 2, 3, 9, 9, 5, 6, 7]
    assert d.draft(seq, h, (), 4) == ([8, 1, 2, 3], 3)
    assert d.draft([1, 2, 3, 4], d.new_history(), (), 4) == ([], 0)  # no earlier occurrence
    # PROB: the continuation most occurrences agree on
    assert rank_prob([(3, [1, 2, 3]), (3, [4, 5]), (3, [1, 2, 7]), (3, [1, 9])]) == [1, 2, 3]
    assert levels_for(2, 12) == (8, 4, 2) and levels_for(1, 3) == (1,) and levels_for(5, 6) == (5,)


def test_greedy_acceptance():
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept_greedy([1, 2, 3], [1, 5, 3, 4]) == [1, 5]
    assert accept_greedy([1, 2, 3], [7, 2, 3, 4]) == [7]
    assert accept_greedy([], [7]) == [7]


def test_policy_grows_with_acceptance_and_turns_off():
    pol = DraftPolicy(8, min_backoff=4)
    st = SpecState(RequestHistory((2,)))
    cheap = (0.0, 0.05)
    k0 = pol.budget(st, cheap)
    for _ in range(8):
        pol.on_verify(st, 8, 8)
    assert pol.budget(st, cheap) == 8 > k0
    assert pol.best_k(0.1, cheap) == 1  # drafts this cheap pay even at 10% acceptance
    for _ in range(8):
        pol.on_verify(st, 4, 0)
    dear = (0.0, 0.15)
    assert pol.budget(st, dear) == 0 and st.off_left == 4 and st.auto_off == 1
    assert [pol.budget(st, dear) for _ in range(4)] == [0] * 4
    assert pol.budget(st, dear) == PROBE_DRAFTS  # back: a probe whatever the estimate
    # expensive drafts: only a high acceptance pays, and fewer of them
    assert pol.best_k(0.5, (1.0, 0.3)) == 0
    assert 0 < pol.best_k(0.8, (1.0, 0.3)) < 8


def test_step_cost_measures_fixed_and_per_draft_terms():
    c = StepCost(prior=0.3)
    assert c.terms(1) == (0.0, 0.3)
    for i in range(40):
        c.observe(1, 0, 1.0)
        k = 1 + i % 8
        c.observe(1, k, 1.0 + 0.5 + 0.1 * k)
    c0, c1 = c.terms(1)
    assert c0 == pytest.approx(0.5, abs=0.02) and c1 == pytest.approx(0.1, abs=0.01)
    # an unmeasured batch size borrows the nearest one's seconds, its step taken as growing with its rows
    assert c.terms(8) == pytest.approx((0.5 / 8, 0.1), abs=0.01)
    # a batch of 8: a draft's share of the step is 8 times larger
    for i in range(10):
        c.observe(8, 0, 2.0)
        c.observe(8, 2 + 4 * (i % 2), 2.0 + 0.1 * (2 + 4 * (i % 2)))
    assert c.terms(8) == pytest.approx((0.0, 0.1 * 8 / 2.0), abs=0.01)
    # counts that never vary: the excess split with c1 at most the prior, the rest fixed
    c2 = StepCost(prior=0.3)
    for _ in range(10):
        c2.observe(1, 0, 1.0)
        c2.observe(1, 2, 1.8)
    assert c2.terms(1) == pytest.approx((0.2, 0.3))
    # without plain steps for a while, one is asked for
    assert not c.wants_plain(1)
    for _ in range(64):
        c.observe(1, 4, 2.0)
    assert c.wants_plain(1)
    assert not StepCost(0.1, adaptive=False).wants_plain(1)


def test_config_validates_the_flags():
    cfg = SchedulerConfig(speculative_algorithm="NGRAM")
    assert cfg.speculative_num_draft_tokens >= 2
    for bad in ({"speculative_algorithm": "EAGLE"}, {"speculative_num_draft_tokens": 1},
                {"speculative_ngram_min_match_window_size": 0},
                {"speculative_ngram_min_match_window_size": 5, "speculative_ngram_max_match_window_size": 4},
                {"speculative_ngram_match_type": "DFS"}, {"speculative_ngram_capacity": 0}):
        with pytest.raises(ValueError, match="speculative"):
            SchedulerConfig(**bad)


def test_index_catches_up_in_bounded_steps_across_a_split():
    tree, alloc, index = tree_and_index(pages=256)
    seq = list(range(1000, 1200))  # 50 pages
    pages = alloc.alloc(50)
    tree.insert(seq, pages)
    assert index.pending == 1 and index.find((), [1100, 1101], 12, 1) == []
    index.catch_up(64)
    assert index.indexed_tokens == 64 and index.pending == 1
    # a split above the queued node before it is indexed: its upper part is still indexed
    alloc.free(tree.insert(seq[:40] + list(range(5000, 5008)), alloc.alloc(12)))
    while index.pending:
        index.catch_up(64)
    assert index.indexed_tokens == 200 + 8
    for a in (1001, 1050, 1150):
        assert index.find((), [a, a + 1], 12, 2) == [(2, [a + 2, a + 3])]


def test_history_indexes_a_window_in_chunks():
    h = RequestHistory((2,), window=100, chunk=30)
    seq = list(range(500)) + [480, 481]
    h.update(seq)
    assert h.find(seq, 12, 2) == []  # only 402..431 indexed so far
    for _ in range(3):
        h.update(seq)
    assert h.find(seq, 12, 2) == [(2, [482, 483])]
    assert h.find([*range(500), 10, 11], 12, 2) == []  # older than the window: not indexed
