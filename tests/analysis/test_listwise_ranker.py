"""analysis/listwise_ranker.py: the list inputs, and that attention across the list learns what one candidate's own
features (with its list maximum) cannot tell."""

import numpy as np
import pytest

from analysis.listwise_ranker import ListwiseConfig, fit_listwise, list_inputs


def test_list_context_reads_only_the_lists_own_rows():
    x = np.array([[[1.0], [-2.0], [0.0]]])  # a list of 2: the third row is padding
    z, mask = list_inputs(x, np.array([2]))
    assert mask.tolist() == [[True, True, False]]
    # minus the maximum of the list's own rows (1.0), not of the padding's 0.0; padding stays zeros
    assert z[0, :, 1].tolist() == [0.0, -3.0, 0.0]
    assert z[0, 2].tolist() == [0.0, 0.0]


def planted(n_lists: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lists of 3-7 candidates with a value and a side (0 or 1); the held-out item is the highest value on the side
    most of the list is on (ties: side 1). A candidate's own features and the list's maxima cannot tell which
    side that is; the other candidates can."""
    rng = np.random.default_rng(seed)
    n = rng.integers(3, 8, n_lists)
    x = np.zeros((n_lists, 7, 2))
    labels = np.zeros(n_lists, dtype=int)
    for i, k in enumerate(n):
        x[i, :k, 0] = rng.uniform(size=k)
        x[i, :k, 1] = rng.integers(0, 2, k)
        side = float(x[i, :k, 1].sum() * 2 >= k)
        labels[i] = int(np.argmax(np.where(x[i, :k, 1] == side, x[i, :k, 0], -1.0)))
    return x, n, labels


@pytest.mark.parametrize("shape, better", [("listwise", True), ("mlp", False)])
def test_attention_finds_the_second_largest_a_pointwise_scorer_cannot(shape, better):
    x, n, labels = planted(3000, 0)
    cfg = ListwiseConfig(shape=shape, d_model=32, n_layer=2, max_epochs=40, patience=10)
    model = fit_listwise(x, n, labels, cfg, seed=0)
    xt, nt, yt = planted(1000, 1)
    s = model.scores(xt, nt)
    assert np.isneginf(s[nt < 7, 6]).all()  # a row past a list's end never ranks
    hit = float((s.argmax(1) == yt).mean())
    # one candidate alone can only guess the side: its best is the highest value, right when that is on the
    # majority side; attention counts the sides
    assert (hit > 0.9) if better else (hit < 0.8), hit
