"""No module of ``hicache/``, ``common/``, ``edge/``, ``serving/`` or ``router/`` touches another module's private
attributes (the import-graph rules are ``tests/layout/test_layering.py``, the graph ``harness/import_graph.py``).

A private name is one with a leading underscore that is not a dunder (``_x``, not ``__x__``).
A module of ours *defines* a private name when it has it at module level (def, class, assignment,
import alias) or as a class member (def, class-level assignment, ``self._x = ...`` /
``cls._x = ...`` inside the class). A use is ``obj._x`` (read, write or delete),
``getattr/setattr/hasattr/delattr(obj, "_x")`` or ``from module import _x``, where:
- ``obj`` is not ``self``, ``cls`` or ``super()`` (a class reaching into itself and its bases),
- the module of the use does not itself define ``_x`` (its own classes and names), and
- some other module of ours defines ``_x`` (so ``os._exit`` or ``torch._C`` are not ours to judge).
``from module import _x`` is a use when ``module`` is ours and is not the importing module.
A failure lists every use as ``file:line``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache

from harness.import_graph import ROOT, Module, module_graph, report, resolve


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _targets(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)


def _defined_private_names(mod: Module) -> set[str]:
    """The private names a module defines: at module level or in a class body (nested in ``if`` /
    ``try`` / ``with`` too), members set on ``self`` / ``cls``, and ``import x as _y`` aliases (a
    ``from m import _y`` is ``m``'s name, not the importer's)."""
    names: set[str] = set()

    def body(stmts: list[ast.stmt]) -> None:
        for stmt in stmts:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
                if isinstance(stmt, ast.ClassDef):
                    body(stmt.body)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                    names.update(_targets(t))
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                names.update(a.asname for a in stmt.names if a.asname)
            elif isinstance(stmt, (ast.If, ast.Try, ast.With)):
                for part in ("body", "orelse", "finalbody"):
                    body(getattr(stmt, part, []))
                for h in getattr(stmt, "handlers", []):
                    body(h.body)

    body(mod.tree.body)
    for node in mod.nodes:  # members set on self / cls anywhere (methods, nested helpers)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
            names.add(node.attr)
    return {n for n in names if _private(n)}


def _is_self(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


@cache
def _own_privates() -> dict[str, frozenset[str]]:
    """Module -> the private names it defines."""
    return {name: frozenset(_defined_private_names(mod)) for name, mod in module_graph().items()}


@cache
def _definers() -> dict[str, frozenset[str]]:
    """Private name -> the modules of ours that define it."""
    out: dict[str, set[str]] = {}
    for name, privates in _own_privates().items():
        for private in privates:
            out.setdefault(private, set()).add(name)
    return {k: frozenset(v) for k, v in out.items()}


_REFLECTION = frozenset({"getattr", "setattr", "hasattr", "delattr"})


def _private_uses(mod: Module) -> Iterator[str]:
    definers, own = _definers(), _own_privates()[mod.name]
    where = mod.path.relative_to(ROOT)

    def foreign(attr: str) -> bool:
        return _private(attr) and attr not in own and bool(definers.get(attr, frozenset()) - {mod.name})

    for node in mod.nodes:
        if isinstance(node, ast.Attribute) and not _is_self(node.value) and foreign(node.attr):
            owners = ", ".join(sorted(definers[node.attr]))
            yield f"{where}:{node.lineno}: {ast.unparse(node)} (private to {owners})"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _REFLECTION
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and not _is_self(node.args[0])
              and foreign(node.args[1].value)):
            owners = ", ".join(sorted(definers[node.args[1].value]))
            yield f"{where}:{node.lineno}: {ast.unparse(node)} (private to {owners})"
    for node in mod.nodes:
        if isinstance(node, ast.ImportFrom):
            source = "." * node.level + (node.module or "")
            for (target, external), alias in zip(resolve(mod.name, node), node.names, strict=True):
                if not external and target != mod.name and _private(alias.name):
                    yield f"{where}:{node.lineno}: from {source} import {alias.name}"


def _by_line(row: str) -> tuple[str, int, str]:
    path, line = row.split(":")[:2]
    return path, int(line), row


def test_no_module_touches_another_modules_private_attributes():
    bad = [row for mod in module_graph().values() for row in sorted(set(_private_uses(mod)), key=_by_line)]
    assert not bad, report("private attributes used outside their module", bad)
