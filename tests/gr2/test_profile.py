"""The dataset profile: what a dataset has and lacks, by hand on a toy dataset."""

from __future__ import annotations

import numpy as np
import pandas as pd

from gr2.data.dataset import Dataset
from gr2.data.profile import dataset_profile, profile_markdown, profile_metrics


def _toy() -> Dataset:
    # u1: a b a c b (2 repeats, its test target b is one); u2: x y (test only); u3: c (no example).
    users = ["u1"] * 5 + ["u2"] * 2 + ["u3"]
    items = ["a", "b", "a", "c", "b", "x", "y", "c"]
    seq = [0, 1, 2, 3, 4, 0, 1, 0]
    ts = [10.0, 20.0, 30.0, 40.0, 50.0, np.nan, np.nan, 5.0]  # u2 has no timestamps
    inter = pd.DataFrame({"user_id": users, "item_id": items, "timestamp": ts, "seq_idx": seq})
    catalog = pd.DataFrame(
        {
            "item_id": ["a", "b", "c", "x", "y", "z"],
            "title": [""] * 6,
            "categories": [["k"], [], [], [], [], []],
        }
    )
    return Dataset("toy", inter, catalog)


def test_profile_by_hand():
    p = dataset_profile(_toy())
    assert (p["users"], p["items"], p["interactions"]) == (3, 6, 8)
    assert p["titles"] == {"items": 0, "share": 0.0}
    assert p["categories"] == {"items": 1, "share": round(1 / 6, 4)}
    assert p["timestamps"] == {"rows": 6, "share": 0.75}
    # Repeats: u1's 3rd (a) and 5th (b) rows. Test targets: u1's b (a repeat) and u2's y.
    assert p["repeats"] == {"rows": 2, "share": 0.25, "users": 1, "test_targets": 1, "test_target_share": 0.5}
    assert p["history_length"]["min"] == 1 and p["history_length"]["max"] == 5
    assert p["history_length"]["median"] == 2.0 and p["history_length"]["mean"] == round(8 / 3, 2)
    assert p["users_by_length"] == {"1": 1, "2": 1, "3": 0, ">=4": 1}
    # Training positions 0..n-3: u1's a, b, a; u2 and u3 have none. Not in training: c, x, y, z.
    assert p["items_not_in_training"] == 4
    assert p["numeric_ids"] == {"user_id": False, "item_id": False}
    assert p["has"] == ["categories", "timestamps", "repeats"]
    assert p["lacks"] == ["titles"] and p["partial"] == ["categories", "timestamps"]


def test_numeric_ids_and_a_complete_dataset():
    inter = pd.DataFrame(
        {
            "user_id": ["7", "7", "7"],
            "item_id": ["1", "2", "3"],
            "timestamp": [1.0, 2.0, 3.0],
            "seq_idx": [0, 1, 2],
        }
    )
    items = pd.DataFrame({"item_id": ["1", "2", "3"], "title": ["A", "B", "C"], "categories": [["x"]] * 3})
    p = dataset_profile(Dataset("d", inter, items))
    assert p["numeric_ids"] == {"user_id": True, "item_id": True}
    assert p["lacks"] == [] and p["partial"] == [] and p["has"] == ["titles", "categories", "timestamps"]
    assert p["repeats"]["rows"] == 0 and p["users_by_length"]["3"] == 1


def test_metrics_and_markdown_name_what_is_missing():
    p = dataset_profile(_toy())
    m = profile_metrics(p)
    assert m["profile/title_share"] == 0.0 and m["profile/repeat_share"] == 0.25
    assert m["profile/history_length_max"] == 5.0 and m["profile/users_with_1_interactions"] == 1.0
    assert all(isinstance(v, float) for v in m.values())
    md = "\n".join(profile_markdown(p))
    assert "lacks: titles" in md and "partial: categories, timestamps" in md
    assert "repeats: 25.0% of interactions (1 users); 50.0% of test targets" in md
