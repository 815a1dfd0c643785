"""The pipeline's steps as plain functions over folders and files.

One implementation per step: the KFP components (components/*.py), the CLI (pipelines/cli.py) and the tests
all call these. Each takes paths and small parameters, writes its outputs and returns a JSON-able summary.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from components._lib import sources
from components._lib.paths import REPO_ROOT

if TYPE_CHECKING:
    from components._lib.validation import ValidationReport
from gr2.config import Profile, load_profile
from gr2.data.dataset import Dataset, load_dataset, resolve_dataset

DATA_DOCS = "data_docs.html"  # a validation step's Great Expectations Data Docs page
LTR_DIR = "ltr"  # in the evaluate-floor report: the fitted ranker behind its ltr row (gr2/ltr.py LTRModel)


def as_profile(profile: str | Profile) -> Profile:
    """A profile object from a name or path (steps take either)."""
    return profile if isinstance(profile, Profile) else load_profile(profile)


def _slice_users(ds: Dataset, max_users: int) -> Dataset:
    """The first `max_users` users (in id order): a small real slice for smoke tests."""
    if max_users <= 0:
        return ds
    users = sorted(ds.interactions["user_id"].unique())[:max_users]
    inter = ds.interactions[ds.interactions["user_id"].isin(users)].reset_index(drop=True)
    return replace(ds, interactions=inter)


def fit_evidence(ds: Dataset, profile: Profile):
    """gr2.evidence.Evidence fitted on training positions only: its per-item tables go to the item feature view,
    its `sequence` models (profile sequence.folds >= 2) to the sources' `sequence/` folder beside them."""
    from gr2.data.split import train_sequences
    from gr2.evidence import Evidence

    seqs = train_sequences(ds, profile.data.eval_positions)
    return Evidence.fit(seqs, ds.items, profile.evidence, profile.sequence, profile.seed)


def ingest(
    dataset: str,
    out_dir: str | Path,
    profile: str | Profile = "quick",
    snapshot_date: str = "",
    max_users: int = 0,
    cache_dir: str | Path = REPO_ROOT / ".cache",
) -> dict[str, Any]:
    """Load a dataset (name, path, or an event log s3://... read as of `snapshot_date`), compute event times
    and write the sources folder. For an event log, meta.json's `objects` lists every object read, with its
    ETag (components/event_log.py), so the night can be replayed."""
    from gr2.evidence import (
        SEQUENCE_DIR,
    )  # here, as fit_evidence's import: torch stays out of this module's import

    t0 = time.perf_counter()
    prof = as_profile(profile)
    # An unset snapshot date is the run's own UTC date: every night's data is stamped with its real date.
    snapshot_date = snapshot_date or time.strftime("%Y-%m-%d", time.gmtime())
    objects = None
    if dataset.startswith("s3://"):
        from components.event_log import read_event_log

        ds, objects = read_event_log(dataset, snapshot_date)
    else:
        ds = load_dataset(resolve_dataset(dataset, cache_dir))
    ds = _slice_users(ds, max_users)
    evidence = fit_evidence(ds, prof)
    if evidence.sequence is not None:
        evidence.sequence.save(Path(out_dir) / SEQUENCE_DIR)
    meta = sources.write_sources(
        ds,
        out_dir,
        prof.data.history_len,
        evidence.item_tables(),
        snapshot_date,
        prof.data.eval_positions,
        {"source": dataset, "objects": objects} if objects is not None else None,
    )
    meta["seconds"] = round(time.perf_counter() - t0, 2)
    return meta


def feast_apply(
    sources_dir: str | Path, store_dir: str | Path, fs_yaml: str = "", source_uri: str = ""
) -> dict[str, Any]:
    """Apply the feature repo for this sources folder: the registry, no online rows (`materialize`).

    With an environment yaml (`fs_yaml`), `source_uri` is where its offline store reads the sources.
    """
    from components._lib import feast_io

    t0 = time.perf_counter()
    info = feast_io.apply(sources_dir, store_dir, fs_yaml or None, source_uri)
    info["seconds"] = round(time.perf_counter() - t0, 2)
    return info


def materialize(
    sources_dir: str | Path, registry_dir: str | Path, store_dir: str | Path, fs_yaml: str = ""
) -> dict[str, Any]:
    """Fill the online store (what serving reads) from validated sources; locally into `store_dir`."""
    from components._lib import feast_io

    t0 = time.perf_counter()
    info = feast_io.materialize(sources_dir, registry_dir, store_dir, fs_yaml or None)
    info["seconds"] = round(time.perf_counter() - t0, 2)
    return info


