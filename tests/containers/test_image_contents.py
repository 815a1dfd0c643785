"""What each built image holds (`make images`): the lock's versions and nothing else, exactly the role's extras,
the role's modules importing, and the GPU image refusing a CPU torch. These run in the images themselves (they
replaced tests/manifests/test_dockerfile_install.py, which replayed the Dockerfiles' RUN lines in a venv when no
container could run here); tests/manifests/test_images.py still lints the Dockerfiles in `make test`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.containers.support import run_in
from tests.manifests.test_images import EXTRAS, IMAGES, LOCK, pip_installs

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CUDA_ASSERT = "expected a CUDA build of torch"
# The base image's own installers: python:3.11-slim's, and the local Debian base's venv (scripts/base-image.sh).
BASE_PACKAGES = {"pip", "setuptools", "wheel"}
# What each role's steps import: KFP component modules import kfp at the top and gr2/feast/GX inside their bodies,
# so the bodies' gr2 modules are listed too (the third-party packages are imported by each Dockerfile's own
# `python -c` at build time).
ROLE_IMPORTS = {
    "data": [
        "components.ingest",
        "components.feast_apply",
        "components.materialize",
        "components.validate",
        "components.candidates",
        "components.gate",
        "components.deploy",
        "components.canary_analysis",
        "deploy.rollout",
        "deploy.canary",
        "components.artifact_store",
        "pipelines.pipeline",
        "gr2.gate",
        "gr2.metrics",
    ],
    "train-gpu": [
        "components.train_ar_teacher",
        "components.convert_cft",
        "components.distill_on_policy",
        "components.rl",
        "components.evaluate_models",
        "components.evaluate_ablation",
        "components.champion",
        "gr2.train",
        "gr2.teacher",
        "gr2.opd",
        "gr2.rl",
    ],
    "serve": ["serving.predictor", "serving.transformer", "serving.serve_local", "gr2.inference"],
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


PINS = {norm(k.split("[")[0]): v for k, v in LOCK.items()}


def req_name(req: str) -> str:
    return norm(re.match(r"[A-Za-z0-9_.\-]+", req).group(0))


def locked(name: str, version: str) -> bool:
    """The lock's exact pin; torch by its public version (the local label, +cpu or +cu128, is the index's)."""
    lock = PINS.get(name)
    if lock is None:
        return name in BASE_PACKAGES
    return version.split("+")[0] == lock.split("+")[0] if name == "torch" else version == lock


def role_packages(role: str) -> tuple[set[str], set[str]]:
    """(what the role's project install asks for: its extras' requirements and named packages, what only other
    extras and the dev tools would bring)."""
    args = next(a for a in pip_installs(IMAGES[role]) if any(x.startswith(".[") for x in a))
    extras = next(x for x in args if x.startswith(".["))[2:-1].split(",")
    mine = {req_name(r) for e in extras for r in EXTRAS[e]}
    mine |= {norm(a) for a in args if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", a)}
    others = {
        req_name(r) for e, reqs in EXTRAS.items() if e not in extras and e != "all" for r in reqs if "==" in r
    }
    return mine, (others | {"pytest", "ruff", "moto"}) - mine


@pytest.mark.parametrize("role", IMAGES)
def test_image_holds_the_locked_role_environment(role, images, docker_client):
    image = images[role]
    run_in(docker_client, image, ["-m", "pip", "check"], entrypoint=["python"])
    listed = json.loads(
        run_in(docker_client, image, ["-m", "pip", "list", "--format", "json"], entrypoint=["python"])
    )
    installed = {norm(d["name"]): d for d in listed}
    project = installed.pop("diffusion-gr2")
    assert project["version"] == "0.1.0" and not project.get("editable_project_location"), project
    # Every installed distribution is the lock's version; outside the lock only the base's installers.
    wrong = {n: (d["version"], PINS.get(n)) for n, d in installed.items() if not locked(n, d["version"])}
    assert not wrong, f"{role}: installed (version, lock) differ: {wrong}"
    mine, others = role_packages(role)
    assert mine <= set(installed), f"{role}: not installed: {mine - set(installed)}"
    assert not others & set(installed), (
        f"{role}: packages of other extras installed: {others & set(installed)}"
    )


@pytest.mark.parametrize("role", IMAGES)
def test_role_modules_import(role, images, docker_client):
    """From the installed wheel (no PYTHONPATH, outside /app) and as the steps run them (PYTHONPATH=/app)."""
    mods = ", ".join(ROLE_IMPORTS[role])
    run_in(
        docker_client,
        images[role],
        ["-c", f"cd / && env -u PYTHONPATH python -c 'import {mods}' && python -c 'import {mods}'"],
        entrypoint=["sh"],
    )


def images_sh(role: str, **env: str) -> subprocess.CompletedProcess:
    """`scripts/images.sh role` with `env` on top of this environment (TAG: a throwaway tag of the tests' own)."""
    return subprocess.run(
        [str(ROOT / "scripts" / "images.sh"), role],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=1800,
    )


def test_gpu_image_refuses_a_cpu_torch(images):
    """Built here with the lock's CPU torch, the GPU image needs REQUIRE_CUDA=0; by default its own check stops the
    build (the last step only: the layers before it come from the cache)."""
    r = images_sh("train-gpu", REQUIRE_CUDA="1", TAG=images["train-gpu"].rsplit(":", 1)[1] + "-cudacheck")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and CUDA_ASSERT in out and "AssertionError" in out, out[-3000:]


def test_a_rebuild_for_a_new_commit_names_it(images, docker_client):
    """The steps' reports name the commit their image was built from (GR2_GIT_SHA). A new commit that changes no
    copied file rebuilds from the cache but for the last steps, and its image must name the new commit: podman
    4.3's cache once kept the old one (a cached ENV step, keyed without its argument's value), and CI's
    containerized DAG reported the commit before. A fresh value each run, so no earlier run's cache can pass."""
    repo, tag = images["serve"].rsplit(":", 1)
    ref, sha = f"{repo}:{tag}-shacheck", f"shacheck-{uuid.uuid4().hex[:12]}"
    r = images_sh("serve", TAG=f"{tag}-shacheck", GR2_GIT_SHA=sha)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    try:  # the image's configured environment, as each step's container gets it
        assert f"GR2_GIT_SHA={sha}" in docker_client.images.get(ref).attrs["Config"]["Env"]
    finally:
        docker_client.images.remove(ref)
