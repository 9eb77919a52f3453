"""The PD roles (serving/disagg) drive the cache through ``ReqCache``'s own methods: no module there
reaches into the tree behind it (``cache.tree....``), so the cache's controllers stay the only ones
that move pages between tiers; and a role never holds or imports the scheduler (it is handed to the
scheduler's constructor and answers its hooks). AST checks, each run also on a planted violation."""

from __future__ import annotations

import ast
from pathlib import Path

from harness.import_graph import Import, imports, report, within

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


def scheduler_imports(found: list[Import]) -> list[str]:
    """Where ``serving.disagg`` imports ``serving.scheduler`` (a role is handed to the scheduler's
    constructor and answers its hooks; it never holds the scheduler)."""
    return [f"{i.where()}: {i.source} imports {i.target}" for i in found
            if within(i.source, ("serving.disagg",)) and not i.external and within(i.target, ("serving.scheduler",))]


def test_pd_roles_never_see_the_scheduler() -> None:
    bad = scheduler_imports(list(imports()))
    assert not bad, report("serving/disagg imports the scheduler", bad)
    bad = [f"{p.relative_to(ROOT)}" for p in sorted((ROOT / "serving" / "disagg").rglob("*.py"))
           if "self.sched" in p.read_text()]
    assert not bad, "a PD role holds the scheduler:\n" + "\n".join(bad)


def test_the_scheduler_check_sees_a_planted_import() -> None:
    planted = Import("serving.disagg.decode", 3, "serving.scheduler.scheduler", False, "type")
    assert scheduler_imports([planted]) == [
        "serving/disagg/decode.py:3: serving.disagg.decode imports serving.scheduler.scheduler"]
    assert not scheduler_imports([Import("serving.disagg.decode", 3, "serving.cache.req_cache", False, "import")])