def extract(
    sources_dir: str | Path, store_dir: str | Path, out_path: str | Path, fs_yaml: str = ""
) -> dict[str, Any]:
    """Targets (train/val/test, with history) through Feast's point-in-time join; written as parquet."""
    from components._lib import feast_io

    t0 = time.perf_counter()
    store = feast_io.open_store(store_dir, fs_yaml or None)
    # The split was fixed at ingest (profile data.eval_positions, recorded in meta.json).
    k = int(sources.read_meta(sources_dir).get("eval_positions", 1))
    targets = feast_io.historical_targets(store, sources.read_dataset(sources_dir).interactions, k)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    targets.to_parquet(out_path, index=False)
    counts = targets["split"].value_counts().to_dict()
    return {
        "n_targets": len(targets),
        **{f"n_{k}": int(v) for k, v in counts.items()},
        "seconds": round(time.perf_counter() - t0, 2),
    }


def validate(
    sources_dir: str | Path,
    table_path: str | Path,
    out_dir: str | Path,
    profile: str | Profile = "quick",
    stage: str = "targets",
    bounds: dict[str, int] | None = None,
):
    """GX suites over interactions, items and a targets table (stage="targets") or examples ("examples").

    Writes validation.json, validation.md and Great Expectations' Data Docs (data_docs.html) into `out_dir`;
    returns the ValidationReport.
    """
    from components._lib.validation import Bounds, validate_tables

    if stage not in ("targets", "examples"):
        raise ValueError(f"stage must be 'targets' or 'examples', not {stage!r}")
    ds = sources.read_dataset(sources_dir)
    table = pd.read_parquet(table_path)
    prof = as_profile(profile)
    n_candidates = prof.data.n_candidates if stage == "examples" else None
    report = validate_tables(
        ds.interactions, ds.items, table, n_candidates, Bounds(**(bounds or {})), prof.data.eval_positions
    )
    return write_validation(report, out_dir)


def write_json(obj: Any, path: str | Path) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, default=str))


def candidates(
    sources_dir: str | Path, targets_path: str | Path, out_path: str | Path, profile: str | Profile = "quick"
) -> dict[str, Any]:
    """Fit the retriever on training positions, attach its top-N, keep retrieval hits; write examples.parquet."""
    from gr2.candidates import attach_candidates
    from gr2.data.split import train_sequences
    from gr2.retriever import CoocRetriever

    t0 = time.perf_counter()
    prof = as_profile(profile)
    ds = sources.read_dataset(sources_dir, event_ts=False)
    targets = sources.read_table(targets_path)
    seqs = train_sequences(ds, prof.data.eval_positions)
    retriever = CoocRetriever(prof.retriever).fit(seqs, ds.items["item_id"].tolist())
    examples, stats = attach_candidates(targets, retriever, prof.data.n_candidates)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    examples.to_parquet(out_path, index=False)
    info: dict[str, Any] = {"retriever": stats["retriever"], "n_candidates": stats["n"]}
    for split, s in stats["splits"].items():
        info[f"{split}_targets"] = s["targets"]
        info[f"{split}_examples"] = s["hits"]
        info[f"{split}_hit_rate"] = s["hit_rate"]
    info["seconds"] = round(time.perf_counter() - t0, 2)
    return info


def load_evidence(sources_dir: str | Path):
    """gr2.evidence.Evidence rebuilt from the item feature table the feature store serves (no skew), and the
    `sequence` feature's models ingest saved beside it."""
    from gr2.evidence import SEQUENCE_DIR, Evidence
    from gr2.sequential import SequenceFeature

    src = Path(sources_dir)
    table = pd.read_parquet(src / "item_features.parquet").drop(columns=["event_timestamp", "title"])
    for col in table.columns:
        if table[col].dtype == object and col != "item_id":
            table[col] = [list(v) for v in table[col]]
    meta = json.loads((src / "evidence.json").read_text()) if (src / "evidence.json").exists() else None
    return Evidence.from_item_tables(table, meta, SequenceFeature.load(src / SEQUENCE_DIR))


