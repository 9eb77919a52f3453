"""The scheduler's optional parts (serving/scheduler/parts.py) are what their implementations offer:
every protocol method exists on the class with the same parameters, so the scheduler's types name
the real collaborators (a method renamed or re-shaped on one side fails here)."""

from __future__ import annotations

import inspect

import pytest

from serving.disagg.role_base import PDRole
from serving.grammar.runner import GrammarRunner
from serving.scheduler.parts import GrammarPart, PDRolePart, SpeculativePart
from serving.speculative.worker import SpeculativeWorker


def _members(proto: type) -> list[str]:
    return [n for n, v in vars(proto).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))]


@pytest.mark.parametrize(("proto", "impl"), [(GrammarPart, GrammarRunner), (SpeculativePart, SpeculativeWorker),
                                             (PDRolePart, PDRole)])
def test_each_part_is_what_its_implementation_offers(proto: type, impl: type) -> None:
    names = _members(proto)
    assert names, proto
    for name in names:
        want, got = getattr(proto, name), getattr(impl, name, None)
        assert got is not None, f"{impl.__name__} has no {name}"
        if isinstance(want, property):
            assert isinstance(got, property), f"{impl.__name__}.{name} is not a property"
            continue
        params = [p.name for p in inspect.signature(want).parameters.values() if p.name != "self"]
        have = [p.name for p in inspect.signature(got).parameters.values() if p.name != "self"]
        assert have == params, f"{impl.__name__}.{name}{tuple(have)} != the protocol's {tuple(params)}"
