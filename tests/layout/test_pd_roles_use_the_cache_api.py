"""The PD roles (serving/disagg) drive the cache through ``ReqCache``'s own methods: no module there
reaches into the tree behind it (``cache.tree....``), so the cache's controllers stay the only ones
that move pages between tiers. An AST check, run also on a planted violation."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def reaches_the_tree(source: str) -> list[int]:
    """Lines where an attribute named ``tree`` is read off something else (``x.tree``)."""
    return sorted({n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute) and n.attr == "tree"})


def test_pd_roles_never_reach_the_tree() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in sorted((ROOT / "serving" / "disagg").rglob("*.py"))
           for line in reaches_the_tree(p.read_text())]
    assert not bad, "serving/disagg reaches the tree behind ReqCache:\n" + "\n".join(bad)


def test_the_check_sees_a_planted_reach() -> None:
    assert reaches_the_tree("def f(self):\n    self.sched.cache.tree.backup_prefix([])\n") == [2]
    assert reaches_the_tree("def f(self):\n    self.sched.cache.release_and_back_up(r)\n") == []
