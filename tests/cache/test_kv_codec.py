"""Lower-tier KV encodings (hicache.tiers.kv_codec): idempotence, encoded L2 pages, the L3
trailer's encoding field, transcoding between tiers, capacity, and the flags' validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.config import CacheConfig
from hicache.tiers.device import KVLayout
from hicache.tiers.host import EncodedHostPool, host_num_pages, make_host_pool
from hicache.tiers.kv_codec import ENCODINGS, get_encoding, round_trip_encoding
from hicache.tiers.page_codec import TRAILER_SIZE, PageCodec
from hicache.tiers.storage import StorageTier, make_storage
from serving.config import EngineConfig, ModelConfig
from serving.kernels.page_copy import device_to_host, host_to_device
from serving.runner.model_runner import resolve_kv_dtype

LOSSY = ["fp8", "int8"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rows(seed: int, log_scales: list[float], dtype: torch.dtype) -> torch.Tensor:
    """Rows of 64 values, each row at its own magnitude; some rows zero, one with a single spike."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(log_scales), 3, 64, generator=g, dtype=torch.float64)
    x *= torch.tensor([10.0**s for s in log_scales], dtype=torch.float64)[:, None, None]
    x[0] = 0
    x[-1, 0] = 0
    x[-1, 0, 5] = 10.0 ** log_scales[-1]
    fi = torch.finfo(dtype)
    return x.clamp(-fi.max / 2, fi.max / 2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LOSSY)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       log_scales=st.lists(st.floats(-45, 37), min_size=2, max_size=12))
def test_reencoding_what_came_back_gives_the_same_bytes(name, dtype, seed, log_scales):
    enc = get_encoding(name)
    fi = torch.finfo(dtype)
    lo, hi = torch.log10(torch.tensor(fi.tiny)).item() - 3, torch.log10(torch.tensor(fi.max)).item() - 1
    x = _rows(seed, [min(max(s, lo), hi) for s in log_scales], dtype)
    codes, exps = enc.quantize(x)
    y = enc.dequantize(codes, exps, dtype)
    assert torch.isfinite(y).all()
    codes2, exps2 = enc.quantize(y)
    assert torch.equal(codes2.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(exps2, exps)
    assert torch.equal(enc.round_trip(y), y)  # L1's values survive any number of tier trips
    # the error is that of one rounding step at the row's scale (or below the scale's floor)
    xf, yf = x.double(), y.double()
    amax = xf.abs().amax(-1, keepdim=True)
    step = amax / enc.qmax * 2 if name == "int8" else (xf.abs() / 8).clamp_min(amax / enc.qmax / 2**8)
    floor = 2.0 ** (enc.emin(dtype) - enc.code_lsb)
    assert ((yf - xf).abs() <= step + floor).all()


def test_fp8_row_that_rounds_down_to_half_range_is_canonical():
    """225 rounds to the fp8 code 224 = 448 / 2 at scale 1: without canonicalisation its decoded
    value would re-encode at scale 1/2 (other bytes, same value)."""
    enc = get_encoding("fp8")
    x = torch.zeros(1, 8)
    x[0, 0] = 225.0
    codes, exps = enc.quantize(x)
    assert int(exps[0]) == -1 and codes.float()[0, 0] == 448.0
    codes2, exps2 = enc.quantize(enc.dequantize(codes, exps, torch.float32))
    assert torch.equal(exps2, exps) and torch.equal(codes2.view(torch.uint8), codes.view(torch.uint8))


@pytest.mark.parametrize("layout_name", ["layer_first", "page_first"])
@pytest.mark.parametrize("name", LOSSY)
def test_encoded_host_pool_gives_back_the_round_trip_and_keeps_bytes(name, layout_name):
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    kv = torch.randn(2, 3, 10, 4, 2, 8) * torch.logspace(-3, 3, 10)[None, None, :, None, None, None]
    host = make_host_pool(layout_name, lay, 12, 4, name)
    assert isinstance(host, EncodedHostPool) and host.encoding == name
    device_to_host(kv, host, [7, 2, 5], [0, 11, 3])
    back = torch.zeros_like(kv)
    host_to_device(host, back, [0, 11, 3], [1, 2, 3])
    enc = get_encoding(name)
    for d, s in ((1, 7), (2, 2), (3, 5)):
        assert torch.equal(back[:, :, d], enc.round_trip(kv[:, :, s]))
    before = host.buffer.clone()
    device_to_host(back, host, [1, 2, 3], [0, 11, 3])  # pages that came back, stored again
    assert torch.equal(host.buffer, before)
    host.allocator.alloc(12)
    host.check_integrity()
    host.buffer[0, -1] = 0x80  # an exponent of -128: below any floor
    with pytest.raises(AssertionError, match="exponent"):
        host.check_integrity()


@pytest.mark.parametrize(("dtype", "at_least"), [(torch.float32, 3.9), (torch.bfloat16, 1.9)])
def test_compact_pages_take_a_half_or_a_quarter_and_l2_holds_more(dtype, at_least):
    lay = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=dtype)  # SmolLM2-135M
    raw = ENCODINGS["raw"].page_nbytes(lay, 16)
    for name in LOSSY:
        small = get_encoding(name).page_nbytes(lay, 16)
        assert raw / small >= at_least
        assert host_num_pages(100, raw, 2.0, 0.0, small) == 200 * raw // small  # the same bytes as raw
        assert host_num_pages(100, raw, 2.0, 0.01, small) == int(0.01 * 2**30) // small
    assert host_num_pages(100, raw, 2.0, 0.0, raw) == 200


