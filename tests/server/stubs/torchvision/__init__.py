"""Import-only stand-in for torchvision, for ``sglang.bench_serving`` in tests/server/test_sglang_bench.py.

SGLang's benchmark imports its multimodal helpers at start-up, which import torchvision; a text
benchmark never calls them. PyPI's torchvision wheels are CUDA builds tied to one torch version
(installing one replaces the CPU torch), so the test puts this stub on PYTHONPATH instead: every
``torchvision.*`` module and attribute exists and does nothing.
"""
import importlib.abc
import importlib.machinery
import sys
import types


class _Any:
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return _Any()
    def __getattr__(self, name): return _Any()
    def __mro_entries__(self, bases): return (object,)


class _Module(types.ModuleType):
    __path__: list = []
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None
    def create_module(self, spec): return _Module(spec.name)
    def exec_module(self, module): module.__path__ = []


sys.meta_path.insert(0, _Finder())
__version__ = "0.0.0+stub"
def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Any()
