"""pipelines/containers.py without a container engine (the engine itself: tests/containers, make test-containers)."""

from __future__ import annotations

import pytest

from pipelines.containers import ContainerError, docker_api


def test_no_docker_api_and_no_podman_names_the_setup_step(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/none.sock")
    monkeypatch.setenv("PATH", str(tmp_path))  # no podman on it
    with pytest.raises(
        ContainerError,
        match=r"no Docker API at unix://.*none\.sock and no podman .*setup-system\.sh containers",
    ):
        with docker_api():
            pass
