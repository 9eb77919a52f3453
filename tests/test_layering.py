"""The layering of the code base, as a test: an AST import graph of ``hicache/``, ``serving/`` and
``router/``. Every import statement counts, lazy ones inside functions included; ``from x import y``
resolves to the module ``x.y`` where that is a module, else to ``x``; a module of ours named in a
string for importlib (a registry's ``"pkg.mod:Attr"``) is an import too.

Rules (one test each; a failure lists every violation as ``file:line``):
- ``hicache`` imports neither ``serving`` nor ``router``;
- ``router`` never imports ``serving``; ``serving`` imports ``router`` only in the launcher
  (``LAUNCHER``, the one place that starts both);
- only the HTTP packages (``HTTP_PACKAGES``) import an HTTP framework (``HTTP_FRAMEWORKS``);
- no module of the engine process (``ENGINE_ENTRY`` and every module it reaches) imports one;
- no import cycle between modules;
- no module touches another module's private attributes (defined above ``_private_uses``).
The package rules count ``if TYPE_CHECKING:`` imports too (a dependency all the same); the engine
process and the cycles leave them out (they never run).

The constants below are what the restructuring (issue 28) updates as modules move.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hicache", "serving", "router")

# The launcher: the one sanctioned place that imports both serving and router.
LAUNCHER = ("serving.launch",)
# The packages whose job is HTTP (a module or package name covers everything below it): the HTTP
# process, the router, and serving.lang's RuntimeEndpoint (an HTTP client of a server, by design).
HTTP_PACKAGES = ("serving.server", "router", "serving.lang.backends.runtime_endpoint")
HTTP_FRAMEWORKS = frozenset({"fastapi", "starlette", "httpx", "uvicorn"})
# The engine process's entry point: its modules are the ones this reaches through imports that run.
ENGINE_ENTRY = "serving.engine.main"


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
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
        return f"{_modules()[self.source].relative_to(ROOT)}:{self.line}"


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    nodes: list[ast.AST]  # every node of the tree, walked once
    imports: list[Import] = field(default_factory=list)


@cache
def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _is_package(name: str) -> bool:
    return _modules()[name].name == "__init__.py"


def _ours(dotted: str) -> str | None:
    """The longest module of ours that ``dotted`` names (``a.b.C`` -> ``a.b``), else None."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in _modules():
            return cand
    return None


def _type_checking_lines(nodes: list[ast.AST]) -> set[int]:
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


