"""``--quantization auto`` that resolves to fp32 is fp32 everywhere: the same L3 namespace as an
explicit ``none`` (the resolved mode has one owner, the loaded model), and the server reports it."""

from __future__ import annotations

import pytest

from harness.model_utils import tiny_model
from serving.engine import Engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("auto-ns"))


def namespace(path, db, quantization: str) -> tuple[str, str]:
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=256, hicache_ratio=2.0,
                 quantization=quantization, hicache_storage_backend="lmdb",
                 hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1})
    try:
        return eng.core.storage.writeback.namespace, eng.core.runner.model.quantization
    finally:
        eng.shutdown()


def test_auto_resolved_to_fp32_keys_l3_as_fp32(tiny, tmp_path, monkeypatch):
    from serving.models import loader

    monkeypatch.setattr(loader, "resolve_quantization",
                        lambda name, device, path=None: "none" if name == "auto" else name)
    auto_ns, mode = namespace(tiny, tmp_path / "a", "auto")
    none_ns, _ = namespace(tiny, tmp_path / "b", "none")
    assert mode == "none"
    assert auto_ns == none_ns and "|q:" not in auto_ns, (auto_ns, none_ns)