def evaluate_floor(
    sources_dir: str | Path,
    examples_path: str | Path,
    out_dir: str | Path,
    profile: str | Profile = "quick",
    dataset: str = "",
) -> dict[str, Any]:
    """Floor (retriever order), popularity and ltr rows on the test examples -> report.json / report.md, and the
    fitted ltr in ltr/ (LTRModel.save: analysis.compare_models compares a model with it on any split)."""
    from gr2.ltr import fit_ltr, rankings_from_scores
    from gr2.metrics import evaluate as evaluate_rows
    from gr2.metrics import identity_rankings

    t0 = time.perf_counter()
    prof = as_profile(profile)
    ex = sources.read_table(examples_path)
    ev = load_evidence(sources_dir)
    split = {s: ex[ex["split"] == s].reset_index(drop=True) for s in ("train", "val", "test")}

    def feats(df: pd.DataFrame, own: bool):
        # training lists: subtract their own target, and score the sequence out of their user's fold
        own_targets, users = (df["target"].tolist(), df["user_id"].tolist()) if own else (None, None)
        return ev.features_batch(df["history"].tolist(), df["candidates"].tolist(), own_targets, users)

    X = {
        "train": feats(split["train"], True),
        "val": feats(split["val"], False),
        "test": feats(split["test"], False),
    }
    ltr = fit_ltr(
        X["train"],
        split["train"]["label"].to_numpy(),
        X["val"],
        split["val"]["label"].to_numpy(),
        prof.ltr,
        prof.seed,
    )
    test = split["test"]
    n = prof.data.n_candidates
    floor = identity_rankings(len(test), n)
    pop_col = ev.feature_names.index("popularity")
    models = {
        "floor": floor,
        "popularity": rankings_from_scores(X["test"][:, :, pop_col]),
        "ltr": ltr.rank(X["test"]),
    }
    rows = [
        evaluate_rows(test, r, None, floor, prof.bootstrap_samples, prof.seed, model=name)
        for name, r in models.items()
    ]
    meta = sources.read_meta(sources_dir)
    # Test targets: each user's last k positions that have a history (position >= 1): min(k, n - 1) per user.
    lengths = sources.read_dataset(sources_dir).interactions.groupby("user_id").size().to_numpy()
    n_test_targets = int(np.minimum(prof.data.eval_positions, np.maximum(lengths - 1, 0)).sum())
    report = {
        "dataset": meta["dataset"],  # the folder name (ml-100k, amazon_beauty), not the path given
        "dataset_arg": dataset,
        "profile": prof.name,
        "snapshot_date": meta.get("snapshot_date", ""),
        "dataset_profile": meta.get("profile"),  # what the data has and lacks, from ingest
        "rows": rows,
        "gate": {
            "passed": False,
            "reasons": ["no candidate model in this pipeline yet (floor evaluation only)"],
        },
        "retriever": {
            "name": "cooc",
            "hit_rate": len(test) / n_test_targets if n_test_targets else float("nan"),
            "n_test_examples": len(test),
            "n_test_targets": n_test_targets,
        },
        "ltr": {"model": ltr.kind, "params": ltr.params, "val": ltr.val},
        # The features every model saw; those the data cannot supply are dropped, with the reason.
        "evidence": {"features": list(ev.feature_names), "dropped_features": dict(ev.dropped_features)},
        "n_examples": {s: len(d) for s, d in split.items()},
        "seconds": round(time.perf_counter() - t0, 2),
    }
    from gr2.report import write_report

    write_report(out_dir, report)
    ltr.save(Path(out_dir) / LTR_DIR)
    return report


def write_validation(report: ValidationReport, out_dir: str | Path) -> ValidationReport:
    """validation.json, validation.md and the Data Docs page of a validation report, in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report.write(out / "validation.json", out / "validation.md", out / DATA_DOCS)
    return report


def validate_dataset(
    dataset: str, out_dir: str | Path, profile: str | Profile = "quick", bounds: dict[str, int] | None = None
):
    """Validate a dataset folder without a feature store: interactions, items and its positional targets.

    The targets come from gr2.data.split.build_targets (what Feast extraction must reproduce exactly).
    """
    from components._lib.validation import Bounds, validate_tables
    from gr2.data.split import build_targets, event_times

    prof = as_profile(profile)
    ds = load_dataset(resolve_dataset(dataset))
    inter = ds.interactions.assign(event_ts=event_times(ds.interactions).to_numpy())
    targets = build_targets(ds, prof.data.history_len, prof.data.eval_positions)
    report = validate_tables(
        inter, ds.items, targets, None, Bounds(**(bounds or {})), prof.data.eval_positions
    )
    return write_validation(report, out_dir)
