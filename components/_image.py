"""The one setting naming the container image of every component (a registry prefix and tag are build-time
parameters: `GR2_IMAGE=registry.example.com/gr2:<git sha> make compile`). Locally (kfp.local
SubprocessRunner(use_venv=False)) the image is not used: components run in the current venv."""

import os

BASE_IMAGE = os.environ.get("GR2_IMAGE", "ghcr.io/diffusion-gr2/gr2:latest")
# Components import gr2/feast/GX inside their bodies; the image has the project installed from the lock file,
# so nothing is pip-installed at run time (air-gapped clusters, docs/DEPENDENCIES.md).
COMPONENT_KWARGS = {"base_image": BASE_IMAGE, "packages_to_install": [], "install_kfp_package": False}

# GPU steps (training, decoding) run the CUDA image built from images/Dockerfile.train-gpu, same lock, same tag.
TRAIN_IMAGE = os.environ.get("GR2_TRAIN_IMAGE", BASE_IMAGE.replace("/gr2:", "/gr2-train-gpu:"))
GPU_COMPONENT_KWARGS = {**COMPONENT_KWARGS, "base_image": TRAIN_IMAGE}
