"""A request's KV record (``serving.structs.req_kv.ReqKV``, ``Req.kv``) has one writer: ``serving/cache``
(issue 43). The record sits in ``serving/structs`` so that ``Req`` can hold it; every other module reads
its fields and asks ``ReqCache`` for a change (``advance``, ``reserve``, ``trim``, ``release``,
``try_admit``, ``take_prompt``, ``prompt_arrived``).

Checked on the ASTs of every module in ``hicache/``, ``edge/``, ``serving/``, ``router/``, ``harness/``,
``bench/`` and ``tests/`` outside ``serving/cache/``. A write is:
- an assignment, augmented assignment or ``del`` of ``<x>.kv.<field>`` or of an item or slice of it
  (``r.kv.pages[0] = p``), or of ``<x>.kv`` itself (a new record) where ``<x>`` is not ``self``;
- a call of a mutating method on it (``r.kv.pages.append(p)``, ``r.kv.cached_by_tier.update(...)``);
- an assignment to ``<x>.<field>`` where ``<x>`` is not ``self`` and ``<field>`` is a field only the
  record has (``r.kv_len = n``): the fields' old place on ``Req``, where a write would now make a
  new attribute nobody reads.
A failure lists every write as ``file:line``.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from harness.import_graph import ROOT, report
from serving.structs.req_kv import ReqKV

FIELDS = frozenset(f.name for f in dataclasses.fields(ReqKV))
# record fields whose names other classes use for their own state (a lease's pages, a response's counters)
SHARED_NAMES = frozenset({"pages", "prefetch", "cached_tokens", "cached_by_tier", "l3_decision", "admitted"})
MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault",
                      "popitem", "sort", "reverse", "__setitem__", "__delitem__"})
DIRS = ("hicache", "common", "edge", "serving", "router", "harness", "bench", "tests")
WRITER = ROOT / "serving" / "cache"


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _record_field(node: ast.AST) -> bool:
    """``<x>.kv.<field>``, or an item / slice of it."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return (isinstance(node, ast.Attribute) and node.attr in FIELDS
            and isinstance(node.value, ast.Attribute) and node.value.attr == "kv")


def _stale_field(node: ast.AST) -> bool:
    """``<x>.<field>`` for a field only the record has (its old place on Req)."""
    return (isinstance(node, ast.Attribute) and node.attr in FIELDS - SHARED_NAMES
            and not _is_self(node.value) and not (isinstance(node.value, ast.Attribute) and node.value.attr == "kv"))


def _new_record(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "kv" and not _is_self(node.value)


def _targets(node: ast.AST) -> Iterator[ast.AST]:
    if isinstance(node, (ast.Assign, ast.Delete)):
        tops = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        tops = [node.target]
    else:
        return
    for top in tops:
        yield from (ast.walk(top) if isinstance(top, (ast.Tuple, ast.List)) else [top])


def writes(path: Path, root: Path = ROOT) -> Iterator[str]:
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(root)
    for node in ast.walk(tree):
        for t in _targets(node):
            if _record_field(t) or _stale_field(t) or _new_record(t):
                yield f"{where}:{t.lineno}: {ast.unparse(t)} written"
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                and _record_field(node.func.value)):
            yield f"{where}:{node.lineno}: {ast.unparse(node.func)}(...)"


def test_only_serving_cache_writes_a_requests_kv_record():
    files = [f for d in DIRS for f in sorted((ROOT / d).rglob("*.py")) if WRITER not in f.parents]
    assert len(files) > 100
    bad = [row for f in files for row in writes(f)]
    assert not bad, report("ReqKV fields written outside serving/cache (ask ReqCache)", bad)


def test_the_check_sees_each_kind_of_write(tmp_path: Path):
    src = tmp_path / "w.py"
    src.write_text("r.kv.kv_len += 1\nr.kv.pages[0] = 3\ndel r.kv.pages[2:]\nr.kv.pages.extend([1])\n"
                   "r.kv = None\nr.kv_len = 4\nr.kv.cached_by_tier.update(a=1)\n"
                   "self.kv = 1\nlease.pages = []\nn = r.kv.kv_len\nr.kv.pages.index(1)\n")
    rows = list(writes(src, tmp_path))
    assert sorted(int(r.split(":")[1]) for r in rows) == [1, 2, 3, 4, 5, 6, 7], rows