def _resolve(source: str, node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, bool]]:
    """(target, external) for each name the statement imports."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            mine = _ours(alias.name)
            yield (mine, False) if mine else (alias.name.split(".")[0], True)
        return
    if node.level:
        base = source.split(".")
        if not _is_package(source):
            base.pop()
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    mine = _ours(prefix)
    for alias in node.names:  # one per name, in order
        sub = f"{prefix}.{alias.name}"
        yield (prefix.split(".")[0], True) if mine is None else (sub, False) if sub in _modules() else (mine, False)


def _named_modules(nodes: list[ast.AST]) -> Iterator[tuple[int, str]]:
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
            if "." in name and name in _modules():
                yield node.lineno, name


@cache
def _graph() -> dict[str, Module]:
    graph: dict[str, Module] = {}
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        mod = Module(name, path, tree, list(ast.walk(tree)))
        guarded = _type_checking_lines(mod.nodes)
        seen: set[tuple[int, str, bool]] = set()
        found: list[Import] = []
        for node in mod.nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                kind = "type" if node.lineno in guarded else "import"
                found += [Import(name, node.lineno, t, ext, kind) for t, ext in _resolve(name, node)]
        found += [Import(name, line, target, False, "name") for line, target in _named_modules(mod.nodes)]
        for i in sorted(found, key=lambda i: i.line):
            if i.target != name and (i.line, i.target, i.external) not in seen:
                seen.add((i.line, i.target, i.external))
                mod.imports.append(i)
        graph[name] = mod
    return graph


def _imports() -> Iterator[Import]:
    for mod in _graph().values():
        yield from mod.imports


def _report(title: str, rows: list[str]) -> str:
    return f"{title} ({len(rows)}):\n  " + "\n  ".join(rows)


# ---------------------------------------------------------------------------------------------
# The package arrows


def test_hicache_imports_neither_serving_nor_router():
    bad = [f"{i.where()}: {i.source} imports {i.target}" for i in _imports()
           if _within(i.source, ("hicache",)) and not i.external and _within(i.target, ("serving", "router"))]
    assert not bad, _report("hicache imports serving or router", bad)


def test_router_and_serving_meet_only_in_the_launcher():
    bad = []
    for i in _imports():
        if i.external:
            continue
        if _within(i.source, ("router",)) and _within(i.target, ("serving",)):
            bad.append(f"{i.where()}: {i.source} imports {i.target}")
        if (_within(i.source, ("serving",)) and _within(i.target, ("router",))
                and not _within(i.source, LAUNCHER)):
            bad.append(f"{i.where()}: {i.source} imports {i.target} (outside the launcher {LAUNCHER})")
    assert not bad, _report("imports between router and serving", bad)


def test_only_http_packages_import_http_frameworks():
    bad = [f"{i.where()}: {i.source} imports {i.target}" for i in _imports()
           if i.external and i.target in HTTP_FRAMEWORKS and not _within(i.source, HTTP_PACKAGES)]
    assert not bad, _report(f"HTTP frameworks imported outside {HTTP_PACKAGES}", bad)


def _engine_process() -> dict[str, list[Import]]:
    """Every module the engine process's entry reaches through imports that run, with the chain
    of imports that reaches it."""
    graph = _graph()
    assert ENGINE_ENTRY in graph, f"ENGINE_ENTRY {ENGINE_ENTRY} is no module: update it"
    chains: dict[str, list[Import]] = {ENGINE_ENTRY: []}
    todo = [ENGINE_ENTRY]
    while todo:
        name = todo.pop(0)
        for i in graph[name].imports:
            if not i.external and i.runs and i.target not in chains:
                chains[i.target] = chains[name] + [i]
                todo.append(i.target)
    return chains


def test_engine_process_imports_no_http_framework():
    bad = []
    for name, chain in sorted(_engine_process().items()):
        for i in _graph()[name].imports:
            if i.external and i.target in HTTP_FRAMEWORKS and i.runs:
                via = " -> ".join([ENGINE_ENTRY] + [f"{c.target} ({c.where()})" for c in chain])
                bad.append(f"{i.where()}: {name} imports {i.target}; reached by {via}")
    assert not bad, _report(f"HTTP frameworks in the engine process (from {ENGINE_ENTRY})", bad)


# ---------------------------------------------------------------------------------------------
# Cycles


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), over imports that run."""
    graph = _graph()
    succ = {n: sorted({i.target for i in m.imports if not i.external and i.runs}) for n, m in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # iterative, so a deep graph cannot overflow the stack
        work = [(v, iter(succ[v]))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(succ[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return sorted(out)


def _one_cycle(comp: list[str]) -> list[Import]:
    """A shortest cycle through the component's first module (breadth first inside it)."""
    graph, members, start = _graph(), set(comp), comp[0]
    prev: dict[str, Import] = {}
    todo = [start]
    while todo:
        name = todo.pop(0)
        for i in graph[name].imports:
            if i.external or not i.runs or i.target not in members:
                continue
            if i.target == start:
                path = [i]
                while path[0].source != start:
                    path.insert(0, prev[path[0].source])
                return path
            if i.target not in prev:
                prev[i.target] = i
                todo.append(i.target)
    raise AssertionError(f"no cycle in {comp}")


def test_no_import_cycles():
    bad = []
    for comp in _cycles():
        cycle = " -> ".join(f"{i.source} ({i.where()})" for i in _one_cycle(comp)) + f" -> {comp[0]}"
        bad.append(f"{len(comp)} modules {comp}; e.g. {cycle}")
    assert not bad, _report("import cycles", bad)


# ---------------------------------------------------------------------------------------------
# Private attributes
#
# A private name is one with a leading underscore that is not a dunder (``_x``, not ``__x__``).
# A module of ours *defines* a private name when it has it at module level (def, class, assignment,
# import alias) or as a class member (def, class-level assignment, ``self._x = ...`` /
# ``cls._x = ...`` inside the class). A use is ``obj._x`` (read, write or delete),
# ``getattr/setattr/hasattr/delattr(obj, "_x")`` or ``from module import _x``, where:
# - ``obj`` is not ``self``, ``cls`` or ``super()`` (a class reaching into itself and its bases),
# - the module of the use does not itself define ``_x`` (its own classes and names), and
# - some other module of ours defines ``_x`` (so ``os._exit`` or ``torch._C`` are not ours to judge).
# ``from module import _x`` is a use when ``module`` is ours and is not the importing module.


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
    return {name: frozenset(_defined_private_names(mod)) for name, mod in _graph().items()}


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
            for (target, external), alias in zip(_resolve(mod.name, node), node.names, strict=True):
                if not external and target != mod.name and _private(alias.name):
                    yield f"{where}:{node.lineno}: from {source} import {alias.name}"


def _by_line(row: str) -> tuple[str, int, str]:
    path, line = row.split(":")[:2]
    return path, int(line), row


def test_no_module_touches_another_modules_private_attributes():
    bad = [row for mod in _graph().values() for row in sorted(set(_private_uses(mod)), key=_by_line)]
    assert not bad, _report("private attributes used outside their module", bad)
