"""A request followed from the HTTP API to the tree and back crosses named types at every hop: in the
packages on that path no constructor takes a parameter typed ``Any``, no attribute is declared ``Any``
and no field of a record (a dataclass) is ``Any`` (``ALLOWED`` names the exceptions and why), so every
collaborator a class holds has a type a reader can open (a protocol where the real class sits above the
package: serving/scheduler/parts.py, serving/structs/req_parts.py, serving/cache/control_core.py). An
AST check, also run on a planted violation."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# HTTP edge -> HTTP process -> ipc -> engine loop -> scheduler -> request cache -> tree, and the shared library
ON_THE_PATH = ("edge", "common", "serving/server", "serving/ipc.py", "serving/engine", "serving/scheduler",
               "serving/cache", "serving/structs", "hicache/hiradix")
# (file, attribute): what may stay Any, and why
ALLOWED = {("common/tokenizer_light.py", "self._full"): "transformers' tokenizer, loaded on first use",
           ("serving/ipc.py", "Result.value"): "a control call's answer: msgpack data, not a collaborator",
           ("serving/structs/forward_batch.py", "ForwardBatch.state_plan"):
               "built and read by the state layers only (serving/models/state_scan.py's StatePlan)"}
UNTYPED = ("Any", "Any | None", "Optional[Any]")


def untyped_collaborators(source: str, name: str) -> list[str]:
    """``name:line what`` for each constructor parameter and declared attribute typed ``Any``."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.FunctionDef) and n.name == "__init__":
            for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs:
                if a.annotation is not None and ast.unparse(a.annotation) in UNTYPED:
                    out.append(f"{name}:{n.lineno} parameter {a.arg}")
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Attribute) \
                and ast.unparse(n.annotation) in UNTYPED and (name, ast.unparse(n.target)) not in ALLOWED:
            out.append(f"{name}:{n.lineno} attribute {ast.unparse(n.target)}")
        elif isinstance(n, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in n.decorator_list):
            out += [f"{name}:{f.lineno} field {n.name}.{f.target.id}" for f in n.body
                    if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
                    and ast.unparse(f.annotation) in UNTYPED and (name, f"{n.name}.{f.target.id}") not in ALLOWED]
    return out


def test_no_collaborator_on_the_request_path_is_any() -> None:
    files = [p for part in ON_THE_PATH for p in ([ROOT / part] if part.endswith(".py") else
                                                  sorted((ROOT / part).rglob("*.py")))]
    assert len(files) > 100
    bad = [row for p in files for row in untyped_collaborators(p.read_text(), str(p.relative_to(ROOT)))]
    assert not bad, "collaborators typed Any on the request's path:\n" + "\n".join(bad)


def test_the_check_sees_planted_ones() -> None:
    src = ("class A:\n    def __init__(self, core: Any, n: int, x: Any | None = None) -> None:\n"
           "        self.core = core\n        self.tree: Any = None\n        self.ok: int = 0\n\n\n"
           "@dataclass\nclass R:\n    grammar: Any = None\n    n: int = 0\n")
    assert set(untyped_collaborators(src, "m.py")) == {"m.py:2 parameter core", "m.py:2 parameter x",
                                                          "m.py:4 attribute self.tree", "m.py:10 field R.grammar"}
