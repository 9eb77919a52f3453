"""The checks every family with state layers passes against HF transformers (CPU, fp32), run by
tests/models/test_qwen3_5.py and test_nemotron_h.py on their tiny checkpoints:

- prefill logits of a ragged batch == HF's;
- greedy decode (prompts of 30-80 tokens, 24 new tokens, all sequences in one batch) == HF's
  ``generate`` token for token;
- a prefill split in two chunks (in a mixed batch) == one forward: logits and every state tensor;
- a snapshot captured at a page boundary inside a prefill, restored into a fresh slot through the
  host and continued == continuing the original sequence, token for token;
- the state is really read: zeroing a sequence's slot between two steps changes its logits.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from harness.model_utils import hf_greedy
from harness.state_runner import PAGE_SIZE, StateRunner, hf_last_logits

ATOL = 1e-4


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL * max(1.0, float(ref.abs().max())), rtol=0)


def check_prefill(path: Path, hf: torch.nn.Module) -> None:
    run = StateRunner(path)
    vocab = run.cfg.vocab_size
    prompts = {0: _prompt(0, 37, vocab), 1: [7], 2: _prompt(2, 5, vocab), 3: _prompt(3, 16, vocab)}
    out = run.step(prompts)
    for sid, ids in prompts.items():
        _close(out[sid], hf_last_logits(hf, ids))


def check_greedy(path: Path, lengths: tuple[int, ...] = (30, 47, 80), new_tokens: int = 24) -> None:
    run = StateRunner(path)
    vocab = run.cfg.vocab_size
    prompts = {i: _prompt(10 + i, n, vocab) for i, n in enumerate(lengths)}
    ref = hf_greedy(path, list(prompts.values()), new_tokens)
    got: dict[int, list[int]] = {sid: [] for sid in prompts}
    out = run.step(prompts)  # one ragged prefill, then decode batches of all of them
    for _ in range(new_tokens):
        nxt = {sid: [int(logits.argmax())] for sid, logits in out.items()}
        for sid, ids in nxt.items():
            got[sid] += ids
        out = run.step(nxt)
    assert [got[sid] for sid in prompts] == ref


def check_chunked(path: Path, hf: torch.nn.Module) -> None:
    one, two = StateRunner(path), StateRunner(path)
    vocab = one.cfg.vocab_size
    prompt, other = _prompt(20, 45, vocab), _prompt(21, 9, vocab)
    whole = one.step({0: prompt})[0]
    two.step({0: prompt[:17], 1: other})  # the first chunk beside another sequence's prefill
    second = two.step({1: [3], 0: prompt[17:]})[0]  # then a decode token beside the second chunk
    _close(second, whole)
    _close(whole, hf_last_logits(hf, prompt))
    for a, b in zip(one.state.read_slot(one.slots[0]), two.state.read_slot(two.slots[0]), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # both continue the same
    a, b = one.step({0: [5, 6]})[0], two.step({0: [5, 6]})[0]
    _close(a, b)


def check_snapshot(path: Path, steps: int = 12) -> None:
    run = StateRunner(path)
    vocab = run.cfg.vocab_size
    prompt = _prompt(30, 38, vocab)
    k = 5 * PAGE_SIZE  # snapshot after 20 tokens: a page boundary, where the next turn resumes
    run.step({0: prompt[:6]})
    # the snapshot is taken inside the second chunk (new token k - 7 of it), beside a sequence without one
    out = run.step({1: _prompt(31, 11, vocab), 0: prompt[6:]}, snaps={0: k - 7})
    snap = run.snapped[0]
    run.fork(2, parent=0, tokens=k, snap_slot=snap)
    forked = run.step({2: prompt[k:]})[2]
    _close(forked, out[0])
    a, b = {0: int(out[0].argmax())}, {2: int(forked.argmax())}
    for _ in range(steps):
        oa, ob = run.step({0: [a[0]]})[0], run.step({2: [b[2]]})[2]
        _close(ob, oa)
        a[0], b[2] = int(oa.argmax()), int(ob.argmax())
        assert a[0] == b[2]
    # a snapshot during decode (offset 0 of a one-token step) holds the state after that token
    nxt = run.step({0: [a[0]]}, snaps={0: 0})
    assert all(torch.equal(x, y) for x, y in zip(run.state.read_slot(run.snapped[0]),
                                                  run.state.read_slot(run.slots[0]), strict=True))
    assert nxt[0].shape == (vocab,)


def check_state_is_read(path: Path, hf: torch.nn.Module) -> None:
    run = StateRunner(path)
    prompt = _prompt(40, 24, run.cfg.vocab_size)
    run.step({0: prompt[:12]})
    run.state.zero_slot(run.slots[0])
    logits = run.step({0: prompt[12:]})[0]
    assert not torch.allclose(logits, hf_last_logits(hf, prompt), atol=1e-3)


def check_model_runner(path: Path, hf: torch.nn.Module, backend: str) -> None:
    """The engine's ModelRunner builds the state pool (model_runner.state_slots_for) and passes it."""
    from hicache.tiers.device import DeviceKVPool
    from serving.config import ModelConfig, SchedulerConfig
    from serving.runner.model_runner import ModelRunner, state_slots_for
    from serving.structs.forward_batch import ForwardBatch

    runner = ModelRunner(ModelConfig(model_path=str(path), device="cpu", dtype="float32", attention_backend=backend),
                         SchedulerConfig(max_total_tokens=256, max_running_requests=4), PAGE_SIZE)
    stack = runner.model.layer_stack
    assert runner.state_pool is not None and runner.state_pool.num_slots == state_slots_for(4) == 24
    assert runner.state_pool.layout == runner.model.state_layout(torch.float32)
    assert isinstance(runner.pool, DeviceKVPool) and runner.pool.layout.num_layers == len(stack.kv_layers)
    vocab = runner.arch.vocab_size
    prompts = [_prompt(60, 21, vocab), _prompt(61, 6, vocab)]
    slots = runner.state_pool.alloc(2)
    for s in slots:
        runner.state_pool.zero_slot(s)
    batch = ForwardBatch.build([(prompts[0], 0, [1, 2, 3, 4, 5, 6]), (prompts[1], 0, [7, 8])], PAGE_SIZE,
                               state_slots=slots)
    out = runner.forward(batch)
    for logits, ids in zip(out, prompts, strict=True):
        _close(logits, hf_last_logits(hf, ids))
