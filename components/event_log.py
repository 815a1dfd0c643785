"""The nightly source: an event log in object storage, partitioned by date, plus the item table.

    s3://<bucket>/<prefix>/events/date=YYYY-MM-DD/<part>.parquet   the events that arrived on that date
    s3://<bucket>/<prefix>/items.parquet                          the catalog (item_id, title, categories)

An event is (user_id, item_id, timestamp, seq_idx): the uniform format of gr2/data/dataset.py, timestamp in
unix seconds, seq_idx the event's position in its user's whole history. The log grows one partition a night and
nothing is copied: a night reads every partition dated on or before its `snapshot_date` (later ones are ignored,
so a past night can be read again as it was), and records each object it read with its ETag, so the exact
night can be replayed and any object rewritten since is detected (`objects_changed`).

The reader checks what it can parse (columns, types) and names the object; what is wrong but parseable
(duplicated events, an id missing from the catalog, nulls in an id column) is left to data validation, which
stops the run before anything is trained (components/_lib/validation.py). The S3 client is the artifact
store's (`s3_client`): same endpoint setting, same credentials Secret.
"""

from __future__ import annotations

import io
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pandas as pd

from components.artifact_store import s3_client
from gr2.data.dataset import Dataset, DatasetError

EVENTS = "events"
ITEMS = "items.parquet"
EVENT_COLUMNS = {"user_id": "str", "item_id": "str", "timestamp": "float64", "seq_idx": "int64"}
_PARTITION = re.compile(r"/date=(\d{4}-\d{2}-\d{2})/[^/]+\.parquet$")


def parse_uri(uri: str) -> tuple[str, str]:
    """s3://bucket/prefix -> (bucket, prefix without slashes at either end)."""
    if not uri.startswith("s3://") or not uri[5:].split("/", 1)[0]:
        raise ValueError(f"{uri!r}: an event log URI is s3://<bucket>/<prefix>")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix.strip("/")


def _key(prefix: str, *parts: str) -> str:
    return "/".join(p for p in (prefix, *parts) if p)


def partition_key(uri: str, date: str, part: str = "events") -> str:
    """The key of one partition object: <prefix>/events/date=<date>/<part>.parquet."""
    return _key(parse_uri(uri)[1], EVENTS, f"date={date}", f"{part}.parquet")


def _parquet_bytes(df: pd.DataFrame) -> bytes:
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    return buf.getvalue()


def write_partitions(events: pd.DataFrame, uri: str, client: Any = None, part: str = "events") -> list[str]:
    """Append `events` to the log: one object per UTC date of their timestamps (what an upstream export writes
    each night). Returns the keys written."""
    client = client or s3_client()
    bucket, _ = parse_uri(uri)
    missing = [c for c in EVENT_COLUMNS if c not in events.columns]
    if missing:
        raise ValueError(f"events lack the columns {missing} (need {list(EVENT_COLUMNS)})")
    dates = pd.to_datetime(events["timestamp"], unit="s", utc=True).dt.strftime("%Y-%m-%d")
    keys = []
    for date, rows in events.groupby(dates.to_numpy(), sort=True):
        key = partition_key(uri, str(date), part)
        client.put_object(Bucket=bucket, Key=key, Body=_parquet_bytes(rows[list(EVENT_COLUMNS)]))
        keys.append(key)
    return keys


def write_items(items: pd.DataFrame, uri: str, client: Any = None) -> str:
    """Write the item table (item_id, title, categories as a list of strings)."""
    client = client or s3_client()
    bucket, prefix = parse_uri(uri)
    key = _key(prefix, ITEMS)
    table = items[["item_id", "title", "categories"]].assign(
        categories=[list(c) for c in items["categories"]]
    )
    client.put_object(Bucket=bucket, Key=key, Body=_parquet_bytes(table))
    return key


def list_partitions(uri: str, client: Any = None) -> list[tuple[str, str]]:
    """(date, key) of every partition object of the log, oldest first."""
    client = client or s3_client()
    bucket, prefix = parse_uri(uri)
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=_key(prefix, EVENTS) + "/"
    ):
        for obj in page.get("Contents", []):
            m = _PARTITION.search(obj["Key"])
            if m:
                out.append((m.group(1), obj["Key"]))
    return sorted(out)


