"""Feature views over the parquet sources written by the ingest step (components/_lib/sources.py).

`user_history`: one row per interaction, stamped with `gr2.data.event_times`, holding the last H item ids up
to and including that interaction. A point-in-time lookup at (target event time - 1 s) therefore returns
exactly the target's positional history, and a row stamped after the lookup time can never leak into it.
`item_features`: one snapshot row per item (title, categories and the evidence item tables).

Where the parquet lives is a parameter: `build_views(data_dir)` for code, `GR2_FEAST_DATA` for the feast CLI
(default feature_repo/data/sources). `GR2_FEAST_OFFLINE=spark` swaps FileSource for SparkSource over the
same parquet (the production yaml's warehouse offline store); the views themselves are unchanged.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

from entities import item, user  # feast imports repo files with the repo folder on sys.path
from feast import FeatureView, Field, FileSource
from feast.types import Array, Float64, Int64, String

REPO_DIR = Path(__file__).resolve().parent
DATA_DIR = os.environ.get("GR2_FEAST_DATA", str(REPO_DIR / "data" / "sources"))
TIMESTAMP = "event_timestamp"

USER_HISTORY_FIELDS = [Field(name="history", dtype=Array(String)), Field(name="history_len", dtype=Int64)]
ITEM_CORE_FIELDS = [Field(name="title", dtype=String), Field(name="categories", dtype=Array(String))]

_ARROW_TO_FEAST = {
    "string": String,
    "large_string": String,
    "int64": Int64,
    "int32": Int64,
    "double": Float64,
}


def _source(name: str, data_dir: str):
    path = f"{data_dir.rstrip('/')}/{name}.parquet"
    if os.environ.get("GR2_FEAST_OFFLINE", "file") == "spark":
        from feast.infra.offline_stores.contrib.spark_offline_store.spark_source import SparkSource

        return SparkSource(name=name, path=path, file_format="parquet", timestamp_field=TIMESTAMP)
    return FileSource(name=name, path=path, timestamp_field=TIMESTAMP)


def parquet_fields(path: str, skip: set[str]) -> list[Field]:
    """Feast fields for the columns of a local parquet file (the evidence tables vary with gr2.evidence)."""
    import pyarrow.parquet as pq

    out = []
    for f in pq.read_schema(path):
        if f.name in skip:
            continue
        t = f.type
        is_list = hasattr(t, "value_type")  # list<...>
        name = str(t.value_type if is_list else t)
        if name not in _ARROW_TO_FEAST:
            raise ValueError(
                f"{path}: column {f.name!r} has Arrow type {t}, which has no Feast type "
                f"(known: {sorted(_ARROW_TO_FEAST)}{', as lists too' if is_list else ''}); "
                "list<null> means every list is empty: write the column with a typed schema"
            )
        out.append(
            Field(name=f.name, dtype=Array(_ARROW_TO_FEAST[name]) if is_list else _ARROW_TO_FEAST[name])
        )
    return out


def build_views(data_dir: str = DATA_DIR, fields_from: str | None = None) -> tuple[FeatureView, FeatureView]:
    """The two feature views reading `<data_dir>/{user_history,item_features}.parquet`.

    `fields_from`: a local folder with the same parquet to read the item columns from when `data_dir` is
    remote (s3://...); by default `data_dir` itself.
    """
    item_path = f"{(fields_from or data_dir).rstrip('/')}/item_features.parquet"
    item_fields = ITEM_CORE_FIELDS
    if os.path.exists(item_path):  # local: declare every evidence column the ingest step wrote
        core = {"item_id", TIMESTAMP, *(f.name for f in ITEM_CORE_FIELDS)}
        item_fields = ITEM_CORE_FIELDS + parquet_fields(item_path, skip=core)
    user_history_view = FeatureView(
        name="user_history",
        entities=[user],
        ttl=timedelta(0),  # 0 = never expires: the latest interaction row before the lookup time wins
        schema=USER_HISTORY_FIELDS,
        source=_source("user_history", data_dir),
        online=True,
        tags={"owner": "gr2", "contract": "docs/CONTRACTS.md#feature-store"},
    )
    item_features_view = FeatureView(
        name="item_features",
        entities=[item],
        ttl=timedelta(0),  # one snapshot row per item
        schema=item_fields,
        source=_source("item_features", data_dir),
        online=True,
        tags={"owner": "gr2", "contract": "docs/CONTRACTS.md#feature-store"},
    )
    return user_history_view, item_features_view


user_history, item_features = build_views()
