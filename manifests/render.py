"""A tiny pure-Python renderer for the kustomize subset this repo uses (kubectl/kustomize need no cluster,
but are not pip-installable, and `kubectl --dry-run` still calls an API server).

Supported kustomization keys: resources (files, or folders holding a kustomization.yaml), namespace,
commonLabels, images (name -> newName/newTag), patches (strategic-merge patch files, matched by
apiVersion/kind/metadata.name). Anything else is an error, so a silently ignored key cannot happen.

Strategic merge, as kustomize does for the fields we use: maps merge recursively; a null value deletes the key;
lists whose items are maps with a `name` (containers, env, volumes, volumeMounts) merge item by item on
`name`; any other list is replaced.

    python -m manifests.render manifests/overlays/prod [--storage-uri s3://...] [--canary 10] [-o out.yaml]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "resources", "namespace", "commonLabels", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
ISVC_KIND = "InferenceService"


class RenderError(ValueError):
    pass


def _load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _key(doc: dict[str, Any]) -> tuple[str, str, str]:
    return doc.get("apiVersion", ""), doc.get("kind", ""), (doc.get("metadata") or {}).get("name", "")


def merge(base: Any, patch: Any) -> Any:
    """Strategic-merge `patch` into `base` (returns a new object)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in base + patch)
    ):
        out = [copy.deepcopy(x) for x in base]
        index = {x["name"]: i for i, x in enumerate(out)}
        for item in patch:
            if item["name"] in index:
                out[index[item["name"]]] = merge(out[index[item["name"]]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _set_images(node: Any, images: list[dict[str, str]]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "image" and isinstance(v, str):
                name = v.rsplit(":", 1)[0] if ":" in v.rsplit("/", 1)[-1] else v
                for img in images:
                    if img["name"] == name:
                        tag = img.get("newTag", v[len(name) + 1 :] if len(v) > len(name) else "latest")
                        node[k] = f"{img.get('newName', name)}:{tag}"
            else:
                _set_images(v, images)
    elif isinstance(node, list):
        for x in node:
            _set_images(x, images)


def build(path: str | Path) -> list[dict[str, Any]]:
    """Render the kustomization in folder `path` into a list of documents."""
    path = Path(path)
    kfile = path / "kustomization.yaml"
    if not kfile.is_file():
        raise RenderError(f"{kfile}: missing")
    k = yaml.safe_load(kfile.read_text()) or {}
    unknown = sorted(set(k) - KNOWN_KEYS)
    if unknown:
        raise RenderError(f"{kfile}: unsupported key(s) {unknown} (this renderer knows {sorted(KNOWN_KEYS)})")
    docs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        rp = path / res
        docs.extend(build(rp) if rp.is_dir() else _load_docs(rp))
    for p in k.get("patches", []):
        if set(p) != {"path"}:
            raise RenderError(f"{kfile}: patches entries must be {{path: file}} (strategic merge), got {p}")
        for patch in _load_docs(path / p["path"]):
            matches = [i for i, d in enumerate(docs) if _key(d) == _key(patch)]
            if len(matches) != 1:
                raise RenderError(
                    f"{path / p['path']}: patch target {_key(patch)} matched {len(matches)} documents"
                )
            docs[matches[0]] = merge(docs[matches[0]], patch)
    for d in docs:
        meta = d.setdefault("metadata", {})
        if k.get("namespace") and d.get("kind") not in CLUSTER_SCOPED:
            meta["namespace"] = k["namespace"]
        if k.get("commonLabels"):
            meta["labels"] = {**(meta.get("labels") or {}), **k["commonLabels"]}
        if k.get("images"):
            _set_images(d, k["images"])
    return docs


def set_rollout(
    docs: list[dict[str, Any]], storage_uri: str | None = None, canary_percent: int | None = None
) -> None:
    """Point the InferenceService at a model (STORAGE_URI env of the predictor) and set/remove the canary.

    canary_percent None leaves the overlay's value; -1 removes the field (promote: all traffic to latest).
    """
    isvcs = [d for d in docs if d.get("kind") == ISVC_KIND]
    if len(isvcs) != 1:
        raise RenderError(f"expected one {ISVC_KIND}, found {len(isvcs)}")
    pred = isvcs[0]["spec"]["predictor"]
    if storage_uri is not None:
        container = next(c for c in pred["containers"] if c["name"] == "kserve-container")
        env = [e for e in container.get("env", []) if e["name"] != "STORAGE_URI"]
        container["env"] = [{"name": "STORAGE_URI", "value": storage_uri}, *env]
    if canary_percent is not None:
        if canary_percent == -1:
            pred.pop("canaryTrafficPercent", None)
        elif 0 <= canary_percent <= 100:
            pred["canaryTrafficPercent"] = canary_percent
        else:
            raise RenderError(
                f"canary_percent must be within [0, 100] (or -1 to remove), got {canary_percent}"
            )


def to_yaml(docs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Render a kustomization (subset) without kubectl.")
    ap.add_argument("path")
    ap.add_argument("--storage-uri")
    ap.add_argument("--canary", type=int)
    ap.add_argument("-o", "--output")
    a = ap.parse_args(argv)
    docs = build(a.path)
    set_rollout(docs, a.storage_uri, a.canary)
    text = to_yaml(docs)
    if a.output:
        Path(a.output).write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
