"""gr2/sequential.py: the training rows, and a SASRec that learns an order only a sequence shows."""

import numpy as np
import pytest

from gr2.config import SequenceConfig
from gr2.sequential import fit_sequence_model, training_rows


def test_training_rows_keep_the_last_items_left_padded_and_skip_single_items():
    index = {x: i + 1 for i, x in enumerate("abcdef")}
    x, y = training_rows({"u": list("abcdef"), "v": list("ab"), "w": ["c"]}, index, max_len=3)
    assert x.tolist() == [[3, 4, 5], [0, 0, 1]]  # u: inputs c d e -> next d e f; v: a -> b; w is left out
    assert y.tolist() == [[4, 5, 6], [0, 0, 2]]


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
