"""Feast I/O: per-run feature store config, apply, materialize, point-in-time extraction, online reads.

A run's feature store lives in one folder (`store_dir`): its own feature_store.yaml (the local template with
absolute registry / online-store paths), registry.db and online_store.db. The definitions are the ones in
feature_repo/ (entities.py, features.py, services.py), built for the run's sources folder.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from components._lib.paths import FEATURE_REPO, LOCAL_FS_YAML

ENTITY_OFFSET = timedelta(seconds=1)  # entity timestamp = target event time - 1 s (docs/CONTRACTS.md)


def definitions(sources_dir: str | Path, fields_from: str | Path | None = None) -> list[Any]:
    """Entities, feature views and the feature services of feature_repo/, reading `sources_dir`'s parquet.

    `sources_dir` may be remote (the artifact's s3:// URI for the production store); `fields_from` is then
    a local copy to read the item columns from.
    """
    if str(FEATURE_REPO) not in sys.path:  # the repo files import each other the way `feast apply` runs them
        sys.path.insert(0, str(FEATURE_REPO))
    entities = importlib.import_module("entities")
    features = importlib.import_module("features")
    services = importlib.import_module("services")
    data_dir = str(sources_dir) if "://" in str(sources_dir) else str(Path(sources_dir).resolve())
    user_history, item_features = features.build_views(data_dir, str(fields_from) if fields_from else None)
    return [
        entities.user,
        entities.item,
        user_history,
        item_features,
        *services.build_services(user_history, item_features),
    ]


def write_store_yaml(store_dir: str | Path, template: str | Path = LOCAL_FS_YAML) -> Path:
    """Copy the local yaml into `store_dir` with its registry and sqlite paths pointing inside it."""
    store = Path(store_dir).resolve()
    store.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(Path(template).read_text())
    cfg["registry"] = str(store / "registry.db")
    cfg["online_store"] = {**cfg["online_store"], "path": str(store / "online_store.db")}
    path = store / "feature_store.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def open_store(store_dir: str | Path, fs_yaml: str | Path | None = None):
    """A FeatureStore for a run folder (or for an environment yaml such as envs/prod.feature_store.yaml)."""
    from feast import FeatureStore

    yaml_path = Path(fs_yaml) if fs_yaml else Path(store_dir).resolve() / "feature_store.yaml"
    return FeatureStore(repo_path=str(FEATURE_REPO), fs_yaml_file=yaml_path)


def apply(
    sources_dir: str | Path, store_dir: str | Path, fs_yaml: str | Path | None = None, source_uri: str = ""
) -> dict:
    """`feast apply` the definitions for `sources_dir`: the registry only. Point-in-time extraction reads the
    offline store, so nothing reaches the online store (what serving reads) before the data is validated
    (`materialize`).

    `source_uri`: where the offline store reads the same parquet (e.g. the artifact's s3:// URI with the
    production yaml); default the local `sources_dir`.
    """
    if not fs_yaml:
        write_store_yaml(store_dir)
    store = open_store(store_dir, fs_yaml)
    store.apply(definitions(source_uri or sources_dir, fields_from=sources_dir))
    return {
        "project": store.project,
        "feature_views": sorted(fv.name for fv in store.list_feature_views()),
        "feature_services": sorted(s.name for s in store.list_feature_services()),
    }


def materialize(
    sources_dir: str | Path,
    registry_dir: str | Path,
    store_dir: str | Path,
    fs_yaml: str | Path | None = None,
) -> dict:
    """Materialize every row of `sources_dir` into the online store, for the registry `apply` wrote.

    Locally the store is a new folder `store_dir` (an artifact is never written twice): the yaml and copies
    of `registry_dir`'s registry and (empty) online sqlite, which this fills. With an environment yaml the registry and online store
    are the environment's and `store_dir` only records what was done.
    """
    if fs_yaml:
        store = open_store(store_dir, fs_yaml)
    else:
        write_store_yaml(store_dir)
        for name in ("registry.db", "online_store.db"):  # the online tables `apply` created, still empty
            if (Path(registry_dir) / name).exists():
                shutil.copyfile(Path(registry_dir) / name, Path(store_dir) / name)
        store = open_store(store_dir)
    uh = pd.read_parquet(Path(sources_dir) / "user_history.parquet", columns=["event_timestamp"])
    it = pd.read_parquet(Path(sources_dir) / "item_features.parquet", columns=["event_timestamp"])
    start = min(uh["event_timestamp"].min(), it["event_timestamp"].min()) - ENTITY_OFFSET
    end = max(uh["event_timestamp"].max(), it["event_timestamp"].max()) + ENTITY_OFFSET
    store.materialize(start_date=start.to_pydatetime(), end_date=end.to_pydatetime())
    return {
        "project": store.project,
        "materialized": [start.isoformat(), end.isoformat()],
        "user_rows": len(uh),
        "item_rows": len(it),
    }


def target_entities(interactions: pd.DataFrame, eval_positions: int = 1) -> pd.DataFrame:
    """One entity row per target position 1..n-1 of each user: split label, target item, lookup time.

    Split by position (gr2.data.split.split_labels): the last k positions test, the k before them val, the rest
    train; k = `eval_positions` (1 = TIGER leave-one-out; docs/CONTRACTS.md).
    """
    from gr2.data.split import split_labels

    inter = interactions
    n = inter.groupby("user_id", sort=False)["seq_idx"].transform("size").to_numpy()
    pos = inter["seq_idx"].to_numpy()
    keep = pos >= 1
    ent = pd.DataFrame(
        {
            "user_id": inter["user_id"].to_numpy(),
            "split": split_labels(pos, n, eval_positions),
            "target_pos": pos.astype("int64"),
            "event_ts": pd.to_datetime(inter["event_ts"], utc=True).to_numpy(),
            "target": inter["item_id"].to_numpy(),
        }
    )[keep].reset_index(drop=True)
    ent["event_ts"] = pd.to_datetime(ent["event_ts"], utc=True)
    ent["event_timestamp"] = ent["event_ts"] - ENTITY_OFFSET
    return ent


def service_refs(store, service: str, entity: str) -> list[str]:
    """The feature service's feature references ("view:feature") of the views keyed by `entity`.

    Extraction reads the service's user features; its item features (evidence tables, hundreds of ids per
    item) are per-candidate data for serving and gr2.evidence, and joining them onto every target row
    would only be dropped again.
    """
    fs = store.get_feature_service(service)
    refs = []
    for proj in fs.feature_view_projections:
        if entity in store.get_feature_view(proj.name).entities:
            refs += [f"{proj.name_to_use()}:{f.name}" for f in proj.features]
    if not refs:
        raise ValueError(f"feature service {service!r} has no view keyed by entity {entity!r}")
    return refs


def historical_targets(
    store, interactions: pd.DataFrame, eval_positions: int = 1, service: str = "reranker_v1"
) -> pd.DataFrame:
    """Targets with their history read by a point-in-time join of the feature service's user features.

    Columns: example_id, user_id, split, target_pos, event_ts, history, target (docs/CONTRACTS.md order),
    sorted by user_id then target_pos.
    """
    ent = target_entities(interactions, eval_positions)
    refs = service_refs(store, service, entity="user")
    # Only the join keys and the lookup time go to Feast: every extra entity column is carried through
    # each candidate pair of the point-in-time join, which slows it down.
    keys = ent[["user_id", "event_timestamp"]]
    got = store.get_historical_features(entity_df=keys, features=refs).to_df()
    # the `file` offline store drops rows (docs/DEPENDENCIES.md): refuse silently short data
    if len(got) != len(ent):
        raise RuntimeError(f"point-in-time join returned {len(got)} rows for {len(ent)} entity rows")
    got["event_timestamp"] = pd.to_datetime(got["event_timestamp"], utc=True).astype("datetime64[ns, UTC]")
    ent["event_timestamp"] = ent["event_timestamp"].astype("datetime64[ns, UTC]")
    # Event times are strictly increasing per user, so (user_id, lookup time) identifies an entity row.
    df = ent.merge(
        got[["user_id", "event_timestamp", "history"]],
        on=["user_id", "event_timestamp"],
        how="left",
        validate="one_to_one",
    )
    df = df.sort_values(["user_id", "target_pos"], kind="stable").reset_index(drop=True)
    history = [
        [] if h is None or (isinstance(h, float) and pd.isna(h)) else [str(x) for x in h]
        for h in df["history"]
    ]
    out = pd.DataFrame(
        {
            "example_id": df["user_id"] + ":" + df["target_pos"].astype(str),
            "user_id": df["user_id"].astype(str),
            "split": df["split"].astype(str),
            "target_pos": df["target_pos"].astype("int64"),
            "event_ts": pd.to_datetime(df["event_ts"], utc=True).astype("datetime64[ns, UTC]"),
            "history": history,
            "target": df["target"].astype(str),
        }
    )
    return out


def online_features(store, rows: list[dict[str, str]], service: str = "reranker_v1") -> dict[str, list]:
    """Online lookup through the feature service (what serving reads)."""
    return store.get_online_features(features=store.get_feature_service(service), entity_rows=rows).to_dict()
