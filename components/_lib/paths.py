"""Fixed locations inside the repository (GR2_FEATURE_REPO overrides where an image keeps feature_repo/)."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FEATURE_REPO = Path(os.environ.get("GR2_FEATURE_REPO", REPO_ROOT / "feature_repo"))
LOCAL_FS_YAML = FEATURE_REPO / "feature_store.yaml"


def repo_relative(obj):
    """Committed reports carry no machine paths: every path under the repository root, anywhere in a string
    (a model card's text too), becomes relative to it (recursively through dicts and lists); other values are
    returned unchanged."""
    prefix = str(REPO_ROOT) + os.sep
    if isinstance(obj, str):
        return obj.replace(prefix, "")
    if isinstance(obj, dict):
        return {k: repo_relative(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [repo_relative(v) for v in obj]
    return obj
