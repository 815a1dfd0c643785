"""Fixtures of the container tests (`make test-containers`, never part of `make test`): the Docker API
(pipelines/containers.py: a Docker daemon, or `podman system service`), and the images `make images` built for
this checkout, by the names the compiled pipeline and the manifests give them (components/_image.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from components._image import BASE_IMAGE, SERVE_IMAGE, TRAIN_IMAGE
from pipelines.containers import docker_api, require_images

IMAGES = {"data": BASE_IMAGE, "train-gpu": TRAIN_IMAGE, "serve": SERVE_IMAGE}


@pytest.fixture(scope="session")
def docker_client() -> Iterator:
    import docker

    with docker_api():
        client = docker.from_env(timeout=600)
        try:
            yield client
        finally:
            client.close()


@pytest.fixture(scope="session")
def images(docker_client) -> dict[str, str]:
    """role -> the image reference; fails (naming `make images`) when one is not built."""
    require_images(list(IMAGES.values()))
    return IMAGES


@pytest.fixture(scope="session")
def dag(images, tmp_path_factory) -> dict:
    """The smoke DAG on the `all_shapes` variant (as tests/pipelines/test_local_run.py runs it), twice, side by side:
    `run_local --runner docker` (every step in its image) and `--runner subprocess` (this venv), same data, same
    profile and seed. Returns both run directories and their logs."""
    import json
    import subprocess
    import sys

    from gr2.data import data_root
    from gr2.data.variants import VARIANTS, build_variant
    from tests.components.slices import SLICE_BOUNDS

    v = VARIANTS["all_shapes"]
    missing = [x for x in ("all_shapes", *v.also) if not (data_root() / VARIANTS[x].source).is_dir()]
    assert not missing, f"shared data missing for {missing} under {data_root()}"
    root = tmp_path_factory.mktemp("dag")
    data = build_variant("all_shapes", root / "data", max_users=300)
    args = [
        "--dataset",
        str(data),
        "--profile",
        "smoke",
        "--snapshot-date",
        "2026-01-01",
    ]
    args += ["--bounds-json", json.dumps(SLICE_BOUNDS), "--no-serve-smoke"]
    procs = {}
    try:
        for runner in ("docker", "subprocess"):
            log = root / f"{runner}.log"
            with log.open("w") as f:
                cmd = [
                    sys.executable,
                    "-m",
                    "pipelines.run_local",
                    *args,
                    "--runner",
                    runner,
                    # each its own runs folder, so its own artifact store (<runs>/artifacts): in a shared one the
                    # venv run (root) creates folders the images' user cannot write into (ingest's publish failed)
                    "--runs-dir",
                    str(root / runner),
                    "--run-id",
                    runner,
                ]
                procs[runner] = (subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT), log)
        for runner, (proc, log) in procs.items():
            rc = proc.wait(timeout=3600)
            assert rc == 0, f"run_local --runner {runner} exited {rc}:\n{log.read_text()[-6000:]}"
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {
        "data": data,
        **{runner: root / runner / runner for runner in procs},
        "logs": {runner: log.read_text() for runner, (_, log) in procs.items()},
    }
