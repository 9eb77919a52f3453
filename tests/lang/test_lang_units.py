"""serving.lang's pure parts: select's choice methods, chat templates read off Jinja, the
expressions ``+`` builds (no model, no server)."""

from __future__ import annotations

import pytest

import serving.lang as sgl
from harness.model_utils import smollm2_path
from serving.lang import chat_template as ct
from serving.lang import ir
from serving.lang.choices import METHODS, ChoiceLogprobs

LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def pick(method: str, *conds: list[float], uncond: list[list[float]] | None = None) -> int:
    lps = [ChoiceLogprobs(list(range(len(c))), c, None if uncond is None else uncond[i]) for i, c in enumerate(conds)]
    return METHODS[method].pick(lps)[0]


def test_choice_methods() -> None:
    # a long choice with one unlikely token: the mean prefers it, the sum does not
    long, short = [-0.1, -0.1, -0.1, -1.0], [-0.9]
    assert pick("token_length_normalized", long, short) == 0
    assert pick("sum_logprob", long, short) == 1
    # unconditional normalisation: a choice likely anywhere (a frequent word) loses its advantage
    assert pick("unconditional_likelihood_normalized", [-1.0], [-2.0], uncond=[[-0.5], [-4.0]]) == 1
    # greedy: token by token; the shorter choice continues with its mean
    assert pick("greedy_token_selection", [-0.5, -3.0], [-0.5], [-2.0, -0.1]) == 1
    assert pick("greedy_token_selection", [-0.5, -0.1], [-0.5]) == 0
    assert pick("token_length_normalized", [-1.0], [-1.0]) == 0  # ties: the first


def test_template_from_smollm2_and_llama3() -> None:
    smol = ct.from_jinja(ct.from_model_folder(str(smollm2_path())))
    assert smol.begin("assistant") == "<|im_start|>assistant\n" and smol.end("user") == "<|im_end|>\n"
    assert smol.default_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    llama = ct.from_jinja(LLAMA3)
    assert llama.begin("user") == "<|start_header_id|>user<|end_header_id|>\n\n"
    assert llama.end("user") == "<|eot_id|>" and llama.default_system == ""
    assert ct.resolve(None) is ct.CHATML and ct.resolve("{{ raise_exception('no') }}") is ct.CHATML


def test_expressions() -> None:
    e = "a" + sgl.gen("x", max_tokens=3) + "b"
    assert isinstance(e, ir.ExprList) and [type(x).__name__ for x in e.items] == ["Text", "Gen", "Text"]
    role = sgl.user("q " + sgl.select("c", ["yes", "no"]))
    assert [type(x).__name__ for x in role.items] == ["RoleBegin", "ExprList", "RoleEnd"]
    assert sgl.gen("t", choices=["a", "b"]).label() == "select('t')"
    with pytest.raises(ValueError, match="at most one of regex and json_schema"):
        sgl.gen("x", regex="a", json_schema="{}")
    with pytest.raises(TypeError, match="cannot append a list"):
        ir.to_expr([1])


def test_prefix_gate() -> None:
    import threading

    from serving.lang.batch import PrefixGate

    gate = PrefixGate(min_chars=8)
    lead_a = gate.enter("shared header A: question 1")
    assert lead_a is not None
    lead_b = gate.enter("another header: question 1")  # another group: leads at once, does not wait
    assert lead_b is not None
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(gate.enter("shared header A: question 2")))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # same group: waits for A's prefill
    gate.release(lead_a)
    waiter.join(5)
    assert got == [None]  # then goes, without leading
    assert gate.enter("shared header A: question 3") is None  # later ones pass straight through
    gate.release(lead_b)
