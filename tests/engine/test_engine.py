"""Engine core: greedy equality with HF transformers, prefix reuse, chunking, preemption, leaks."""

from __future__ import annotations

import pytest

from harness.engine_cases import GREEDY, ids_of, prompts
from harness.model_utils import hf_greedy, smollm2_path, tiny_model
from serving.engine import Engine
from serving.structs.sampling_params import InvalidRequest


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "llama_rope_scaled"])
def tiny(request, tmp_path_factory):
    arch = request.param if request.param in ("qwen2", "qwen3", "qwen3_moe", "gpt_oss") else "llama"
    extra = {}
    if request.param == "llama_rope_scaled":
        extra = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                 "tie_word_embeddings": True}
    path = tiny_model(tmp_path_factory.mktemp(request.param), arch=arch, **extra)
    ps = prompts(6, 512, seed=1)
    return path, ps, hf_greedy(path, ps, GREEDY["max_new_tokens"])


def make_engine(path, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("page_size", 4)
    return Engine(model_path=str(path), **kw)


def test_tiny_models_match_hf_in_one_mixed_batch(tiny):
    path, ps, ref = tiny
    eng = make_engine(path)
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(outs) == ref
    eng.check_integrity()


def test_prefix_reuse_chunked_prefill_same_output(tiny):
    path, ps, ref = tiny
    eng = make_engine(path, chunked_prefill_size=7)
    first = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(first) == ref
    # Second round: every prompt's prefix is in the tree now.
    again = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(again) == ref
    for p, o in zip(ps, again, strict=True):
        assert o["meta_info"]["cached_tokens"] == (len(p) - 1) // 4 * 4
    assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0
    # Prompts that extend earlier prompt+output reuse their KV too.
    longer = [p + o for p, o in zip(ps, ref, strict=True)]
    ext = eng.generate(input_ids=longer, sampling_params={**GREEDY, "max_new_tokens": 4})
    for p, o in zip(longer, ext, strict=True):
        assert o["meta_info"]["cached_tokens"] >= (len(p) - 12 - 4)
    eng.check_integrity()


def test_preemption_keeps_outputs(tiny):
    path, ps, ref = tiny
    # A pool too small for all six at once forces retraction during decode.
    eng = make_engine(path, max_total_tokens=160, page_size=4)
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(outs) == ref
    assert eng.core.scheduler.stats.retractions > 0
    eng.check_integrity()


def test_fcfs_and_lpm_agree(tiny):
    path, ps, ref = tiny
    for policy in ("fcfs", "lpm"):
        eng = make_engine(path, schedule_policy=policy, max_running_requests=2)
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        eng.check_integrity()


def test_abort_releases_pages(tiny):
    path, ps, _ = tiny
    eng = make_engine(path)
    core = eng.core
    reqs = [core.make_request(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 50}) for p in ps]
    for r in reqs:
        core.add(r)
    for _ in range(3):
        core.step()
        core.check_integrity()
    for r in reqs[::2]:
        assert core.scheduler.abort(r.rid) is r
        core.check_integrity()
    while core.scheduler.has_work:
        core.step()
    core.check_integrity()
    assert core.scheduler.in_use_pages() == 0


def test_bad_requests_are_refused(tiny):
    path, _, _ = tiny
    eng = make_engine(path, context_length=64)
    with pytest.raises(InvalidRequest, match="context length"):
        eng.generate(input_ids=list(range(1, 80)), sampling_params=GREEDY)
    with pytest.raises(InvalidRequest, match="input_ids"):
        eng.generate(input_ids=[1, 2, 10**6], sampling_params=GREEDY)
    with pytest.raises(InvalidRequest, match="unsupported sampling"):
        eng.generate(input_ids=[1, 2, 3], sampling_params={"bogus": 1})
    with pytest.raises(InvalidRequest, match="empty"):
        eng.generate(input_ids=[], sampling_params=GREEDY)
    eng.check_integrity()


def test_sampling_params_behave(tiny):
    path, ps, ref = tiny
    eng = make_engine(path)
    p = ps[0]
    a = eng.generate(input_ids=p, sampling_params={"temperature": 1.0, "seed": 7, "max_new_tokens": 8})
    b = eng.generate(input_ids=p, sampling_params={"temperature": 1.0, "seed": 7, "max_new_tokens": 8})
    assert a["output_ids"] == b["output_ids"]
    # top_k=1 is greedy whatever the temperature
    c = eng.generate(input_ids=p, sampling_params={"temperature": 5.0, "top_k": 1, "max_new_tokens": 12,
                                                   "ignore_eos": True})
    assert c["output_ids"] == ref[0]
    # stop token ids end the output at that token
    stop_tok = ref[0][3]
    d = eng.generate(input_ids=p, sampling_params={**GREEDY, "stop_token_ids": [stop_tok]})
    assert d["output_ids"] == ref[0][: ref[0].index(stop_tok) + 1]
    assert d["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    e = eng.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 3})
    assert e["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    # a strong repetition penalty never repeats a token within the output of a greedy run
    f = eng.generate(input_ids=p, sampling_params={**GREEDY, "repetition_penalty": 10.0,
                                                   "max_new_tokens": 10})
    assert len(set(f["output_ids"]) & set(p)) <= len(set(ref[0][:10]) & set(p))
    for params in ({"top_p": 0.5, "seed": 1}, {"min_p": 0.2, "seed": 1}, {"frequency_penalty": 1.0},
                   {"presence_penalty": 1.5, "temperature": 0}):
        out = eng.generate(input_ids=p, sampling_params={**params, "max_new_tokens": 5})
        assert len(out["output_ids"]) <= 5
    eng.check_integrity()


@pytest.mark.slow
def test_smollm2_matches_hf_and_reuses_prefix():
    path = smollm2_path()
    eng = Engine(model_path=str(path), max_total_tokens=8192)
    tok = eng.core.tokenizer
    system = "You are a helpful assistant who answers briefly and precisely. " * 3
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("What is the capital of France?", "Name a prime number.", "Say hello.")]
    texts = [tok.apply_chat_template(c) for c in chats]
    ids = [tok.encode(t) for t in texts]
    ref = hf_greedy(path, ids, 10)
    outs = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 10, "ignore_eos": True})
    assert ids_of(outs) == ref
    again = eng.generate(prompt=texts[0], sampling_params={"temperature": 0, "max_new_tokens": 10,
                                                           "ignore_eos": True})
    assert again["output_ids"] == ref[0]
    assert again["meta_info"]["cached_tokens"] >= len(ids[0]) - 16
    assert isinstance(again["text"], str) and again["text"]
    eng.check_integrity()
