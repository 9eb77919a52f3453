"""``--quantization int4`` on the converted SmolLM2 takes the GGUF's own Q4_1 blocks
(serving/models/quant/gguf_q4.py): every projection's blocks, dequantized, are the converted
float weights; their codes are the ones int4 recovers from those weights; the loaded model uses
them (its kernel tensors equal the blocks' packing) and answers like the recovered-codes model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from harness.model_utils import smollm2_path
from serving.kernels.cpu_int4 import pack
from serving.models.loader import load_model
from serving.models.quant.gguf_index import read_tensors
from serving.models.quant.gguf_q4 import gguf_source, int4_groups
from serving.models.quant.int4 import quantize_int4_groups

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    path = smollm2_path()
    gguf = gguf_source(path)
    if gguf is None:
        pytest.skip("the SmolLM2 GGUF is not installed")
    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys() if ".layers." in k}  # noqa: SIM118
    return path, gguf, weights


def test_tensor_table_is_gguf_readers(smol):
    """serving.models.quant.gguf_index reads the same tensors as the gguf package's reader (which
    also parses every metadata value: seconds on SmolLM2's tokenizer)."""
    from gguf import GGUFReader

    _, gguf, _ = smol
    ours = {t.name: t for t in read_tensors(gguf)}
    theirs = GGUFReader(str(gguf)).tensors
    assert len(ours) == len(theirs) > 0
    for t in theirs:
        o = ours[t.name]
        assert o.type_name == t.tensor_type.name and list(o.shape) == [int(x) for x in t.shape], t.name
        assert np.array_equal(np.asarray(o.data).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)), t.name


def test_blocks_are_the_converted_weights_and_their_codes(smol):
    path, gguf, weights = smol
    groups = int4_groups(gguf, 9, 3)
    assert groups is not None and len(groups) == 4 * 30
    for layer in (0, 17, 29):
        pre = f"model.layers.{layer}"
        for fused, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             ("self_attn.o_proj", ("self_attn.o_proj",)), ("mlp.gate_up_proj", ("mlp.gate_proj",
                                                                                                "mlp.up_proj")),
                             ("mlp.down_proj", ("mlp.down_proj",))):
            w = torch.cat([weights[f"{pre}.{p}.weight"] for p in parts]).float()
            codes, d, m = groups[f"{pre}.{fused}"]  # d, m [N, K/32]
            deq = codes.reshape(w.shape[0], -1, 32).float() * d[..., None] + m[..., None]
            torch.testing.assert_close(deq.reshape(w.shape), w, rtol=0, atol=1e-6)
            assert torch.equal(codes, quantize_int4_groups(w)[0]), f"{pre}.{fused}"


def test_the_loaded_model_uses_the_blocks(smol):
    path, gguf, _ = smol
    direct, _ = load_model(path, quantization="int4")
    groups = int4_groups(gguf, 9, 3)
    lin = direct.model.layers[3].mlp.gate_up_proj
    assert torch.equal(lin.q["packed"], pack(*groups["model.layers.3.mlp.gate_up_proj"]))
    ids = torch.tensor([1, 4093, 28, 339, 1234, 17, 604])
    from hicache.tiers.device import DeviceKVPool
    from serving.kernels.attention import get_attention_backend
    from serving.structs.forward_batch import ForwardBatch

    def logits(model, cfg):
        pool = DeviceKVPool(cfg.kv_layout(torch.float32), 2, 16, "cpu")
        return model(ForwardBatch.build([(ids.tolist(), 0, [1])], 16), pool, get_attention_backend("torch"))

    _, cfg = load_model(path, load_format="dummy")
    out = logits(direct, cfg)
    import serving.models.quant.gguf_q4 as g

    orig, g.int4_groups = g.int4_groups, lambda *a: None  # the recovered-codes path
    try:
        recovered, _ = load_model(path, quantization="int4")
    finally:
        g.int4_groups = orig
    ref = logits(recovered, cfg)
    assert out.argmax(-1).tolist() == ref.argmax(-1).tolist()
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-3)


def test_a_gguf_cut_short_is_named_and_int4_quantizes_the_weights_instead(smol, tmp_path, caplog):
    path, gguf, _ = smol
    cut = tmp_path / "cut.gguf"
    with open(gguf, "rb") as f:
        cut.write_bytes(f.read(gguf.stat().st_size // 2))
    with pytest.raises(ValueError, match=r"cut.gguf: cannot read its GGUF tensor table \(tensor .* past the file"):
        read_tensors(cut)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 8)
    with pytest.raises(ValueError, match="junk.gguf: cannot read its GGUF tensor table"):
        read_tensors(tmp_path / "junk.gguf")
    model = tmp_path / "model"  # the converted folder, its marker naming the cut file
    model.mkdir()
    for f in path.iterdir():
        if f.name != "hicache_convert.json":
            (model / f.name).symlink_to(f)
    (model / "hicache_convert.json").write_text(json.dumps({"source_path": str(cut), "dtype": "float32"}))
    with caplog.at_level("WARNING"):
        m, _ = load_model(model, quantization="int4")
    assert "cut.gguf: cannot read its GGUF tensor table" in caplog.text
    assert m.quant_tag == "int4v3"  # the recovered codes, not the file's blocks
