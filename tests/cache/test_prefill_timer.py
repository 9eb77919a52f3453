"""serving/cache/prefill_timer.py: what the L3 cost model learns as the prefill rate."""

from __future__ import annotations

import time

import pytest
import torch

from serving.cache.prefill_timer import PrefillTimer


def test_cpu_steps_report_the_forward_pass_wall_time():
    seen = []
    t = PrefillTimer(lambda n, s: seen.append((n, s)), torch.device("cpu"))
    t.begin()
    time.sleep(0.02)
    t.end(128)
    t.poll()
    assert len(seen) == 1 and seen[0][0] == 128 and 0.02 <= seen[0][1] < 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_reports_gpu_time_once_the_gpu_is_done_not_the_launch():
    seen = []
    t = PrefillTimer(lambda n, s: seen.append((n, s)), torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    t.begin()
    for _ in range(50):
        a = a @ a / 64
    t.end(4096)
    launched = time.perf_counter()
    t.poll()
    torch.cuda.synchronize()
    gpu_done = time.perf_counter()
    t.poll()
    assert [n for n, _ in seen] == [4096]
    assert seen[0][1] > 0.5 * (gpu_done - launched)  # the GPU's time, not the microseconds of the launch
