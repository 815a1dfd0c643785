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


def test_docker_runner_wants_a_dataset_it_can_mount(tmp_path):
    """The steps run without network: a dataset that ingest would download (ml-100k) is refused before any
    container starts."""
    from pipelines.containers import docker_runner

    with pytest.raises(ContainerError, match=r"dataset 'ml-100k': the docker runner takes a folder"):
        with docker_runner(tmp_path, "ml-100k", tmp_path / "artifacts"):
            pass
