"""Sampling parameters of one request, SGLang-style names, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from serving import compat_fields
from serving.structs.grammar_spec import normalize_grammar_params


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says what is wrong (HTTP 400)."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # structured output (serving.grammar), at most one: a JSON schema (its JSON text), a regex,
    # an EBNF grammar (xgrammar dialect, root rule "root"), an xgrammar structural tag (JSON text)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # the grammar constrains only what follows this token (a reasoning parser's end marker, e.g.
    # ``</think>``, when the prompt leaves the answer inside the reasoning); before it, tokens are free
    grammar_after_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _check(isinstance(self.max_new_tokens, int) and not isinstance(self.max_new_tokens, bool)
               and self.max_new_tokens >= 0, "max_new_tokens must be an integer >= 0")
        _check(_num(self.temperature) and self.temperature >= 0, "temperature must be a number >= 0")
        _check(_num(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
               "top_k must be -1 (off) or an integer >= 1")
        _check(_num(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        _check(_num(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 10,
               "repetition_penalty must be in [0.01, 10]")
        _check(_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
               "frequency_penalty must be in [-2, 2]")
        _check(_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
               "presence_penalty must be in [-2, 2]")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
               "seed must be an integer")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _check(len(self.stop) <= 16, "at most 16 stop strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers")
        grammars = (self.json_schema, self.regex, self.ebnf, self.structural_tag)
        _check(all(v is None or (isinstance(v, str) and v) for v in grammars),
               "json_schema, regex, ebnf and structural_tag must be non-empty strings")
        _check(sum(v is not None for v in grammars) <= 1,
               "give at most one of json_schema, regex, ebnf, structural_tag")
        after = self.grammar_after_token_id
        _check(after is None or (isinstance(after, int) and not isinstance(after, bool) and after >= 0),
               "grammar_after_token_id must be a token id (an integer >= 0)")

    def to_wire(self) -> dict[str, Any]:
        """The fields as msgpack takes them (serving/ipc.py): tuples as lists, ``extra`` left out."""
        return {f.name: list(v) if isinstance(v, tuple) else v
                for f in fields(self) if f.name != "extra" for v in (getattr(self, f.name),)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SamplingParams:
        """:meth:`to_wire`'s dict back (validated again on construction)."""
        return cls(**{k: tuple(v) if k in ("stop", "stop_token_ids") else v for k, v in d.items()})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from an SGLang ``sampling_params`` dict; unknown keys are an error, and so are
        SGLang's keys that HiCache does not implement unless neutral (serving.compat_fields).
        ``sampling_seed`` is SGLang's name for ``seed``."""
        known = {f.name for f in fields(cls)} - {"extra"}
        try:
            d = compat_fields.drop_neutral(dict(d or {}), compat_fields.SAMPLING, known)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if "sampling_seed" in d:
            if d.get("seed") is not None and d["sampling_seed"] is not None:
                raise InvalidRequest("give seed or sampling_seed, not both")
            alias = d.pop("sampling_seed")
            d["seed"] = alias if alias is not None else d.get("seed")
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequest(f"unsupported sampling parameter(s): {', '.join(unknown)}")
        stop = d.get("stop")
        if stop is not None:
            if isinstance(stop, str):
                stop = (stop,)
            elif isinstance(stop, list | tuple):
                stop = tuple(stop)
            else:
                raise InvalidRequest("stop must be a string or a list of strings")
            d["stop"] = stop
        if d.get("stop_token_ids") is not None:
            if not isinstance(d["stop_token_ids"], list | tuple):
                raise InvalidRequest("stop_token_ids must be a list of integers")
            d["stop_token_ids"] = tuple(d["stop_token_ids"])
        grammar_error = normalize_grammar_params(d)
        if grammar_error:
            raise InvalidRequest(grammar_error)
        d = {k: v for k, v in d.items() if v is not None}
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            if name in d and isinstance(d[name], int) and not isinstance(d[name], bool):
                d[name] = float(d[name])
        return cls(**d)


def _num(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise InvalidRequest(msg)
