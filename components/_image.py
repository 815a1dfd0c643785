"""The one setting naming the container image of every component. The compiled pipeline names immutable
references only: `<registry>/gr2:<git sha>` as `make images` tags them (GR2_REGISTRY, GR2_IMAGE_TAG; the tag
defaults to the checkout's `git rev-parse --short HEAD`), or a whole reference such as a pushed digest
(`GR2_IMAGE=registry.example.com/gr2@sha256:... make compile`). Locally, SubprocessRunner(use_venv=False) runs
the components in the current venv; `run_local --runner docker` runs them in these images."""

import os
import subprocess
from pathlib import Path


def _head_sha() -> str:
    """The short sha of this checkout's HEAD (the Makefile's TAG), "untagged" outside a git checkout (an image):
    a reference no registry holds, which the compile test refuses."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "untagged"


REGISTRY = os.environ.get("GR2_REGISTRY", "ghcr.io/diffusion-gr2")
TAG = os.environ.get("GR2_IMAGE_TAG") or _head_sha()
BASE_IMAGE = os.environ.get("GR2_IMAGE", f"{REGISTRY}/gr2:{TAG}")
# Components import gr2/feast/GX inside their bodies; the image has the project installed from the lock file,
# so nothing is pip-installed at run time (air-gapped clusters, docs/DEPENDENCIES.md).
COMPONENT_KWARGS = {"base_image": BASE_IMAGE, "packages_to_install": [], "install_kfp_package": False}

# GPU steps (decoding) run the CUDA image built from images/Dockerfile.train-gpu, same lock, same tag.
TRAIN_IMAGE = os.environ.get("GR2_TRAIN_IMAGE", f"{REGISTRY}/gr2-train-gpu:{TAG}")
GPU_COMPONENT_KWARGS = {**COMPONENT_KWARGS, "base_image": TRAIN_IMAGE}
# The serving image, same tag: the deploy step's serve_image, the container tests (manifests pin their own tag).
SERVE_IMAGE = os.environ.get("GR2_SERVE_IMAGE", f"{REGISTRY}/gr2-serve:{TAG}")
