"""analysis/feature_rankers.py: the per-list standardisation and the cross-fitted blend on hand-made scores (the
rankers themselves are scored end to end in test_local_run.py)."""

import numpy as np

from analysis.feature_rankers import cross_fitted_blend, standardise, top1_hits


def test_standardise_per_list_and_a_constant_list_is_zero():
    z = standardise(np.array([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]]))
    assert np.allclose(z[0].mean(), 0) and np.isclose(z[0].std(), 1)
    assert np.array_equal(z[1], np.zeros(3))


def test_top1_hits_breaks_ties_in_retriever_order():
    s = np.array([[0.5, 0.5, 0.1], [0.1, 0.2, 0.9]])
    assert top1_hits(s, np.array([0, 1])).tolist() == [1.0, 0.0]


def test_blend_picks_the_ranker_that_knows_and_scores_each_half_with_the_others_weight():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, 400)
    knows = rng.normal(size=(400, 5))
    knows[np.arange(400), labels] += 10.0  # a ranks the held-out item first on every list
    noise = rng.normal(size=(400, 5))  # b knows nothing
    scores, weights = cross_fitted_blend(knows, noise, labels, seed=0)
    assert all(w >= 0.5 for w in weights)  # each half chose mostly a
    assert top1_hits(scores, labels).mean() > 0.95
    # swapped: the weight of the first argument goes to 0 or near it
    _, weights = cross_fitted_blend(noise, knows, labels, seed=0)
    assert all(w <= 0.5 for w in weights)


def test_blend_weights_are_chosen_out_of_sample():
    # a only knows the first half's lists, b only the second's: each half's weight comes from the other half, so
    # each half gets the ranker that is blind on it, and the blend is no better than chance there
    rng = np.random.default_rng(1)
    n = 400
    labels = rng.integers(0, 4, n)
    half = np.random.default_rng(0).permutation(n) < n // 2  # the split cross_fitted_blend makes with seed 0
    a, b = rng.normal(size=(n, 4)), rng.normal(size=(n, 4))
    a[np.flatnonzero(half), labels[half]] += 10.0
    b[np.flatnonzero(~half), labels[~half]] += 10.0
    scores, weights = cross_fitted_blend(a, b, labels, seed=0)
    # fitted on the first half, where a knows; used on the other half, where a is blind (and the other way round)
    assert weights[0] > 0.5 > weights[1]
    assert top1_hits(scores, labels).mean() < 0.5
