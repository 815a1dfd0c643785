"""Ingest: user_history rows hold the last H items up to and including each interaction."""

from __future__ import annotations

import pandas as pd

from components._lib.sources import item_feature_rows, user_history_rows


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
