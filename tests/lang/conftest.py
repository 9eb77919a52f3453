"""The keyed server the language's API backends are tested against (tests/lang/test_lang_openai.py,
tests/lang/test_lang_anthropic.py): a real server over the tiny chat model with an API key, and a
RuntimeEndpoint on it (the native answers the other backends are held to). A module that defines its
own ``server`` fixture uses that one."""

from __future__ import annotations

import pytest

import serving.lang as sgl
from harness.lang_programs import API_KEY, LANG_SERVER_ARGS
from harness.server_utils import running_server


@pytest.fixture(scope="module")
def server(lang_model):
    with running_server(["--model-path", str(lang_model), *LANG_SERVER_ARGS], api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def native(server):
    be = sgl.RuntimeEndpoint(server.url, api_key=API_KEY)
    yield be
    be.shutdown()
