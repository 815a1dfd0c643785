"""Suite-wide test settings."""

from __future__ import annotations

from pathlib import Path

import pytest

# The data slice, the toy model and the predictor, for tests/serving and tests/deploy: registered here, once, so
# that a session running both trains the model and starts the server once.
from tests.serving.support import ml_slice, model_dir, predictor  # noqa: F401

# The fixtures that run server processes (tests/serving, tests/deploy): a test that uses one (directly or through
# another fixture) is a `server` test, which `make test-fast` leaves out.
SERVER_FIXTURES = {"predictor", "transformer", "server", "edge", "revisions", "prometheus"}

# tests/containers build on the images `make images` builds: their own target (`make test-containers`), not part of
# `make test`. They are collected only when named (pytest tests/containers[/...]).
CONTAINERS = Path(__file__).resolve().parent / "containers"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path != CONTAINERS:
        return None
    named = [Path(str(a).split("::")[0]).resolve() for a in config.args]
    return not any(p == CONTAINERS or CONTAINERS in p.parents for p in named)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]):
    """Server tests marked before `-m` deselects; then, after pytest's own grouping of tests by shared fixtures,
    slow (end-to-end) tests first, in their order: under pytest-xdist (`make test` runs `-n auto`) they start at
    once, beside the fast tests, instead of last on a single worker."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
    result = yield
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    return result


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on loopback, one per test session (tests/s3.py)."""
    from tests.s3 import moto_server

    with moto_server() as url:
        yield url