def _get(client: Any, bucket: str, key: str) -> tuple[pd.DataFrame, dict[str, Any]]:
    """One object as a DataFrame, and what was read: key, ETag (as the server sent it) and size."""
    resp = client.get_object(Bucket=bucket, Key=key)
    data = resp["Body"].read()
    try:
        df = pd.read_parquet(io.BytesIO(data))
    except Exception as e:  # pyarrow raises several types for a truncated or foreign object
        raise DatasetError(f"s3://{bucket}/{key}: not a readable parquet file ({e})") from e
    return df, {"key": key, "etag": resp["ETag"].strip('"'), "size": len(data)}


def _typed_events(df: pd.DataFrame, where: str) -> pd.DataFrame:
    missing = [c for c in EVENT_COLUMNS if c not in df.columns]
    if missing:
        raise DatasetError(f"{where}: missing columns {missing} (an event has {list(EVENT_COLUMNS)})")
    out = df[list(EVENT_COLUMNS)].copy()
    for col in ("user_id", "item_id"):  # nulls stay nulls: data validation names them
        out[col] = out[col].astype(object).where(out[col].notna(), None)
        out[col] = [v if v is None else str(v) for v in out[col]]
    try:
        out["timestamp"] = out["timestamp"].astype("float64")
        out["seq_idx"] = out["seq_idx"].astype("int64")
    except (TypeError, ValueError) as e:
        raise DatasetError(f"{where}: timestamp must be numeric and seq_idx an integer ({e})") from e
    return out


def read_event_log(uri: str, snapshot_date: str, client: Any = None) -> tuple[Dataset, list[dict[str, Any]]]:
    """The data of the night `snapshot_date` (YYYY-MM-DD): every partition dated on or before it, and the item
    table. Returns the Dataset (interactions sorted by user then seq_idx) and the objects read, items first."""
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", snapshot_date or ""):
        raise ValueError(f"snapshot_date {snapshot_date!r}: an event log night is a date, YYYY-MM-DD")
    client = client or s3_client()
    bucket, prefix = parse_uri(uri)
    parts = [key for date, key in list_partitions(uri, client) if date <= snapshot_date]
    if not parts:
        raise DatasetError(f"{uri}: no event partitions dated on or before {snapshot_date}")
    try:
        items, items_obj = _get(client, bucket, _key(prefix, ITEMS))
    except client.exceptions.NoSuchKey:
        raise DatasetError(f"s3://{bucket}/{_key(prefix, ITEMS)}: the item table is missing") from None
    if "item_id" not in items.columns:
        raise DatasetError(f"s3://{bucket}/{items_obj['key']}: no item_id column")
    items = items.assign(
        item_id=items["item_id"].astype(str),
        title=items["title"].fillna("").astype(str) if "title" in items else "",
        categories=[list(c) for c in items["categories"]] if "categories" in items else [[]] * len(items),
    )[["item_id", "title", "categories"]]
    # Parallel GETs: a log of a few thousand daily partitions is read in seconds, not minutes.
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda k: _get(client, bucket, k), parts))
    frames = [_typed_events(df, f"s3://{bucket}/{obj['key']}") for df, obj in got]
    inter = pd.concat(frames, ignore_index=True)
    order = np.lexsort((inter["seq_idx"].to_numpy(), inter["user_id"].astype(str).to_numpy()))
    inter = inter.iloc[order].reset_index(drop=True)
    name = prefix.rsplit("/", 1)[-1] or bucket
    items = items.sort_values("item_id", kind="stable").reset_index(drop=True)
    return Dataset(name=name, interactions=inter, items=items), [items_obj, *(obj for _, obj in got)]


def objects_changed(uri: str, objects: list[dict[str, Any]], client: Any = None) -> list[str]:
    """The keys of objects a night recorded (`read_event_log`'s list for `uri`) that are gone or whose ETag
    differs now: a replay of that night would not read the same data."""
    client = client or s3_client()
    bucket, _ = parse_uri(uri)
    changed = []
    for obj in objects:
        try:
            etag = client.head_object(Bucket=bucket, Key=obj["key"])["ETag"].strip('"')
        except client.exceptions.ClientError:
            etag = None
        if etag != obj["etag"]:
            changed.append(obj["key"])
    return changed
