"""Gemma-3 text (serving/models/gemma3.py) against HF transformers 5 on tiny random checkpoints in
float32: logits of prefill, prefix reuse and decode with every weight random (norms too: HF
initialises Gemma's norm weights at 0, which would hide a norm bug), for the rope variants
(transformers 5's per-layer-type rope_parameters with a scaled full-attention rope, and the older
rope_theta + rope_local_base_freq keys); greedy tokens cold through the engine; the config parsing."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from harness.engine_cases import ids_of, prompts
from harness.model_utils import hf_greedy, tiny_model
from hicache.tiers.device import DeviceKVPool
from serving.engine import Engine
from serving.kernels import cpu_ext
from serving.kernels.attention import get_attention_backend
from serving.models.arch_config import ModelArchConfig
from serving.models.gemma3 import gemma3_layer_stack
from serving.models.layer_spec import LayerKind
from serving.models.loader import load_model
from serving.models.registry import get_model_class
from serving.structs.forward_batch import ForwardBatch

ATOL = 1e-4
PAGE_SIZE = 4
WINDOW = 6
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
              sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
CASES = {
    "per_type_rope_softcap": dict(final_logit_softcapping=5.0, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 100.0, "factor": 4.0}}),
    "legacy_rope_keys_untied": dict(rope_theta=1_000_000.0, rope_local_base_freq=50.0, tie_word_embeddings=False),
}
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


def _randomize(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.3 if "norm" in name else 0.15) * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(Gemma3TextConfig(**{**COMMON, **CASES[request.param]}, attn_implementation="eager"))
    hf = hf.float().eval()
    _randomize(hf)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    if request.param.startswith("legacy"):  # config.json as transformers 4 wrote it (Google's on the Hub)
        raw = json.loads((path / "config.json").read_text())
        del raw["rope_parameters"]
        raw.update(rope_theta=1_000_000.0, rope_local_base_freq=50.0, rope_scaling=None)
        (path / "config.json").write_text(json.dumps(raw))
    return path, hf


class Runner:
    """Our model + KV pool + shuffled pages for a few sequences."""

    def __init__(self, path: Path, backend: str = "torch", num_pages: int = 96) -> None:
        self.model, self.cfg = load_model(path)
        self.pool = DeviceKVPool(self.cfg.kv_layout(torch.float32), num_pages, PAGE_SIZE, "cpu")
        self.attn = get_attention_backend(backend)
        self.free = list(range(1, num_pages))
        random.Random(0).shuffle(self.free)
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, new: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        seqs = []
        for sid, ids in new.items():
            prefix = self.lens.get(sid, 0)
            pages = self.pages.setdefault(sid, [])
            while len(pages) * PAGE_SIZE < prefix + len(ids):
                pages.append(self.free.pop())
            seqs.append((ids, prefix, list(pages)))
            self.lens[sid] = prefix + len(ids)
        logits = self.model(ForwardBatch.build(seqs, PAGE_SIZE), self.pool, self.attn)
        return dict(zip(new, logits, strict=True))


def _hf_last(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


PROMPTS = {0: [(7 * i) % 250 + 3 for i in range(37)], 1: [7, 8], 2: [100, 5, 6, 200, 9, 1, 2, 3, 4, 17, 18, 19, 20],
           3: [42] * 21}
BACKENDS = ["torch"] + (["cpu"] if cpu_ext.extension() is not None else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_prefix_and_decode_logits_match_hf(checkpoint, backend: str) -> None:
    path, hf = checkpoint
    run = Runner(path, backend)
    split = {0: 17, 1: 1, 2: 5, 3: 20}  # the second step starts inside a window (and at a page boundary)
    first = run.step({sid: PROMPTS[sid][: split[sid]] for sid in PROMPTS})
    for sid, logits in first.items():
        torch.testing.assert_close(logits, _hf_last(hf, PROMPTS[sid][: split[sid]]), atol=ATOL, rtol=0)
    out = run.step({sid: PROMPTS[sid][split[sid]:] for sid in PROMPTS})
    seqs = {sid: list(ids) for sid, ids in PROMPTS.items()}
    for _ in range(4):
        for sid, logits in out.items():
            torch.testing.assert_close(logits, _hf_last(hf, seqs[sid]), atol=ATOL, rtol=0)
            seqs[sid].append(int(logits.argmax()))
        out = run.step({sid: [ids[-1]] for sid, ids in seqs.items()})  # a decode batch


def test_the_window_is_read(checkpoint) -> None:
    """Changing a key just outside every sliding window changes nothing a sliding layer reads, but the
    full layers see it: the logits differ; a key before the window in a sliding-only model: identical."""
    path, _ = checkpoint
    run = Runner(path)
    ids = PROMPTS[0][:24]
    run.step({0: ids})
    stack = run.model.layer_stack
    assert stack.windows == (WINDOW, WINDOW, None, WINDOW, WINDOW, None)
    before = run.step({0: [5]})[0]
    run.lens[0] -= 1
    for j, w in enumerate(stack.windows):
        if w is not None:  # position 0, far outside the window of position 24: no sliding layer sees it
            run.pool.k_buffers[j][run.pages[0][0], 0] += 3.0
    torch.testing.assert_close(run.step({0: [5]})[0], before, atol=0, rtol=0)
    run.lens[0] -= 1
    run.pool.k_buffers[stack.kv_index(2)][run.pages[0][0], 0] += 3.0  # a full layer sees it
    assert not torch.allclose(run.step({0: [5]})[0], before, atol=ATOL)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3")
    ps = prompts(3, 512, seed=11, lo=48, hi=64)  # 6-8 windows long
    return path, ps, hf_greedy(path, ps, GREEDY["max_new_tokens"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_matches_hf_cold(tiny, backend: str) -> None:
    path, ps, ref = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, attention_backend=backend)
    try:
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_config_and_layer_stack(tmp_path) -> None:
    cfg = ModelArchConfig.from_dict({**COMMON, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                                     **CASES["per_type_rope_softcap"]})
    assert cfg.rope_theta == 100.0 and cfg.rope_scaling.rope_type == "linear"  # the full layers'
    sliding = cfg.for_layer_type("sliding_attention")
    assert sliding.rope_theta == 10_000.0 and sliding.rope_scaling is None
    with pytest.raises(ValueError, match="no 'linear_attention' entry"):
        cfg.for_layer_type("linear_attention")
    assert get_model_class(cfg.architectures).__name__ == "Gemma3ForCausalLM"
    default = ModelArchConfig.from_dict({**COMMON, "layer_types": None, "num_hidden_layers": 12})
    kinds = [s.kind for s in gemma3_layer_stack(default).specs]
    assert kinds == ([LayerKind.SLIDING] * 5 + [LayerKind.FULL]) * 2  # HF's default: every 6th full
    with pytest.raises(ValueError, match="bidirectional"):
        gemma3_layer_stack(ModelArchConfig.from_dict({**COMMON, "use_bidirectional_attention": True}))
    # transformers 4's keys: rope_theta and rope_scaling for the full layers, rope_local_base_freq the sliding ones
    legacy = {**COMMON, "architectures": ["Gemma3ForCausalLM"], "rope_theta": 1e6, "rope_local_base_freq": 50.0,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    model, _ = load_model(tmp_path, load_format="dummy")
    base = torch.arange(0, 16, 2).float() / 16
    torch.testing.assert_close(model.rotary[LayerKind.SLIDING].inv_freq, 1.0 / 50.0**base)
    torch.testing.assert_close(model.rotary[LayerKind.FULL].inv_freq, 1.0 / 1e6**base / 8.0)
    from serving.kernels.cpu_decoder import FusedDecoder

    fused, why = FusedDecoder.build(model)  # the fused C++ decoder computes Llama blocks only
    assert fused is None and "not Llama blocks" in why
    # the dummy load: Gemma's norms at w = 0 (a scale of 1)
    (tmp_path / "config.json").write_text(json.dumps({**COMMON, "architectures": ["Gemma3ForCausalLM"]}))
    model, _ = load_model(tmp_path, load_format="dummy")
    assert all(float(p.abs().max()) == 0.0 for n, p in model.named_parameters() if n.endswith("norm.weight"))
