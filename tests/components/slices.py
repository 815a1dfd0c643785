"""Small real data slices shared by the components / feature_repo / pipelines tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from gr2.data.dataset import data_root

SLICE_DATASET = "ml-latest-small"
SLICE_USERS = 40  # first 40 users by id: ~5k interactions, a few hundred retrieval-hit lists
# Row-count bounds for a slice this small (the defaults are for whole datasets).
SLICE_BOUNDS = {"min_examples": 10}


def require_slice() -> Path:
    path = data_root() / SLICE_DATASET
    if not (path / "interactions.tsv").exists():
        pytest.skip(f"{path} not available")
    return path


def ingest_slice(out: Path, history_len_profile: str = "quick") -> Path:
    """Write the sources folder of the slice (steps.ingest: event times, user_history, item_features)."""
    from components._lib import steps

    steps.ingest(str(require_slice()), out, history_len_profile, "2026-01-01", SLICE_USERS)
    return out


def examples_slice(root: Path, profile: str = "quick") -> tuple[Path, Path]:
    """The slice's sources folder and its re-ranking examples (leave-one-out targets through the retriever):
    (sources dir, examples parquet)."""
    from components._lib import sources, steps
    from gr2.data.split import build_targets

    src = ingest_slice(root / "sources")
    targets = build_targets(sources.read_dataset(src, event_ts=False), 20)
    targets.to_parquet(root / "targets.parquet", index=False)
    steps.candidates(src, root / "targets.parquet", root / "examples.parquet", profile)
    return src, root / "examples.parquet"


def malformed_slice(out: Path) -> Path:
    """`out` holding users 1 and 2 of the slice with user 1's seq_idx going down (its rows 3 and 4 swapped): data the
    loader refuses at ingest, naming file, line and column."""
    import pandas as pd

    inter = pd.read_csv(require_slice() / "interactions.tsv", sep="\t", dtype=str, keep_default_na=False)
    inter = inter[inter["user_id"].isin(["1", "2"])].reset_index(drop=True)
    inter.loc[[3, 4], "seq_idx"] = inter.loc[[4, 3], "seq_idx"].to_numpy()
    out.mkdir()
    inter.to_csv(out / "interactions.tsv", sep="\t", index=False)
    return out
