"""The C++ CPU op variants this machine runs (serving.kernels.cpu_ext), as a pytest fixture: a test
that takes ``ext`` runs once per variant (avx2 and scalar on an AVX2 machine; avx512vnni too where
the CPU has it), each checked against the same torch twin."""

from __future__ import annotations

import pytest

from serving.kernels import cpu_ext

VARIANTS = [v.name for v in cpu_ext.runnable()]


@pytest.fixture(params=VARIANTS)
def ext(request):
    mod = cpu_ext.build(request.param)
    if mod is None:
        pytest.skip(f"variant {request.param} did not build: {cpu_ext.build_error(request.param)}")
    assert mod.variant == request.param
    return mod
