"""The import graph of ``hicache/``, ``common/``, ``edge/``, ``serving/`` and ``router/``, from their ASTs:
what the layering tests (``tests/layout/test_layering.py``, ``tests/layout/test_private_access.py``) check
their rules on.

Every import statement counts, lazy ones inside functions included; ``from x import y`` resolves
to the module ``x.y`` where that is a module, else to ``x``; a module of ours named in a string
for importlib (a registry's ``"pkg.mod:Attr"``) is an import too. Imports under
``if TYPE_CHECKING:`` are kept, marked ``kind="type"`` (they never run).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hicache", "common", "edge", "serving", "router")


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class Import:
    """One imported name: ``target`` is a module of ours (``external`` False) or the top-level
    name of another distribution's package (``external`` True). ``kind``: "import" (a statement,
    at module level or lazy inside a function), "type" (under ``if TYPE_CHECKING:``, never runs)
    or "name" (a module of ours named in a string for importlib, ``"pkg.mod"`` or ``"pkg.mod:Attr"``,
    as registries do; a ``-m pkg.mod`` command line starts another process and is no import)."""

    source: str
    line: int
    target: str
    external: bool
    kind: str

    @property
    def runs(self) -> bool:
        return self.kind != "type"

    def where(self) -> str:
        return f"{modules()[self.source].relative_to(ROOT)}:{self.line}"


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    nodes: list[ast.AST]  # every node of the tree, walked once
    imports: list[Import] = field(default_factory=list)


@cache
def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def ours(dotted: str) -> str | None:
    """The longest module of ours that ``dotted`` names (``a.b.C`` -> ``a.b``), else None."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in modules():
            return cand
    return None


def type_checking_lines(nodes: list[ast.AST]) -> set[int]:
    lines: set[int] = set()
    for node in nodes:
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    for sub in ast.walk(stmt):
                        if isinstance(sub, (ast.Import, ast.ImportFrom)):
                            lines.add(sub.lineno)
    return lines


def resolve(source: str, node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, bool]]:
    """(target, external) for each name the statement imports."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            mine = ours(alias.name)
            yield (mine, False) if mine else (alias.name.split(".")[0], True)
        return
    if node.level:
        base = source.split(".")
        if not is_package(source):
            base.pop()
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    mine = ours(prefix)
    for alias in node.names:  # one per name, in order
        sub = f"{prefix}.{alias.name}"
        yield (prefix.split(".")[0], True) if mine is None else (sub, False) if sub in modules() else (mine, False)


def named_modules(nodes: list[ast.AST]) -> Iterator[tuple[int, str]]:
    """Modules of ours named by a string constant (importlib registries), not after ``"-m"``."""
    after_dash_m: set[int] = set()
    for node in nodes:
        if isinstance(node, (ast.List, ast.Tuple)):
            for a, b in zip(node.elts, node.elts[1:], strict=False):
                if isinstance(a, ast.Constant) and a.value == "-m":
                    after_dash_m.add(id(b))
    for node in nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in after_dash_m:
            name = node.value.split(":")[0] if node.value.count(":") == 1 else node.value
            if "." in name and name in modules():
                yield node.lineno, name


@cache
def module_graph() -> dict[str, Module]:
    graph: dict[str, Module] = {}
    for name, path in modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        mod = Module(name, path, tree, list(ast.walk(tree)))
        guarded = type_checking_lines(mod.nodes)
        seen: set[tuple[int, str, bool]] = set()
        found: list[Import] = []
        for node in mod.nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                kind = "type" if node.lineno in guarded else "import"
                found += [Import(name, node.lineno, t, ext, kind) for t, ext in resolve(name, node)]
        found += [Import(name, line, target, False, "name") for line, target in named_modules(mod.nodes)]
        for i in sorted(found, key=lambda i: i.line):
            if i.target != name and (i.line, i.target, i.external) not in seen:
                seen.add((i.line, i.target, i.external))
                mod.imports.append(i)
        graph[name] = mod
    return graph


def imports() -> Iterator[Import]:
    for mod in module_graph().values():
        yield from mod.imports


def report(title: str, rows: list[str]) -> str:
    return f"{title} ({len(rows)}):\n  " + "\n  ".join(rows)
