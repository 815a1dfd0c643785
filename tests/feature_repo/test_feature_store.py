"""Feast repo against a real slice: apply + materialize + online reads (sqlite), point-in-time extraction
equal to gr2's pure-pandas split, the no-leak property, the feast CLI, and the production yaml."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from components._lib import feast_io, sources
from components._lib.paths import FEATURE_REPO
from gr2.data.split import build_targets
from tests.components.slices import ingest_slice

H = 20  # quick profile history_len


@pytest.fixture(scope="module")
def store_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("feast")
    src = ingest_slice(root / "sources")
    info = feast_io.apply(src, root / "registry")
    inter = sources.read_dataset(src).interactions
    row = [{"user_id": inter["user_id"].iloc[0], "item_id": inter["item_id"].iloc[0]}]  # both exist
    info["online_before"] = feast_io.online_features(feast_io.open_store(root / "registry"), row)
    info |= feast_io.materialize(src, root / "registry", root / "store")
    info["online_after"] = feast_io.online_features(feast_io.open_store(root / "store"), row)
    return src, root / "store", info


def test_apply_registers_contract_objects(store_env):
    _, _, info = store_env
    assert info["project"] == "gr2"
    assert info["feature_views"] == ["item_features", "user_history"]
    assert info["feature_services"] == ["reranker_serving_v1", "reranker_v1"]


def test_apply_writes_no_online_rows_materialize_fills_a_new_store(store_env):
    """Validation sits between the two steps: apply must leave the online store (what serving reads) empty, and
    materialize writes into its own folder, leaving the applied one as it was."""
    src, store_dir, info = store_env
    assert info["online_before"]["history"] == [None] and info["online_before"]["title"] == [None]
    assert info["online_after"]["history"][0] and info["online_after"]["title"] != [None]
    assert info["user_rows"] == len(pd.read_parquet(src / "user_history.parquet"))
    cfg = yaml.safe_load((store_dir / "feature_store.yaml").read_text())
    assert cfg["registry"] == str(store_dir.resolve() / "registry.db")
    assert cfg["online_store"]["path"] == str(store_dir.resolve() / "online_store.db")


def test_online_features_are_latest_history_and_item_tables(store_env):
    src, store_dir, _ = store_env
    store = feast_io.open_store(store_dir)
    ds = sources.read_dataset(src)
    seqs = ds.interactions.groupby("user_id", sort=False)["item_id"].apply(list)
    users = list(seqs.index[:3])
    items = pd.read_parquet(src / "item_features.parquet").set_index("item_id")
    item_ids = [seqs[u][-1] for u in users]
    rows = [{"user_id": u, "item_id": i} for u, i in zip(users, item_ids, strict=True)]
    got = feast_io.online_features(store, rows + [{"user_id": "no-such-user", "item_id": "no-such-item"}])
    for k, u in enumerate(users):
        assert list(got["history"][k]) == seqs[u][-H:]  # materialized = the latest row per user
        assert got["history_len"][k] == min(H, len(seqs[u]))
        assert got["title"][k] == items.loc[item_ids[k], "title"]
        assert got["popularity"][k] == items.loc[item_ids[k], "popularity"]
        assert list(got["cooc_ids"][k]) == list(items.loc[item_ids[k], "cooc_ids"])
    assert got["history"][-1] is None and got["title"][-1] is None
    # the serving transformer's service: the history and the catalogue row's title, none of the evidence columns
    served = feast_io.online_features(
        store, rows + [{"user_id": "u?", "item_id": "i?"}], "reranker_serving_v1"
    )
    assert set(served) == {"user_id", "item_id", "history", "title"}
    assert served["history"][:-1] == got["history"][:-1] and served["title"] == got["title"]


@pytest.mark.parametrize("k", [1, 3])
def test_point_in_time_extraction_equals_build_targets(store_env, k):
    """Extraction reads the offline store: the registry alone (before materialize) is enough."""
    src, store_dir, _ = store_env
    inter = sources.read_dataset(src).interactions
    registry_only = feast_io.open_store(store_dir.parent / "registry")
    got = feast_io.historical_targets(registry_only, inter, eval_positions=k)
    ref = build_targets(sources.read_dataset(src, event_ts=False), H, eval_positions=k)
    pd.testing.assert_frame_equal(got, ref)
    assert set(got["split"]) == {"train", "val", "test"}
    assert (got["split"] == "test").sum() == sum(min(k, n - 1) for n in inter.groupby("user_id").size())


def test_feature_row_stamped_after_example_never_leaks(store_env, tmp_path):
    """Poison rows one instant after each lookup time (still before the target) must not be joined;
    the same rows one instant before it must be (so the test can see a leak)."""
    src0, _, _ = store_env
    src = Path(shutil.copytree(src0, tmp_path / "sources"))
    feast_io.apply(src, tmp_path / "store")
    store = feast_io.open_store(tmp_path / "store")
    inter = sources.read_dataset(src).interactions
    ent = feast_io.target_entities(inter)
    clean = pd.read_parquet(src / "user_history.parquet")

    def poison(offset: pd.Timedelta) -> pd.DataFrame:
        bad = pd.DataFrame(
            {
                "user_id": ent["user_id"],
                "event_timestamp": ent["event_timestamp"] + offset,
                "history": [["LEAK"]] * len(ent),
                "history_len": 1,
            }
        )
        pd.concat([clean, bad], ignore_index=True).to_parquet(src / "user_history.parquet", index=False)
        return feast_io.historical_targets(store, inter)

    after = poison(pd.Timedelta(milliseconds=500))  # stamped after the example's timestamp
    assert not any("LEAK" in h for h in after["history"])
    pd.testing.assert_frame_equal(after, build_targets(sources.read_dataset(src, event_ts=False), H))
    before = poison(pd.Timedelta(milliseconds=-500))  # control: at/before the timestamp it is read
    assert all(h == ["LEAK"] for h in before["history"])


def test_feast_cli_apply_uses_repo_definitions(store_env, tmp_path):
    src, _, _ = store_env
    yml = feast_io.write_store_yaml(tmp_path)
    env = {**os.environ, "GR2_FEAST_DATA": str(src)}
    feast = Path(sys.executable).with_name("feast")
    out = subprocess.run(
        [str(feast), "-c", str(FEATURE_REPO), "-f", str(yml), "apply"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for name in (
        "entity user",
        "entity item",
        "feature view user_history",
        "feature view item_features",
        "feature service reranker_v1",
        "feature service reranker_serving_v1",
    ):
        assert f"Created {name}" in out.stdout


def test_a_column_without_a_feast_type_is_named(tmp_path):
    """An all-empty list column written without a schema (list<null>) fails with the file, column and cause,
    not a KeyError; the ingest step types such columns (components/_lib/sources.write_parquet)."""
    pd.DataFrame({"item_id": ["1"], "title_tokens": [[]], "popularity": [3]}).to_parquet(
        tmp_path / "f.parquet"
    )
    feast_io.definitions(tmp_path)  # puts feature_repo/ on sys.path, as `feast apply` does
    parquet_fields = importlib.import_module("features").parquet_fields

    with pytest.raises(ValueError, match=r"f.parquet: column 'title_tokens' has Arrow type list<\w+: null>"):
        parquet_fields(str(tmp_path / "f.parquet"), skip={"item_id"})
    sources.write_parquet(pd.read_parquet(tmp_path / "f.parquet"), tmp_path / "g.parquet")
    fields = {f.name: str(f.dtype) for f in parquet_fields(str(tmp_path / "g.parquet"), skip={"item_id"})}
    assert fields == {"title_tokens": "Array(String)", "popularity": "Int64"}


def test_prod_yaml_shares_definitions(monkeypatch):
    env = {
        "GR2_FEAST_BUCKET": "bkt",
        "REDIS_URL": "redis.svc:6379,ssl=true",
        "AWS_REGION": "eu-west-1",
        "SPARK_MASTER": "k8s://https://kubernetes",
        "S3_ENDPOINT_URL": "https://s3.example",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    text = (FEATURE_REPO / "envs" / "prod.feature_store.yaml").read_text()
    local = yaml.safe_load((FEATURE_REPO / "feature_store.yaml").read_text())
    prod = yaml.safe_load(os.path.expandvars(text))  # what feast's load_repo_config does
    assert prod["project"] == local["project"] == "gr2"
    assert prod["registry"]["path"] == "s3://bkt/feast/registry.db"
    assert prod["online_store"] == {"type": "redis", "connection_string": "redis.svc:6379,ssl=true"}
    assert prod["offline_store"]["type"] == "spark"
    assert local["offline_store"]["type"] == "duckdb" and local["online_store"]["type"] == "sqlite"
    # Same views, SparkSource over the same parquet layout when GR2_FEAST_OFFLINE=spark.
    monkeypatch.setenv("GR2_FEAST_OFFLINE", "spark")
    views = feast_io.definitions("s3://bkt/snap")
    uh = next(v for v in views if getattr(v, "name", "") == "user_history")
    assert type(uh.batch_source).__name__ == "SparkSource"
    assert uh.batch_source.path == "s3://bkt/snap/user_history.parquet"
    assert [f.name for f in uh.features] == ["history", "history_len"]
