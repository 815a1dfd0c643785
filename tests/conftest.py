"""Suite-wide test settings."""

from __future__ import annotations

from pathlib import Path

import pytest

# tests/containers build on the images `make images` builds: their own target (`make test-containers`), not part of
# `make test`. They are collected only when named (pytest tests/containers[/...]).
CONTAINERS = Path(__file__).resolve().parent / "containers"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path != CONTAINERS:
        return None
    named = [Path(str(a).split("::")[0]).resolve() for a in config.args]
    return not any(p == CONTAINERS or CONTAINERS in p.parents for p in named)


@pytest.hookimpl(trylast=True)  # after pytest's own grouping of tests by shared fixtures
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow (end-to-end) tests first, in their order: under pytest-xdist (`make test` runs `-n auto`) they start at
    once, beside the fast tests, instead of last on a single worker."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on loopback, one per test session (tests/s3.py)."""
    from tests.s3 import moto_server

    with moto_server() as url:
        yield url
