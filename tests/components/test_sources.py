"""Ingest: user_history rows hold the last H items up to and including each interaction."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from components._lib.sources import item_feature_rows, user_history_rows, write_parquet


def test_user_history_rows_by_hand():
    inter = pd.DataFrame(
        {
            "user_id": ["a", "a", "a", "b", "b"],
            "item_id": ["1", "2", "3", "9", "8"],
            "seq_idx": [0, 1, 2, 0, 1],
        }
    )
    ts = pd.Series(pd.to_datetime([10, 12, 14, 10, 12], unit="s", utc=True))
    rows = user_history_rows(inter, ts, history_len=2)
    assert rows["history"].tolist() == [["1"], ["1", "2"], ["2", "3"], ["9"], ["9", "8"]]
    assert rows["history_len"].tolist() == [1, 2, 2, 1, 2]
    assert rows["event_timestamp"].tolist() == ts.tolist()


def test_item_feature_rows_join_evidence():
    items = pd.DataFrame({"item_id": ["1", "2"], "title": ["A", ""], "categories": [["x"], []]})
    tables = pd.DataFrame(
        {"item_id": ["2", "1"], "popularity": [5, 3], "categories": [["ignored"], ["ignored"]]}
    )
    snap = pd.Timestamp("2000-01-01", tz="UTC")
    out = item_feature_rows(items, tables, snap)
    assert out["popularity"].tolist() == [3, 5]
    assert out["categories"].tolist() == [["x"], []]  # the catalog's categories, not a copy
    assert (out["event_timestamp"] == snap).all()


def test_list_columns_empty_everywhere_are_written_as_string_lists(tmp_path):
    """No item has a category or a title token: Arrow alone would type those columns list<null>, which the
    feature store can neither declare nor materialize (the failure in feast-apply on a catalog without titles)."""
    df = pd.DataFrame(
        {
            "item_id": ["1", "2"],
            "categories": [[], []],
            "title_tokens": [[], []],
            "trans_counts": [[3, 1], []],
        }
    )
    write_parquet(df, tmp_path / "t.parquet")
    schema = pq.read_schema(tmp_path / "t.parquet")
    assert schema.field("categories").type == pa.list_(pa.string())
    assert schema.field("title_tokens").type == pa.list_(pa.string())
    assert schema.field("trans_counts").type == pa.list_(pa.int64())  # typed by its values, untouched
    back = pd.read_parquet(tmp_path / "t.parquet")
    assert [list(v) for v in back["categories"]] == [[], []] and list(back["trans_counts"][0]) == [3, 1]
