"""The layering of the tests, the benchmarks and their helpers, as a test: an AST import graph of
``tests/``, ``bench/`` and ``harness/`` (the helpers both use: servers, tiny models, network
namespaces, PD / TP clusters). Every import statement counts, lazy ones inside functions
included; relative imports are resolved; ``from x import y`` names the module ``x.y`` where that
is a module of these folders, else ``x``. (``tests/layout/test_layering.py`` holds the same kind of rules
for ``hicache``, ``serving`` and ``router``; this file is apart to keep both short.)

Rules (one test each; a failure lists every violation as ``file:line``):
- ``bench`` never imports ``tests``; ``tests`` never imports ``bench`` except ``TESTS_OF_BENCH``;
- ``harness`` imports neither ``tests`` nor ``bench``;
- no module under ``tests/`` imports a test module (``test_*.py``): what tests share lives in
  ``harness/`` (or, as fixtures, in ``tests/conftest.py``).
A script a test starts as a subprocess (``python bench/x.py``, ``-c "..."``) is no import.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("tests", "bench", "harness")
# Tests of a benchmark's own code (its data, policy and prompt functions, called in process); the
# one exception to "tests never import bench" (docs/architecture.md: where the tree still differs).
TESTS_OF_BENCH = ("tests.benchmarks.test_trace_replay", "tests.benchmarks.test_speculative_bench")


@cache
def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for top in FOLDERS:
        for f in sorted((ROOT / top).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _ours(dotted: str) -> str | None:
    """The longest module of these folders that ``dotted`` names, else None (another package)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in _modules():
            return ".".join(parts[:n])
    return None


@cache
def _imports() -> list[tuple[str, str, str]]:
    """(``file:line``, importing module, imported module) for every import of a module of ours."""
    out = []
    for name, path in _modules().items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                dotted = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - (node.level - 1)] + ([base] if base else []))
                dotted = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            out += [(where, name, t) for t in map(_ours, dotted) if t is not None and t != name]
    return out


def _top(module: str) -> str:
    return module.split(".")[0]


def _report(title: str, rows: list[str]) -> str:
    return f"{title} ({len(rows)}):\n  " + "\n  ".join(rows)


def test_bench_and_tests_never_import_each_other():
    bad = [f"{w}: {s} imports {t}" for w, s, t in _imports()
           if (_top(s), _top(t)) == ("bench", "tests")
           or ((_top(s), _top(t)) == ("tests", "bench") and s not in TESTS_OF_BENCH)]
    assert not bad, _report("imports between bench and tests (shared helpers belong in harness/)", bad)


def test_harness_imports_neither_tests_nor_bench():
    bad = [f"{w}: {s} imports {t}" for w, s, t in _imports()
           if _top(s) == "harness" and _top(t) in ("tests", "bench")]
    assert not bad, _report("harness imports tests or bench", bad)


def test_no_test_module_imports_another():
    bad = [f"{w}: {s} imports {t}" for w, s, t in _imports()
           if _top(s) == "tests" and _modules()[t].name.startswith("test_")]
    assert not bad, _report("test modules imported by other modules under tests/ (move it to harness/)", bad)
