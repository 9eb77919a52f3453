"""The llguidance grammar backend's matcher contract, on SmolLM2's tokenizer: it ends on a stop
token (not when only a stop token can follow), a refused token leaves it usable (drafts and
look-aheads try tokens), rollback undoes both, jump-forward returns a token only where the mask
allows exactly one, and the kinds it cannot take are errors naming the way out."""

from __future__ import annotations

import pytest
import torch

from harness.model_utils import smollm2_path
from serving.grammar.base import GrammarError

llguidance = pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def backend():
    from transformers import AutoTokenizer

    from serving.grammar.llguidance_backend import LLGuidanceBackend

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    return LLGuidanceBackend(tok, 49152, [2]), tok


def _matcher(backend, kind: str, text: str):
    b, _ = backend
    return b.new_matcher(b.compile(b.parse(kind, text)))


def test_ends_on_the_stop_token_and_rolls_back(backend) -> None:
    b, tok = backend
    m = _matcher(backend, "regex", "(UTC|CET)")
    [utc] = tok.encode("UTC", add_special_tokens=False)
    [paris] = tok.encode(" Paris", add_special_tokens=False)
    assert not m.accept_token(paris)  # refused, and the matcher stays usable
    assert m.accept_token(utc) and not m.is_terminated()
    mask = b.allocate_mask(2)
    b.fill_masks([m], mask, [1])
    logits = torch.zeros(2, 49152)
    b.apply_masks(logits, mask, [1])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [2]  # only the stop token
    assert torch.isfinite(logits[0]).all()  # rows not named stay as they were
    assert b.forced_token(m) == 2
    assert m.accept_token(2) and m.is_terminated()
    m.rollback(2)
    assert not m.is_terminated() and m.accept_token(utc)


def test_jump_forward_only_where_one_token_is_allowed(backend) -> None:
    b, tok = backend
    m = _matcher(backend, "ebnf", 'root ::= "The answer is " ("yes" | "no") "."')
    forced = []
    while (t := b.forced_token(m)) is not None and m.accept_token(t):
        forced.append(t)
    assert tok.decode(forced) == "The answer is"  # " yes" or " " + "yes" ...: the model chooses
    [yes] = tok.encode(" yes", add_special_tokens=False)
    assert m.accept_token(yes) and tok.decode([b.forced_token(m)]) == "."


def test_kinds_it_cannot_take_name_the_way_out(backend) -> None:
    b, _ = backend
    with pytest.raises(GrammarError, match="--grammar-backend xgrammar"):
        b.parse("structural_tag", '{"type": "structural_tag", "format": {"type": "const_string", "value": "a"}}')
    with pytest.raises(GrammarError, match="invalid regex"):
        b.parse("regex", "(unclosed")
    with pytest.raises(GrammarError, match="undefined_rule"):
        b.parse("ebnf", 'root ::= "a" undefined_rule')
