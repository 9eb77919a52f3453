"""Every configuration error before anything loads: one line (the value, what is allowed, the
flag), exit status 2, no traceback, no engine started (so no "persist its cache" message).

Each case runs ``hicache serve`` for real in a subprocess; none gets as far as loading a model.
"""

from __future__ import annotations

import os

import pytest

from harness.cli_run import assert_one_line, l3, serve

CASES = {
    "model path": (["--model-path", "models/no-such-model"], ["--model-path", "models/no-such-model", "config.json"]),
    "write policy": (["--hicache-write-policy", "write_sometimes"],
                     ["write_sometimes", "write_through, write_through_selective, write_back",
                      "--hicache-write-policy"]),
    "storage backend": (["--hicache-storage-backend", "s3"], ["'s3'", "lmdb, mooncake", "--hicache-storage-backend"]),
    "schedule policy": (["--schedule-policy", "random"], ["'random'", "fcfs, lpm", "--schedule-policy"]),
    "attention backend": (["--attention-backend", "flash"], ["'flash'", "auto, torch, cpu, triton",
                                                             "--attention-backend"]),
    "tp size": (["--tp-size", "2"], ["--tp-size 2", "9 attention heads", "allowed: 1, 3"]),
    "storage option": (l3("/tmp/unused", capcity_gb=1), ["capcity_gb", "capacity_gb",
                                                        "--hicache-storage-backend-extra-config"]),
    "device": (["--device", "gpu"], ["'gpu'", "cuda:N", "--device"]),
    "eviction policy": (["--eviction-policy", "mru"], ["'mru'", "lru, lfu", "--eviction-policy"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_value_is_one_line_and_exit_2(case):
    args, words = CASES[case]
    assert_one_line(serve(*args), *words)


def test_l3_directory_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert_one_line(serve(*l3(blocker / "l3")), str(blocker / "l3"), "cannot write",
                    "--hicache-storage-backend-extra-config")
    if os.geteuid() != 0:  # root writes a read-only directory anyway; /sys refuses everyone
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        assert_one_line(serve(*l3(ro)), str(ro), "cannot write")
    if not os.access("/sys", os.W_OK) or os.geteuid() == 0:
        assert_one_line(serve(*l3("/sys/hicache-l3")), "/sys/hicache-l3", "cannot write")


def test_unknown_flag_prints_the_serve_usage():
    out = serve("--hicache-rato", "2")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: hicache serve "), out.stderr
    assert "hicache serve: error: unrecognized arguments: --hicache-rato 2" in out.stderr
    assert "{serve,convert,router}" not in out.stderr and "Traceback" not in out.stderr


def test_config_names_match_their_registries():
    """The torch-free name lists the config dataclasses validate against are the registries' names."""
    from hicache import config as hc
    from hicache.tiers.host import HOST_LAYOUTS
    from hicache.tiers.storage import STORAGE_BACKENDS
    from serving import config as sc
    from serving.cache.cost_model import LOAD_POLICIES
    from serving.cache.l3_prefetch import PREFETCH_POLICIES
    from serving.kernels.attention import ATTENTION_BACKENDS
    from serving.models.loader import LOAD_FORMATS
    from serving.runner.model_runner import DTYPES
    from serving.scheduler.schedule_policy import SCHEDULE_POLICIES

    assert hc.HOST_LAYOUTS == tuple(HOST_LAYOUTS) and hc.STORAGE_BACKENDS == tuple(STORAGE_BACKENDS)
    assert hc.LOAD_POLICIES == tuple(LOAD_POLICIES) and hc.PREFETCH_POLICIES == tuple(PREFETCH_POLICIES)
    assert sc.ATTENTION_BACKENDS == ("auto", *ATTENTION_BACKENDS) and sc.DTYPES == ("auto", *DTYPES)
    assert sc.LOAD_FORMATS == tuple(LOAD_FORMATS)
    assert sc.SCHEDULE_POLICIES == tuple(SCHEDULE_POLICIES)
