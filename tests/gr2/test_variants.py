"""Degraded dataset variants (gr2/data/variants.py): each transform by hand, and the real variants load."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gr2.data import data_root, load_dataset
from gr2.data.profile import dataset_profile
from gr2.data.variants import Tables, build_variant, inject_repeats, long_histories


def _tables(lengths: dict[str, int]) -> Tables:
    users = [u for u, n in lengths.items() for _ in range(n)]
    seq = [str(i) for n in lengths.values() for i in range(n)]
    inter = pd.DataFrame(
        {
            "user_id": users,
            "item_id": [f"{u}-{s}" for u, s in zip(users, seq, strict=True)],
            "timestamp": [str(100 + int(s)) for s in seq],
            "seq_idx": seq,
        }
    )
    items = pd.DataFrame({"item_id": inter["item_id"], "title": "t", "categories": "c"})
    return Tables(inter, items)


def test_inject_repeats_copies_earlier_items_and_keeps_order():
    t = _tables({"a": 30, "b": 20})
    out = inject_repeats(t, share=0.3, seed=1).interactions
    for u, g in out.groupby("user_id", sort=False):
        orig = t.interactions[t.interactions["user_id"] == u]["item_id"].tolist()
        items = g["item_id"].tolist()
        # The originals keep their order; every extra row repeats an item already consumed.
        firsts = [i for k, i in enumerate(items) if i not in items[:k]]
        assert firsts == orig
        assert g["seq_idx"].tolist() == [str(k) for k in range(len(g))]
        ts = g["timestamp"].astype(int).to_numpy()
        assert (np.diff(ts) >= 0).all()
    assert len(out) > len(t.interactions)
    assert out.equals(inject_repeats(t, share=0.3, seed=1).interactions)  # seeded


def test_long_histories_keeps_long_users_and_cuts_others():
    t = _tables({"x": 12, "y": 3, "a": 9, "b": 9, "c": 9, "d": 9, "e": 5, "f": 6})
    out = long_histories(t, min_len=10, short=(2, 3, 4), ordinary=2).interactions
    sizes = out.groupby("user_id", sort=False).size().to_dict()
    assert sizes == {"x": 12, "a": 2, "b": 3, "c": 4, "d": 9, "e": 5}
    assert out[out["user_id"] == "c"]["seq_idx"].tolist() == ["0", "1", "2", "3"]  # each user's first items


@pytest.fixture(scope="module")
def shared():
    if not (data_root() / "amazon_beauty" / "interactions.tsv").exists():
        pytest.skip("shared data not available")
    return data_root()


@pytest.mark.parametrize(
    "name, lacks, has_repeats",
    [
        ("no_text", ["titles", "categories"], False),
        ("no_timestamps", ["timestamps"], False),
        ("stripped", ["titles", "timestamps"], False),
        ("repeats", [], True),
        ("long", [], False),
        ("all_shapes", ["titles", "categories", "timestamps"], True),
    ],
)
def test_real_variants_load_and_profile(shared, tmp_path, name, lacks, has_repeats):
    # Beauty's variants on its first 500 users (id order); `long` needs all of ml-latest-small to find its users.
    max_users = 0 if name == "long" else 500
    ds = load_dataset(build_variant(name, tmp_path / name, max_users=max_users))
    prof = dataset_profile(ds)
    assert prof["lacks"] == lacks
    if name == "all_shapes":  # Beauty's slice plus every user of `long`
        assert prof["users"] == max_users + 46
    elif max_users:
        assert prof["users"] == max_users
    assert ("repeats" in prof["has"]) == has_repeats
    if name == "repeats":
        assert 0.12 < prof["repeats"]["share"] < 0.2  # about 0.2 / 1.2 of the rows
    if name == "long":
        h = prof["history_length"]
        assert h["min"] == 2 and h["max"] == 2698
        assert prof["users_by_length"] == {"1": 0, "2": 1, "3": 1, ">=4": 44}  # 3 long + 1 cut to 4 + 40
    if name == "all_shapes":  # `long`'s extremes, repeats included; text and numeric ids in one catalog
        h = prof["history_length"]
        assert h["min"] == 2 and h["max"] > 2698
        users = ds.interactions["user_id"].astype(str)
        assert users.str.isdigit().any() and not users.str.isdigit().all()
