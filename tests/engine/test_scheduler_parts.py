"""The scheduler's optional parts (serving/scheduler/parts.py) and what a request carries for them
(serving/structs/req_parts.py) are what their implementations offer: every protocol method exists on
the class with the same parameters, and every attribute a protocol names is one of the class's fields,
so the types name the real collaborators (a member renamed or re-shaped on one side fails here)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from serving.cache.prefetch_op import PrefetchOp
from serving.disagg.role_base import PDRole
from serving.grammar.runner import GrammarRunner, GrammarState
from serving.runner.logprobs import LogprobState
from serving.scheduler.parts import GrammarPart, PDRolePart, SpeculativePart
from serving.speculative.policy import SpecState
from serving.speculative.worker import SpeculativeWorker
from serving.structs.req_parts import GrammarSlot, LogprobSlot, PrefetchSlot, SpecSlot


def _members(proto: type) -> list[str]:
    return [n for n, v in vars(proto).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))]


PAIRS = [(GrammarPart, GrammarRunner), (SpeculativePart, SpeculativeWorker), (PDRolePart, PDRole),
         (GrammarSlot, GrammarState), (LogprobSlot, LogprobState), (SpecSlot, SpecState),
         (PrefetchSlot, PrefetchOp)]


@pytest.mark.parametrize(("proto", "impl"), PAIRS)
def test_each_part_is_what_its_implementation_offers(proto: type, impl: type) -> None:
    names = _members(proto)
    assert names, proto
    fields = {f.name for f in dataclasses.fields(impl)} if dataclasses.is_dataclass(impl) else set()
    for name in getattr(proto, "__annotations__", {}):
        assert name in fields, f"{impl.__name__} has no field {name}"
    for name in names:
        want, got = getattr(proto, name), getattr(impl, name, None)
        assert got is not None, f"{impl.__name__} has no {name}"
        if isinstance(want, property):
            assert isinstance(got, property), f"{impl.__name__}.{name} is not a property"
            continue
        params = [p.name for p in inspect.signature(want).parameters.values() if p.name != "self"]
        have = [p.name for p in inspect.signature(got).parameters.values() if p.name != "self"]
        assert have == params, f"{impl.__name__}.{name}{tuple(have)} != the protocol's {tuple(params)}"
