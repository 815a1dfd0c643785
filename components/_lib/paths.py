"""Fixed locations inside the repository (GR2_FEATURE_REPO overrides where an image keeps feature_repo/)."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FEATURE_REPO = Path(os.environ.get("GR2_FEATURE_REPO", REPO_ROOT / "feature_repo"))
LOCAL_FS_YAML = FEATURE_REPO / "feature_store.yaml"