def test_trailer_records_the_encoding_and_raw_values_keep_their_old_bytes():
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    raw = PageCodec(lay, 4)
    value = raw.encode("ab" * 16, bytes(raw.page_nbytes))
    assert value[raw.page_nbytes + 56:] == bytes(8)  # the encoding field is 0 for raw: as before encodings
    fp8, int8 = PageCodec(lay, 4, "fp8"), PageCodec(lay, 4, "int8")
    assert fp8.page_nbytes == int8.page_nbytes < raw.page_nbytes
    v8 = fp8.encode("ab" * 16, bytes(fp8.page_nbytes))
    assert fp8.verify(v8, "ab" * 16)
    assert not int8.verify(v8, "ab" * 16)  # same size, same checksum: only the encoding differs
    assert not raw.verify(v8, "ab" * 16)
    assert len(v8) == fp8.page_nbytes + TRAILER_SIZE


def _pool(name, layout_name, lay, n=8):
    return make_host_pool(layout_name, lay, n, 4, name)


@pytest.mark.parametrize(("l2", "l3", "layout_name"), [
    ("raw", "fp8", "page_first"), ("fp8", "raw", "page_first"), ("int8", "int8", "page_first"),
    ("int8", "int8", "layer_first"), ("raw", "int8", "layer_first")])
def test_storage_tier_transcodes_between_l2_and_l3_encodings(tmp_path, l2, l3, layout_name):
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    lossy = round_trip_encoding(lay.dtype, l2, l3)
    kv = lossy.round_trip(torch.randn(2, 2, 6, 4, 2, 8))  # what L1 holds in this mode
    src, dst = _pool(l2, layout_name, lay), _pool(l2, layout_name, lay)
    device_to_host(kv, src, list(range(6)), list(range(6)))
    keys = [f"{i:032x}" for i in range(6)]
    tier = StorageTier(make_storage("lmdb", {"path": str(tmp_path / "db"), "capacity_gb": 0.01}), lay, 4, encoding=l3)
    assert tier.batch_set(keys, src, list(range(6))) == 6
    assert tier.batch_get(keys, dst, [2, 3, 4, 5, 6, 7]) == 6
    back = torch.zeros_like(kv)
    host_to_device(dst, back, [2, 3, 4, 5, 6, 7], list(range(6)))
    assert torch.equal(back, kv)
    other = StorageTier(tier.backend, lay, 4, encoding="fp8" if l3 != "fp8" else "int8")
    assert other.batch_get(keys[:1], _pool(l2, layout_name, lay), [0]) == 0  # another encoding: a miss
    assert other.stats()["corrupt"] == 1
    tier.close()


def test_flags_are_validated_with_clear_messages():
    with pytest.raises(ValueError, match="hicache_l2_encoding must be one of raw, fp8, int8"):
        CacheConfig(hicache_l2_encoding="fp4")
    with pytest.raises(ValueError, match="two different lossy encodings"):
        CacheConfig(hicache_l2_encoding="fp8", hicache_l3_encoding="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        ModelConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="keep L1's fp8 bytes"):
        EngineConfig(model=ModelConfig(kv_cache_dtype="fp8_e4m3"), cache=CacheConfig(hicache_l3_encoding="int8"))
    assert resolve_kv_dtype("fp8_e4m3", torch.bfloat16, "triton") is torch.float8_e4m3fn  # Triton upcasts too
    assert resolve_kv_dtype("auto", torch.bfloat16, "triton") is torch.bfloat16
    assert resolve_kv_dtype("fp8_e4m3", torch.float32, "torch") is torch.float8_e4m3fn
    assert CacheConfig(hicache_l3_encoding="int8").kv_round_trip == "int8"
    assert CacheConfig().kv_namespace_suffix == ""
    assert CacheConfig(hicache_l2_encoding="fp8").kv_namespace_suffix == "|kv:fp8:raw"


def test_server_config_names_the_cross_section_conflict():
    from serving.server.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="needs a 16- or 32-bit L1"):
        load_config(None, {"model": {"kv_cache_dtype": "fp8_e4m3"}, "cache": {"hicache_l2_encoding": "int8"}})
    cfg = load_config(None, {"model": {"kv_cache_dtype": "fp8_e4m3"}, "cache": {"hicache_l3_encoding": "raw"}})
    assert cfg.engine.model.kv_cache_dtype == "fp8_e4m3"
