"""Ingest: the parquet files that back the feature store and every later step.

A sources folder holds
  interactions.parquet  the dataset's interactions (+ `event_ts`, from gr2.data.event_times)
  items.parquet         the catalog (item_id, title, categories)
  user_history.parquet  Feast source: one row per interaction, history = last H items up to and including it
  item_features.parquet Feast source: one snapshot row per item, title/categories + evidence item tables
  meta.json             dataset name, H, snapshot, row counts, the dataset profile (gr2.data.profile); for an
                        event log, its URI (`source`) and the objects read with their ETags (`objects`)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gr2.data.dataset import Dataset
from gr2.data.profile import dataset_profile
from gr2.data.split import event_times

TS = "event_timestamp"


def write_parquet(df: pd.DataFrame, path: str | Path) -> None:
    """`df` as parquet, with every list column typed by its values.

    A list column whose lists are all empty (no item has a category, no title has a token) would be typed
    list<null> by Arrow, which the feature store cannot declare or materialize. Such a column is written as
    list<string>: the id, token and category lists are strings, and a count list is only empty everywhere
    when its id list is too, so no reader ever sees one of its values.
    """
    table = pa.Table.from_pandas(df, preserve_index=False)
    for i, f in enumerate(table.schema):
        if pa.types.is_list(f.type) and pa.types.is_null(f.type.value_type):
            table = table.set_column(i, f.name, table.column(i).cast(pa.list_(pa.string())))
    pq.write_table(table, path)


def user_history_rows(interactions: pd.DataFrame, ts: pd.Series, history_len: int) -> pd.DataFrame:
    """One row per interaction: the last `history_len` item ids up to and including it (oldest -> newest)."""
    items = interactions["item_id"].to_numpy(dtype=object)
    users = interactions["user_id"].to_numpy(dtype=object)
    # Interactions are sorted by user then seq_idx, so each user's rows are a contiguous slice.
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    ends = np.r_[starts[1:], len(users)]
    history: list[list[str]] = []
    for s, e in zip(starts, ends, strict=True):
        seq = items[s:e].tolist()
        history.extend(seq[max(0, i + 1 - history_len) : i + 1] for i in range(len(seq)))
    return pd.DataFrame(
        {
            "user_id": interactions["user_id"].to_numpy(),
            TS: ts.to_numpy(),
            "history": history,
            "history_len": np.array([len(h) for h in history], dtype=np.int64),
        }
    )


def item_feature_rows(
    items: pd.DataFrame, item_tables: pd.DataFrame | None, snapshot_ts: pd.Timestamp
) -> pd.DataFrame:
    """One row per catalog item stamped `snapshot_ts`; evidence columns joined on item_id."""
    out = items[["item_id", "title", "categories"]].copy()
    out["categories"] = [list(c) for c in out["categories"]]
    if item_tables is not None and len(item_tables.columns) > 1:
        extra = item_tables.drop(columns=[c for c in ("title", "categories") if c in item_tables.columns])
        out = out.merge(extra, on="item_id", how="left", validate="one_to_one")
    out.insert(1, TS, pd.Series([snapshot_ts] * len(out), dtype="datetime64[ns, UTC]"))
    return out


def write_sources(
    dataset: Dataset,
    out_dir: str | Path,
    history_len: int,
    item_tables: pd.DataFrame | None = None,
    snapshot_date: str = "",
    eval_positions: int = 1,
    read: dict | None = None,
) -> dict:
    """Write the sources folder (see module docstring); returns meta.json's content. `read` (the event log's
    URI and the objects read, with their ETags) goes into meta.json as is."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    inter = dataset.interactions.reset_index(drop=True)
    ts = event_times(inter).reset_index(drop=True)
    inter = inter.assign(event_ts=ts.to_numpy())
    write_parquet(inter, out / "interactions.parquet")
    write_parquet(dataset.items, out / "items.parquet")
    write_parquet(user_history_rows(inter, ts, history_len), out / "user_history.parquet")
    # The item snapshot is stamped before the first event: the tables describe the catalog as seen by the
    # training data (gr2.evidence fits on training targets only), so every example may read them.
    snapshot_ts = ts.min() - pd.Timedelta(days=1)
    write_parquet(item_feature_rows(dataset.items, item_tables, snapshot_ts), out / "item_features.parquet")
    if (
        item_tables is not None
    ):  # config + bucket edges to rebuild gr2.evidence.Evidence from the served table
        (out / "evidence.json").write_text(json.dumps(item_tables.attrs.get("evidence", {}), default=str))
    meta = {
        "dataset": dataset.name,
        "history_len": history_len,
        "eval_positions": eval_positions,  # the split (gr2.data.split) every later step of this run uses
        "snapshot_date": snapshot_date,
        "item_snapshot_ts": snapshot_ts.isoformat(),
        "min_event_ts": ts.min().isoformat(),
        "max_event_ts": ts.max().isoformat(),
        "n_interactions": len(inter),
        "n_users": int(inter["user_id"].nunique()),
        "n_items": len(dataset.items),
        "profile": dataset_profile(dataset),  # what the data has and lacks (gr2/data/profile.py)
    }
    if item_tables is not None:  # the evidence features kept, and those the data cannot supply (gr2.evidence)
        ev = item_tables.attrs.get("evidence", {})
        meta["evidence"] = {
            "features": ev.get("features"),
            "dropped_features": ev.get("dropped_features", {}),
        }
    if read is not None:
        meta.update(read)
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def read_meta(sources_dir: str | Path) -> dict:
    return json.loads((Path(sources_dir) / "meta.json").read_text())


def read_dataset(sources_dir: str | Path, event_ts: bool = True) -> Dataset:
    """The Dataset back from a sources folder (with `event_ts` in interactions unless event_ts=False)."""
    src = Path(sources_dir)
    items = pd.read_parquet(src / "items.parquet")
    items["categories"] = [list(c) for c in items["categories"]]
    inter = pd.read_parquet(src / "interactions.parquet")
    if not event_ts:
        inter = inter.drop(columns="event_ts")
    return Dataset(name=read_meta(src)["dataset"], interactions=inter, items=items)


def read_table(path: str | Path) -> pd.DataFrame:
    """A targets / examples parquet with list columns as Python lists (as gr2 builds them)."""
    df = pd.read_parquet(path)
    for col in ("history", "candidates"):
        if col in df:
            df[col] = [[str(x) for x in v] for v in df[col]]
    if "retriever_scores" in df:
        df["retriever_scores"] = [[float(x) for x in v] for v in df["retriever_scores"]]
    return df


def read_test_lists(examples_path: str | Path, max_lists: int = 0) -> pd.DataFrame:
    """The test lists every model is scored on: the examples' test split, its first `max_lists` (0 = all)."""
    ex = read_table(examples_path)
    test = ex[ex["split"] == "test"].reset_index(drop=True)
    return test.head(max_lists) if max_lists else test
