"""The nightly source (components/event_log.py) against moto's real S3 server: partitions selected by snapshot
date, the objects read recorded with their ETags, bad objects named, and ingest reading it as a dataset."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from components._lib import steps
from components.event_log import (
    list_partitions,
    objects_changed,
    partition_key,
    read_event_log,
    write_items,
    write_partitions,
)
from gr2.data.dataset import DatasetError, load_dataset
from tests.components.slices import SLICE_USERS, require_slice
from tests.s3 import use_bucket

DAY = 86_400


def toy_log() -> tuple[pd.DataFrame, pd.DataFrame]:
    """3 users over 3 days (2024-01-01..03): user u2 first appears on day 2."""
    t0 = 1_704_067_200  # 2024-01-01T00:00:00Z
    events = pd.DataFrame(
        {
            "user_id": ["u1", "u1", "u1", "u2", "u2", "u1", "u3"],
            "item_id": ["a", "b", "c", "a", "c", "d", "b"],
            "timestamp": [t0, t0 + 60, t0 + DAY, t0 + DAY + 5, t0 + 2 * DAY, t0 + 2 * DAY, t0 + 2 * DAY],
            "seq_idx": [0, 1, 2, 0, 1, 3, 0],
        }
    )
    items = pd.DataFrame(
        {"item_id": list("abcd"), "title": ["A", "B", "", "D"], "categories": [["x"], [], ["x", "y"], []]}
    )
    return events, items


@pytest.fixture
def log_uri(s3_endpoint, monkeypatch, request):
    bucket = f"log-{request.node.name.replace('_', '-')[:50]}".lower()
    client = use_bucket(monkeypatch, s3_endpoint, bucket)
    return f"s3://{bucket}/nightly/toy", client


def test_nights_read_their_partitions_and_record_etags(log_uri):
    uri, client = log_uri
    events, items = toy_log()
    assert write_partitions(events, uri) == [
        partition_key(uri, d) for d in ("2024-01-01", "2024-01-02", "2024-01-03")
    ]
    write_items(items, uri)
    assert [d for d, _ in list_partitions(uri)] == ["2024-01-01", "2024-01-02", "2024-01-03"]

    ds, objects = read_event_log(uri, "2024-01-02")
    assert ds.name == "toy" and ds.items["item_id"].tolist() == list("abcd")
    assert ds.items["categories"].tolist() == [["x"], [], ["x", "y"], []]
    inter = ds.interactions
    assert list(zip(inter["user_id"], inter["seq_idx"], strict=True)) == [
        ("u1", 0),
        ("u1", 1),
        ("u1", 2),
        ("u2", 0),
    ]
    assert inter["timestamp"].dtype == "float64" and inter["seq_idx"].dtype == "int64"
    # The item table and the two partitions dated on or before the night, each with the ETag S3 holds for it.
    assert [o["key"] for o in objects] == [
        "nightly/toy/items.parquet",
        partition_key(uri, "2024-01-01"),
        partition_key(uri, "2024-01-02"),
    ]
    for o in objects:
        head = client.head_object(Bucket=uri[5:].split("/")[0], Key=o["key"])
        assert o["etag"] == head["ETag"].strip('"') and o["size"] == head["ContentLength"]

    # The whole log, the next night; and the first night again reads exactly what it read before.
    assert len(read_event_log(uri, "2024-01-03")[0].interactions) == len(events)
    again, objects_again = read_event_log(uri, "2024-01-02")
    assert objects_again == objects and again.interactions.equals(inter)
    assert objects_changed(uri, objects) == []
    # A partition rewritten since (an upstream re-export) is detected: that night cannot be replayed as it was.
    write_partitions(events[events["timestamp"] < events["timestamp"].min() + 30], uri)
    assert objects_changed(uri, objects) == [partition_key(uri, "2024-01-01")]


def test_bad_nights_are_named(log_uri):
    uri, client = log_uri
    events, items = toy_log()
    write_partitions(events, uri)
    with pytest.raises(DatasetError, match="item table is missing"):
        read_event_log(uri, "2024-01-03")
    write_items(items, uri)
    with pytest.raises(DatasetError, match="no event partitions dated on or before 2023-12-31"):
        read_event_log(uri, "2023-12-31")
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        read_event_log(uri, "")
    bucket = uri[5:].split("/")[0]
    bad = partition_key(uri, "2024-01-02", "late")
    client.put_object(Bucket=bucket, Key=bad, Body=b"not parquet")
    with pytest.raises(DatasetError, match=f"s3://{bucket}/{bad}: not a readable parquet"):
        read_event_log(uri, "2024-01-03")
    client.put_object(Bucket=bucket, Key=bad, Body=events.drop(columns="seq_idx").to_parquet(index=False))
    with pytest.raises(DatasetError, match=r"late.parquet: missing columns \['seq_idx'\]"):
        read_event_log(uri, "2024-01-03")


def test_ingest_reads_an_event_log(log_uri, tmp_path):
    """A real slice written as a nightly log: ingest of a night reads the events up to that date (what the local
    copy holds up to it), and records the objects read in meta.json."""
    uri, _ = log_uri
    local = load_dataset(require_slice())
    users = sorted(local.interactions["user_id"].unique())[:SLICE_USERS]
    inter = local.interactions[local.interactions["user_id"].isin(users)]
    write_partitions(inter, uri)
    write_items(local.items, uri)
    night = "2010-01-01"
    cut = inter[inter["timestamp"] < pd.Timestamp(night, tz="UTC").timestamp() + DAY]
    assert 0 < len(cut) < len(inter)  # the night sees part of the log
    meta = steps.ingest(uri, tmp_path / "src", "quick", night)
    assert meta["n_interactions"] == len(cut) and meta["n_users"] == cut["user_id"].nunique()
    assert meta["source"] == uri and meta["snapshot_date"] == night
    assert meta["objects"][0]["key"] == "nightly/toy/items.parquet"
    assert len(meta["objects"]) == 1 + cut["timestamp"].map(lambda t: int(t) // DAY).nunique()
    assert json.loads((tmp_path / "src" / "meta.json").read_text())["objects"] == meta["objects"]
