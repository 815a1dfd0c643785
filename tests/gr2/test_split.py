"""TIGER leave-one-out split by position and strictly increasing event times."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gr2.data import Dataset, build_targets, data_root, event_times, load_dataset, train_sequences
from gr2.data.split import MIN_GAP_S, SYNTHETIC_EPOCH_S, TARGET_COLUMNS, split_labels


def _ds(seqs: dict[str, list[str]], ts: dict[str, list[float]] | None = None) -> Dataset:
    rows = []
    for u, items in seqs.items():
        for i, x in enumerate(items):
            t = ts[u][i] if ts else np.nan
            rows.append((u, x, float(t), i))
    inter = pd.DataFrame(rows, columns=["user_id", "item_id", "timestamp", "seq_idx"])
    ids = sorted({x for s in seqs.values() for x in s})
    items = pd.DataFrame({"item_id": ids, "title": "", "categories": [[] for _ in ids]})
    return Dataset("toy", inter, items)


def test_build_targets_positions_and_histories():
    ds = _ds({"a": ["i0"], "b": ["i1", "i2"], "c": ["i3", "i4", "i5"], "d": ["i0", "i1", "i2", "i3", "i4"]})
    t = build_targets(ds, history_len=2)
    assert list(t.columns) == TARGET_COLUMNS
    got = {(r.user_id, r.target_pos): (r.split, r.history, r.target) for r in t.itertuples()}
    assert got == {
        # a (1 item): no example; b (2 items): test only; c (3 items): val + test, no train target
        ("b", 1): ("test", ["i1"], "i2"),
        ("c", 1): ("val", ["i3"], "i4"),
        ("c", 2): ("test", ["i3", "i4"], "i5"),
        ("d", 1): ("train", ["i0"], "i1"),
        ("d", 2): ("train", ["i0", "i1"], "i2"),
        ("d", 3): ("val", ["i1", "i2"], "i3"),  # history truncated to H = 2, oldest -> newest
        ("d", 4): ("test", ["i2", "i3"], "i4"),
    }
    assert t.loc[t.user_id == "d", "example_id"].tolist() == ["d:1", "d:2", "d:3", "d:4"]
    assert str(t["event_ts"].dtype) == "datetime64[ns, UTC]"
    assert train_sequences(ds) == {"a": [], "b": [], "c": ["i3"], "d": ["i0", "i1", "i2"]}


def test_k_eval_positions_per_user():
    """eval_positions = 2: the last two positions are test targets, the two before them validation targets."""
    ds = _ds({"b": ["i1", "i2"], "c": ["i3", "i4", "i5", "i6"], "d": [f"i{k}" for k in range(7)]})
    t = build_targets(ds, history_len=3, eval_positions=2)
    got = {(r.user_id, r.target_pos): r.split for r in t.itertuples()}
    assert got == {
        ("b", 1): "test",  # position 0 has no history: never a target
        ("c", 1): "val",
        ("c", 2): "test",
        ("c", 3): "test",
        ("d", 1): "train",
        ("d", 2): "train",
        ("d", 3): "val",
        ("d", 4): "val",
        ("d", 5): "test",
        ("d", 6): "test",
    }
    # Training sequences stop before the first validation position.
    assert train_sequences(ds, 2) == {"b": [], "c": [], "d": ["i0", "i1", "i2"]}
    # k = 1 is the leave-one-out rule exactly.
    np.testing.assert_array_equal(split_labels(np.arange(5), np.full(5, 5)), ["train"] * 3 + ["val", "test"])
    with pytest.raises(ValueError, match="eval_positions"):
        split_labels(np.arange(3), np.full(3, 3), 0)


def test_event_times_ties_backwards_and_missing():
    ds = _ds(
        {"u": ["a", "b", "c", "d", "e"], "v": ["a", "b"], "w": ["a", "b", "c"]},
        {"u": [100, 100, 100, 50, 1000], "v": [10, np.nan], "w": [7, 8, 20]},
    )
    e = event_times(ds.interactions)
    assert str(e.dtype) == "datetime64[ns, UTC]"
    sec = (e.astype("int64") // 10**9).tolist()
    # ties broken by seq_idx (2 s apart), a timestamp going backwards is lifted, later ones kept
    assert sec[:5] == [100, 102, 104, 106, 1000]
    # a user with a missing timestamp is synthesised from the epoch
    assert sec[5:7] == [SYNTHETIC_EPOCH_S, SYNTHETIC_EPOCH_S + MIN_GAP_S]
    # distinct seconds closer than the gap are also spread
    assert sec[7:] == [7, 9, 20]


def test_split_on_real_slice_is_consistent():
    ds = load_dataset(data_root() / "ml-latest-small")
    users = sorted(ds.interactions["user_id"].unique())[:200]
    ds.interactions = ds.interactions[ds.interactions["user_id"].isin(users)].reset_index(drop=True)
    t = build_targets(ds, history_len=20)
    n = ds.interactions.groupby("user_id").size()
    assert (t["split"] == "test").sum() == (n >= 2).sum() == 200
    assert (t["split"] == "train").sum() == (n - 3).clip(lower=0).sum()
    assert t["history"].map(len).max() == 20
    e = event_times(ds.interactions)
    diffs = e.groupby(ds.interactions["user_id"]).diff().dropna()
    assert (diffs >= pd.Timedelta(seconds=MIN_GAP_S)).all()
    # test target is each user's last item and the history ends right before it
    last = ds.interactions.groupby("user_id").tail(2).groupby("user_id")["item_id"].agg(list)
    test = t[t.split == "test"].set_index("user_id")
    assert all(
        test.loc[u, "history"][-1] == last[u][0] and test.loc[u, "target"] == last[u][1] for u in users
    )
    # event_ts of an example equals the event time of its target row
    row = ds.interactions.set_index(["user_id", "seq_idx"]).index.get_indexer(
        list(zip(t.user_id, t.target_pos, strict=True))
    )
    assert (e.to_numpy()[row] == t["event_ts"].to_numpy()).all()
