"""The container engine behind the containerized runs (`run_local --runner docker`) and `make test-containers`:
the Docker API that kfp.local.DockerRunner and the docker SDK talk to, and the images `make images` built.

    with docker_api():            # $DOCKER_HOST, else a Docker daemon's socket, else `podman system service`
        require_images([BASE_IMAGE, TRAIN_IMAGE])

Where no Docker daemon runs, `podman system service` serves the same API on a unix socket in a temporary
folder for the duration of the block (podman and its configuration come from scripts/setup-system.sh
containers).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DOCKER_SOCKET = Path("/var/run/docker.sock")


class ContainerError(RuntimeError):
    pass


def _answers(url: str) -> bool:
    import docker

    try:
        client = docker.DockerClient(base_url=url, timeout=5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except docker.errors.DockerException:
        return False


@contextlib.contextmanager
def docker_api(timeout_s: float = 60.0) -> Iterator[str]:
    """Yield the URL of a Docker API, with DOCKER_HOST set to it inside the block (docker.from_env reads it)."""
    url = os.environ.get("DOCKER_HOST") or (f"unix://{DOCKER_SOCKET}" if DOCKER_SOCKET.exists() else "")
    if url and _answers(url):
        with _docker_host(url):
            yield url
        return
    podman = shutil.which("podman")
    if podman is None:
        raise ContainerError(
            f"no Docker API at {url or 'DOCKER_HOST or ' + str(DOCKER_SOCKET)} and no podman to serve one: "
            "run scripts/setup-system.sh containers"
        )
    with tempfile.TemporaryDirectory(prefix="gr2-podman-") as tmp:
        url = f"unix://{tmp}/podman.sock"
        proc = subprocess.Popen(
            [podman, "system", "service", "--time=0", url],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + timeout_s
            while not _answers(url):
                if proc.poll() is not None:
                    raise ContainerError(
                        f"podman system service exited: {proc.stderr.read() if proc.stderr else ''}"
                    )
                if time.monotonic() > deadline:
                    raise ContainerError(
                        f"podman system service did not answer on {url} within {timeout_s} s"
                    )
                time.sleep(0.2)
            with _docker_host(url):
                yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def _docker_host(url: str) -> Iterator[None]:
    old = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = url
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = old


def engine(client) -> str:
    """The CLI of the engine behind the Docker API `client` talks to: `podman` for podman's service (which calls
    itself "Podman Engine"), else `docker`. scripts/images.sh tells them apart the same way."""
    names = [c.get("Name", "") for c in client.version().get("Components", [])]
    return "podman" if any("podman" in n.lower() for n in names) else "docker"


def require_images(refs: list[str]) -> dict[str, dict]:
    """Each image's configuration ({"User", "Entrypoint", ...}); a clear error naming `make images` when one is
    missing (kfp.local would try to pull it from a registry instead)."""
    import docker

    client = docker.from_env()
    try:
        out, missing = {}, []
        for ref in dict.fromkeys(refs):
            try:
                out[ref] = client.images.get(ref).attrs["Config"]
            except docker.errors.ImageNotFound:
                missing.append(ref)
    finally:
        client.close()
    if missing:
        raise ContainerError(f"images not built here: {missing}; build them with `make images`")
    return out


@contextlib.contextmanager
def docker_runner(pipeline_root: Path, dataset: str, artifact_root: Path) -> Iterator[tuple[Any, str]]:
    """A kfp.local.DockerRunner for the images the compiled pipeline names (components/_image.py), and the
    dataset argument as the steps see it. The steps run as the images' user with no network (nothing can be
    installed or fetched at run time); the pipeline root (kfp.local mounts it read-write at the same path) and
    the local artifact store (`artifact_root`, mounted read-write at the same path) are handed to that user,
    and the dataset (a path, or a name under the data root) is mounted read-only at the same path."""
    import docker
    from kfp import local
    from kfp.local import docker_task_handler

    from components._image import BASE_IMAGE, TRAIN_IMAGE
    from gr2.data import data_root

    artifact_root = artifact_root.resolve()
    artifact_root.mkdir(parents=True, exist_ok=True)
    mounts, env = [], {"GR2_ARTIFACT_ROOT": str(artifact_root)}
    if Path(dataset).exists():
        dataset = str(Path(dataset).resolve())
        mounts.append(dataset)
    elif (data_root() / dataset).is_dir():
        env["GR2_DATA_ROOT"] = str(data_root().resolve())
        mounts.append(env["GR2_DATA_ROOT"])
    else:  # e.g. ml-100k, which ingest downloads: the steps have no network
        raise ContainerError(
            f"dataset {dataset!r}: the docker runner takes a folder or a name under {data_root()} "
            "(its steps run without network)"
        )
    with docker_api():
        configs = require_images([BASE_IMAGE, TRAIN_IMAGE])
        users = {str(c.get("User") or "0").split(":")[0] for c in configs.values()}
        if len(users) != 1 or not users <= {u for u in users if u.isdigit()}:
            raise ContainerError(
                f"the images run as different or named users {users}: one numeric uid expected"
            )
        uid = int(users.pop())
        try:
            os.chown(pipeline_root, uid, -1)
            for path in [artifact_root, *artifact_root.rglob("*")]:
                os.chown(path, uid, -1)
        except PermissionError as e:
            raise ContainerError(f"cannot hand {pipeline_root} to the images' user (needs root): {e}") from e
        runner = local.DockerRunner(
            mounts=[docker.types.Mount(target=m, source=m, type="bind", read_only=True) for m in mounts]
            + [docker.types.Mount(target=str(artifact_root), source=str(artifact_root), type="bind")],
            environment=env,
            network_mode="none",
        )
        handler = docker_task_handler.run_docker_container
        docker_task_handler.run_docker_container = run_container
        try:
            yield runner, dataset
        finally:
            docker_task_handler.run_docker_container = handler


def run_container(client, image: str, command: list[str], volumes: dict, **container_run_args) -> int:
    """kfp.local's run_docker_container, but the exit status is read before the container is removed. kfp's own
    starts it with auto_remove and then asks for the status: podman has removed the container by then, and kfp
    reads the missing container as success, so a failed step passed (kubeflow/pipelines#13332)."""
    print(f"Found image {image!r}\n")  # require_images checked; kfp.local's own log line, which tests read
    container = client.containers.run(
        image=image,
        command=command,
        detach=True,
        stdout=True,
        stderr=True,
        volumes=volumes,
        **container_run_args,
    )
    try:
        for line in container.logs(stream=True, follow=True):
            print(line.decode(), end="")
        return int(container.wait()["StatusCode"])
    finally:
        container.remove(force=True)
