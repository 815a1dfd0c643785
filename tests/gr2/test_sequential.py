"""gr2/sequential.py: the training rows, and a SASRec that learns an order only a sequence shows."""

import numpy as np
import pytest

from gr2.config import SequenceConfig
from gr2.sequential import fit_sequence_model, training_rows


def test_training_rows_cut_each_sequence_into_windows_every_next_item_a_target_once():
    index = {x: i + 1 for i, x in enumerate("abcdefg")}
    x, y = training_rows({"u": list("abcdefg"), "v": list("ab"), "w": ["c"]}, index, max_len=3)
    # u from its end: d e f -> e f g, then a b c -> b c d; v: a -> b; w is left out
    assert x.tolist() == [[4, 5, 6], [1, 2, 3], [0, 0, 1]]
    assert y.tolist() == [[5, 6, 7], [2, 3, 4], [0, 0, 2]]
    targets = y[y > 0].tolist()
    assert sorted(targets) == sorted([2, 3, 4, 5, 6, 7, 2])  # u's b..g once each, v's b


def test_training_rows_of_no_usable_sequence_fail_clearly():
    with pytest.raises(ValueError, match="2 items"):
        fit_sequence_model({"u": ["a"]}, SequenceConfig(epochs=1))


def test_sasrec_learns_what_follows_two_items_not_one():
    # every item follows x equally often, but after (p, x) comes a and after (q, x) comes b: a pair count
    # (the last item's transitions) cannot tell them apart, the sequence can
    seqs = {f"u{i}": (["p", "x", "a"] if i % 2 else ["q", "x", "b"]) for i in range(200)}
    cfg = SequenceConfig(max_len=4, d_model=16, n_heads=2, n_layers=1, dropout=0.0, epochs=60, lr=1e-2)
    model = fit_sequence_model(seqs, cfg, seed=0)
    s = model.scores([["p", "x"], ["q", "x"]], [["a", "b"], ["a", "b"]])
    assert s[0, 0] > s[0, 1] and s[1, 1] > s[1, 0]


def test_scores_take_empty_histories_and_unknown_items():
    model = fit_sequence_model({"u": ["a", "b"], "v": ["a", "b"]}, SequenceConfig(max_len=3, epochs=1))
    s = model.scores([[], ["zzz", "a"]], [["a", "unseen"], ["b", "unseen"]])
    assert s.shape == (2, 2) and np.isfinite(s).all()
    assert s[:, 1].tolist() == [0.0, 0.0]  # an item training never had has the zero padding row
