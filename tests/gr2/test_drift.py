"""Drift figures (gr2/drift.py): PSI on known distributions, prediction agreement on known rankings, the
profile's round trip, and the warnings at the thresholds."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from gr2.config import DriftConfig
from gr2.drift import DataProfile, data_drift, data_profile, drift_markdown, prediction_drift, psi, warnings

CFG = DriftConfig()


def test_psi():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=20000)
    assert psi(ref, ref) == 0.0
    assert psi(ref, rng.normal(size=20000)) < 0.01  # the same distribution, another sample
    assert psi(ref, rng.normal(0.5, 1, size=20000)) > 0.2  # half a standard deviation
    # Two bins of equal share (the median splits them), tonight 90 % in the upper one: the formula by hand.
    two = psi(np.r_[np.zeros(50), np.ones(50)], np.r_[np.zeros(10), np.ones(90)], bins=2)
    assert two == pytest.approx((0.1 - 0.5) * math.log(0.1 / 0.5) + (0.9 - 0.5) * math.log(0.9 / 0.5))
    # A feature with few values (ranks 0..9) gets one bin per value; a value the reference never had counts.
    assert psi(np.arange(10).repeat(100), np.arange(10).repeat(100)) == 0.0
    assert psi(np.zeros(100), np.full(100, 3.0)) > 5
    assert math.isnan(psi(np.array([]), ref))


def test_prediction_drift():
    a = [[0, 1, 2, 3], [0, 1, 2, 3], [3, 2, 1, 0]]
    b = [[0, 1, 2, 3], [1, 0, 2, 3], [0, 1, 2, 3]]
    d = prediction_drift(a, b)
    # top-1 the same on the first list only; Spearman 1, 0.8 (one adjacent swap) and -1 (reversed)
    assert d["n_lists"] == 3 and d["top1_agreement"] == pytest.approx(1 / 3)
    assert d["rank_corr"] == pytest.approx((1 + 0.8 - 1) / 3)


def test_profile_drift_and_warnings(tmp_path):
    inter = pd.DataFrame(
        {
            "user_id": ["a", "a", "b", "b", "b"],
            "item_id": ["x", "y", "x", "z", "x"],
            "seq_idx": [0, 1, 0, 1, 2],
        }
    )
    feats = np.arange(2 * 3 * 2, dtype=float).reshape(2, 3, 2)  # 2 lists x 3 candidates x 2 features
    ref = data_profile(inter, feats, ["f", "g"], 20, "2024-01-01", CFG)
    # each user's newest event: a at position 1 (item y, 1 event), b at position 2 (item x, 3 events)
    assert sorted(ref.values["history_len"]) == [1, 2]
    assert sorted(ref.values["item_popularity"]) == pytest.approx([math.log(2), math.log(4)])
    assert sorted(ref.values["g"]) == [1, 3, 5, 7, 9, 11]
    back = DataProfile.load(ref.save(tmp_path / "p"))
    assert back.snapshot_date == "2024-01-01" and sorted(back.users) == ["a", "b"]
    assert sorted(back.items) == ["x", "y", "z"] and list(back.values) == list(ref.values)

    # Tonight: a new user c whose newest event is a new item w.
    tonight_inter = pd.concat([inter, pd.DataFrame({"user_id": ["c"], "item_id": ["w"], "seq_idx": [0]})])
    tonight = data_profile(tonight_inter, feats, ["f", "g"], 20, "2024-01-05", CFG)
    d = {"production": {"model": "rl", "run_id": "r0"}, "data": data_drift(back, tonight, CFG)}
    assert d["data"]["new_users"] == pytest.approx(1 / 3) and d["data"]["new_items"] == pytest.approx(1 / 4)
    assert d["data"]["psi"]["f"] == 0.0 and d["data"]["psi"]["history_len"] > 0
    d["predictions"] = {"n_lists": 2, "top1_agreement": 0.5, "rank_corr": 0.9}
    d["warnings"] = w = warnings(d, CFG)
    assert "data: new users 0.333 > 0.2" in w and "data: new items 0.250 > 0.2" in w
    assert "predictions: top1 agreement 0.500 < 0.5" not in w  # the threshold itself passes
    assert all(x.startswith("data:") for x in w)
    md = drift_markdown(d, CFG)
    assert "# Drift against production: WARNING" in md and "| new users | 0.333 | <= 0.2 |" in md
    assert warnings({"production": {}, "data_error": "no profile"}, CFG) == [
        "data: not measured (no profile)"
    ]
