"""The layering of the code base, as a test: an AST import graph of ``hicache/``, ``edge/``,
``serving/`` and ``router/``. Every import statement counts, lazy ones inside functions included; ``from x import y``
resolves to the module ``x.y`` where that is a module, else to ``x``; a module of ours named in a
string for importlib (a registry's ``"pkg.mod:Attr"``) is an import too.

Rules (one test each; a failure lists every violation as ``file:line``):
- ``hicache`` (the cache core) imports neither ``serving`` nor ``router`` nor ``edge`` nor ``common``, and no
  tokenizer, template or HTTP library (``NOT_IN_THE_CACHE_CORE``);
- ``common`` (what the worker's processes and the router share besides the cache) imports neither
  ``serving`` nor ``router`` nor ``edge``;
- ``edge`` (the HTTP edge the worker's HTTP process and the router share) imports neither ``serving``
  nor ``router``;
- ``router`` never imports ``serving``; ``serving`` imports ``router`` only in the launcher
  (``LAUNCHER``, the one place that starts both);
- only the HTTP packages (``HTTP_PACKAGES``) import an HTTP framework (``HTTP_FRAMEWORKS``);
- no module of the engine process (``ENGINE_ENTRY`` and every module it reaches) imports one;
- no import cycle between modules;
- ``serving.structs`` (the request, its sampling params, a forward's batch) sits at the bottom: it imports
  no other engine package (``STRUCTS_MAY_IMPORT`` aside);
- no loop between two engine packages (``serving.X`` <-> ``serving.Y``; ``KNOWN_PACKAGE_LOOPS`` is empty).
The package rules are functions of the import list, each also run on a planted violation. The graph is
built by ``harness/import_graph.py``; that no module touches another module's private attributes is
``tests/layout/test_private_access.py``. The package rules count
``if TYPE_CHECKING:`` imports too (a dependency all the same); the engine process and the cycles
leave them out (they never run).

The constants below move with the modules.
"""

from __future__ import annotations

from harness.import_graph import Import, imports, module_graph, report, within

# The launcher: the one sanctioned place that imports both serving and router.
LAUNCHER = ("serving.launch",)
# The packages whose job is HTTP (a module or package name covers everything below it): the HTTP
# process, the router, the edge both serve with, and serving.lang's RuntimeEndpoint (an HTTP client
# of a server, by design).
HTTP_PACKAGES = ("serving.server", "router", "edge", "serving.lang.backends.runtime_endpoint")
HTTP_FRAMEWORKS = frozenset({"fastapi", "starlette", "httpx", "uvicorn"})
# What the cache core never imports: tokenizers, chat templates (common/ has them) and HTTP.
NOT_IN_THE_CACHE_CORE = HTTP_FRAMEWORKS | {"tokenizers", "transformers", "jinja2", "sentencepiece"}
# The engine process's entry point: its modules are the ones this reaches through imports that run.
ENGINE_ENTRY = "serving.engine.main"
# The bottom package and the leaf modules it may import.
STRUCTS = "serving.structs"
STRUCTS_MAY_IMPORT = ("serving.compat_fields",)
# Loops between two engine packages that are still there (each pair sorted). None is left; nothing may
# join this list.
KNOWN_PACKAGE_LOOPS: frozenset[tuple[str, str]] = frozenset()


# ---------------------------------------------------------------------------------------------
# The package arrows


def arrows(found: list[Import], source: str, forbidden: tuple[str, ...]) -> list[str]:
    """The imports of ours from package ``source`` into any of ``forbidden``."""
    return [f"{i.where()}: {i.source} imports {i.target}" for i in found
            if within(i.source, (source,)) and not i.external and within(i.target, forbidden)]


def libraries(found: list[Import], source: str, forbidden: frozenset[str]) -> list[str]:
    """The imports of another distribution's ``forbidden`` packages from package ``source``."""
    return [f"{i.where()}: {i.source} imports {i.target}" for i in found
            if within(i.source, (source,)) and i.external and i.target in forbidden]


def test_hicache_imports_neither_serving_nor_router_nor_edge_nor_common():
    bad = arrows(imports(), "hicache", ("serving", "router", "edge", "common"))
    assert not bad, report("hicache imports serving, router, edge or common", bad)


def test_the_cache_core_imports_no_tokenizer_or_http_code():
    bad = libraries(imports(), "hicache", NOT_IN_THE_CACHE_CORE)
    assert not bad, report(f"hicache imports one of {sorted(NOT_IN_THE_CACHE_CORE)}", bad)


