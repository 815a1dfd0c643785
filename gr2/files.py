"""Small file helpers shared by the data fetchers and the artifact store."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (wheels and model files can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def publish_folder(tmp: Path, target: Path, stats: dict) -> Path:
    """Write `stats` as tmp/stats.json, then put the finished `tmp` folder in the place of `target` (a dataset
    written elsewhere first, so a stopped write never leaves a half folder under its name)."""
    (tmp / "stats.json").write_text(json.dumps(stats, indent=1))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
