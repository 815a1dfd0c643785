"""Metrics: hand-computed values, sklearn cross-check, fallback, bootstrap CIs, doctests."""

from __future__ import annotations

import doctest

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import ndcg_score

import gr2.metrics as M


def _examples(labels: list[int], n: int = 5) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "user_id": [f"u{i}" for i in range(len(labels))],
            "candidates": [[f"i{j}" for j in range(n)] for _ in labels],
            "label": labels,
        }
    )


def test_doctests():
    assert doctest.testmod(M).failed == 0


def test_hand_computed_row():
    ex = _examples([0, 2, 4, 1])
    rankings = [[0, 1, 2, 3, 4], [2, 0, 1, 3, 4], [0, 1, 2, 3, 4], [3, 4, 0, 2, 1]]
    row = M.evaluate(ex, rankings, [True] * 4, n_boot=200, model="m")
    # target ranks: 0, 0, 4, 4
    assert row["recall@1"] == 0.5 and row["recall@3"] == 0.5 and row["recall@5"] == 1.0
    assert row["ndcg@3"] == 0.5
    assert row["ndcg@5"] == pytest.approx((1 + 1 + 2 / np.log2(6)) / 4)
    assert row["validity"] == 1.0 and row["n_users"] == 4 and row["model"] == "m" and row["tau"] is None
    # floor (identity) ranks: 0, 2, 4, 1 -> R@1 0.25
    assert row["delta_vs_floor_mean"]["recall@1"] == 0.25


def test_ndcg_matches_sklearn():
    rng = np.random.default_rng(0)
    n, B = 10, 50
    labels = rng.integers(0, n, B)
    rankings = [rng.permutation(n).tolist() for _ in range(B)]
    ranks = M.target_ranks(rankings, labels)
    y_true = np.zeros((B, n))
    y_true[np.arange(B), labels] = 1
    y_score = np.zeros((B, n))
    for b, r in enumerate(rankings):
        y_score[b, r] = np.arange(n, 0, -1)  # higher score = earlier in the ranking
    for k in (3, 5):
        assert M.ndcg_at_k(ranks, k).mean() == pytest.approx(ndcg_score(y_true, y_score, k=k))


def test_invalid_falls_back_to_retriever_order():
    ex = _examples([1, 1])
    row = M.evaluate(ex, [[1, 0, 2, 3, 4], [1, 1, 1, 1, 1]], [True, False], n_boot=100)
    assert row["validity"] == 0.5
    assert row["recall@1"] == 0.5  # second list scored in retriever order: target at rank 1
    with pytest.raises(ValueError, match="not a permutation"):
        M.evaluate(ex, [[1, 0, 2, 3, 4], [1, 1, 1, 1, 1]], [True, True])


def test_bootstrap_cis():
    v = np.r_[np.ones(300), np.zeros(700)]
    lo, hi = M.bootstrap_ci(v, n_boot=1000, seed=0)
    assert lo < 0.3 < hi and hi - lo == pytest.approx(2 * 1.96 * np.sqrt(0.21 / 1000), rel=0.15)
    assert M.bootstrap_ci(v, 500, seed=3) == M.bootstrap_ci(v, 500, seed=3)
    ex = _examples([0, 1, 2, 3] * 50)
    floor = M.identity_rankings(len(ex), 5)
    row = M.evaluate(ex, floor, n_boot=300)
    assert row["delta_vs_floor"]["recall@1"] == [0.0, 0.0]  # paired: identical rows have zero-width CI
    lo, hi = row["ci95"]["recall@1"]
    assert lo <= row["recall@1"] == 0.25 <= hi
    # a model that always puts the target first beats the floor with a CI above 0
    best = [[y] + [j for j in range(5) if j != y] for y in ex.label]
    row = M.evaluate(ex, best, n_boot=300)
    assert row["recall@1"] == 1.0 and row["delta_vs_floor"]["recall@1"][0] > 0.6


def test_fallback_takes_each_lists_own_length():
    """Lists of different lengths (clients send 2..N; the report cuts test lists): each invalid one falls back to
    its own retriever order, and a valid one must be a permutation of its own length."""
    out = M.apply_fallback([[1, 0], [0], [2, 0, 1]], [True, False, True], [2, 3, 3])
    assert out == [[1, 0], [0, 1, 2], [2, 0, 1]]
    with pytest.raises(ValueError, match=r"ranking 0 .* permutation of 0..2"):
        M.apply_fallback([[1, 0]], [True], [3])