def test_common_imports_neither_serving_nor_router_nor_edge():
    bad = arrows(imports(), "common", ("serving", "router", "edge"))
    assert not bad, report("common imports serving, router or edge", bad)


def test_edge_imports_neither_serving_nor_router():
    bad = arrows(imports(), "edge", ("serving", "router"))
    assert not bad, report("edge imports serving or router", bad)


def test_each_package_rule_fails_on_a_planted_violation():
    def plant(source: str, target: str, external: bool = False) -> list[Import]:
        return [*imports(), Import(source, 1, target, external, "import")]

    assert arrows(plant("hicache.keys", "common.tenants"), "hicache", ("serving", "router", "edge", "common"))
    assert libraries(plant("hicache.keys", "transformers", True), "hicache", NOT_IN_THE_CACHE_CORE)
    assert libraries(plant("hicache.tiers.storage", "fastapi", True), "hicache", NOT_IN_THE_CACHE_CORE)
    assert arrows(plant("common.prompt_form", "serving.engine.core"), "common", ("serving", "router", "edge"))
    assert arrows(plant("common.tenants", "router.app"), "common", ("serving", "router", "edge"))
    assert arrows(plant("edge.http_protocol", "serving.server.app"), "edge", ("serving", "router"))


def test_router_and_serving_meet_only_in_the_launcher():
    bad = []
    for i in imports():
        if i.external:
            continue
        if within(i.source, ("router",)) and within(i.target, ("serving",)):
            bad.append(f"{i.where()}: {i.source} imports {i.target}")
        if (within(i.source, ("serving",)) and within(i.target, ("router",))
                and not within(i.source, LAUNCHER)):
            bad.append(f"{i.where()}: {i.source} imports {i.target} (outside the launcher {LAUNCHER})")
    assert not bad, report("imports between router and serving", bad)


def test_only_http_packages_import_http_frameworks():
    bad = [f"{i.where()}: {i.source} imports {i.target}" for i in imports()
           if i.external and i.target in HTTP_FRAMEWORKS and not within(i.source, HTTP_PACKAGES)]
    assert not bad, report(f"HTTP frameworks imported outside {HTTP_PACKAGES}", bad)


def _engine_process() -> dict[str, list[Import]]:
    """Every module the engine process's entry reaches through imports that run, with the chain
    of imports that reaches it."""
    graph = module_graph()
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
        for i in module_graph()[name].imports:
            if i.external and i.target in HTTP_FRAMEWORKS and i.runs:
                via = " -> ".join([ENGINE_ENTRY] + [f"{c.target} ({c.where()})" for c in chain])
                bad.append(f"{i.where()}: {name} imports {i.target}; reached by {via}")
    assert not bad, report(f"HTTP frameworks in the engine process (from {ENGINE_ENTRY})", bad)


# ---------------------------------------------------------------------------------------------
# Cycles


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), over imports that run."""
    graph = module_graph()
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
    graph, members, start = module_graph(), set(comp), comp[0]
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
    assert not bad, report("import cycles", bad)


def _engine_package(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "serving" and len(parts) > 2 else None


def test_structs_is_the_bottom_of_the_engine():
    bad = [f"{i.where()}: {i.source} imports {i.target}" for i in imports()
           if within(i.source, (STRUCTS,)) and not i.external and within(i.target, ("serving",))
           and not within(i.target, (STRUCTS,) + STRUCTS_MAY_IMPORT)]
    assert not bad, report(f"{STRUCTS} imports engine packages", bad)


def test_no_loops_between_engine_packages():
    edges: dict[tuple[str, str], Import] = {}
    for i in imports():
        a, b = _engine_package(i.source), _engine_package(i.target)
        if i.runs and not i.external and a and b and a != b:
            edges.setdefault((a, b), i)
    loops = {tuple(sorted(pair)) for pair in edges if pair[::-1] in edges}
    bad = [f"{a} <-> {b}: {edges[(a, b)].where()} and {edges[(b, a)].where()}"
           for a, b in sorted(loops - KNOWN_PACKAGE_LOOPS)]
    gone = sorted(KNOWN_PACKAGE_LOOPS - loops)
    assert not bad, report("loops between engine packages", bad)
    assert not gone, f"these loops are gone: drop them from KNOWN_PACKAGE_LOOPS: {gone}"
