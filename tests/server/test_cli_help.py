"""``hicache serve --help``: every flag has a one-line description and, where the field is
enumerated, its allowed values, generated from the config dataclasses; the defaults shown are
the effective ones (a --config file's values where it sets them)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from harness.server_utils import ROOT
from hicache.config_fields import field_choices, field_docs
from serving.launch import cli
from serving.server.config import SECTIONS


def serve_help(*argv: str) -> str:
    out = subprocess.run([sys.executable, "-m", "serving.launch.cli", "serve", *argv, "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={"COLUMNS": "200", "PATH": ""})
    assert out.returncode == 0, out.stderr
    return out.stdout


def flag_help(text: str, flag: str) -> str:
    """The help text of ``flag`` (up to the next flag), whitespace collapsed."""
    m = re.search(rf"^\s+{re.escape(flag)}[ ,=].*?(?=^\s+--|\Z)", text, re.M | re.S)
    assert m, f"{flag} not in --help"
    return " ".join(m.group(0).split())


@pytest.fixture(scope="module")
def plain_help() -> str:
    return serve_help()


def test_every_field_has_a_description():
    for cls in SECTIONS.values():
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__}: fields without a comment: {missing}"


def test_every_flag_shows_its_description_choices_and_default(plain_help):
    parser, dests = cli.build_parser()
    for section, name in dests.values():
        cls = SECTIONS[section]
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        text = flag_help(plain_help, "--" + name.replace("_", "-"))
        first_words = " ".join(field_docs(cls)[name].split()[:3])
        assert first_words in text, (name, text)
        assert "(default: " in text, (name, text)
        choices = field_choices(f)
        if choices:
            assert "{" + ",".join(choices) + "}" in text, (name, text)
    assert "{fcfs,lpm}" in flag_help(plain_help, "--schedule-policy")
    assert "(default: 'lpm')" in flag_help(plain_help, "--schedule-policy")
    assert "{lmdb,mooncake}" in flag_help(plain_help, "--hicache-storage-backend")
    assert "JSON" in flag_help(plain_help, "--hicache-storage-backend-extra-config")


def test_defaults_shown_are_the_config_files(plain_help):
    assert "(default: 0.0)" in flag_help(plain_help, "--hicache-ratio")
    text = serve_help("--config", "configs/l3.yaml")
    assert "(default: 2.0 from configs/l3.yaml)" in flag_help(text, "--hicache-ratio")
    assert "(default: 'timeout' from configs/l3.yaml)" in flag_help(text, "--hicache-storage-prefetch-policy")
    extra = flag_help(text, "--hicache-storage-backend-extra-config")
    assert '"path": ".hicache/l3"' in extra and "from configs/l3.yaml" in extra
    assert "(default: 30000 from configs/l3.yaml)" in flag_help(text, "--port")
    assert "(default: 'info')" in flag_help(text, "--log-level")  # the file does not set it


def test_json_flag_sets_a_mapping():
    args, dests = cli.parse(["serve", "--hicache-storage-backend-extra-config", '{"path": "/tmp/x", "capacity_gb": 2}'])
    assert cli._overrides(args, dests)["cache"]["hicache_storage_backend_extra_config"] == {
        "path": "/tmp/x", "capacity_gb": 2}
