"""Fixtures of the HTTP frontend tests (test_http_api_*.py): a fake backend behind the real app."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from splitserve.cluster.frontend.http.api import build_http_app
from tests.helpers.http_api import FakeBackend, as_serving_api, tiny_tokenizer


# Package scope: the modules that use it share one tiny checkpoint's tokenizer (it holds no state a
# test changes); modules with their own `tokenizer` fixture keep theirs.
@pytest.fixture(scope="package")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def backend(tokenizer):
    return FakeBackend(tokenizer)


@pytest.fixture
def client(backend):
    with TestClient(build_http_app(as_serving_api(backend)), raise_server_exceptions=False) as c:
        yield c
