"""Candidate lists: natural top-N only, hit examples kept, stats, determinism."""

from __future__ import annotations

import pandas as pd
import pytest

from gr2.candidates import EXAMPLE_COLUMNS, attach_candidates, cut_lists, shorten_some
from gr2.data import build_targets, data_root, load_dataset, train_sequences
from gr2.retriever import CoocRetriever


@pytest.fixture(scope="module")
def setup():
    ds = load_dataset(data_root() / "ml-latest-small")
    users = sorted(ds.interactions["user_id"].unique())[:80]
    ds.interactions = ds.interactions[ds.interactions["user_id"].isin(users)].reset_index(drop=True)
    targets = build_targets(ds, 20)
    r = CoocRetriever().fit(train_sequences(ds), ds.items["item_id"])
    return targets, r


def test_examples_are_natural_hits(setup):
    targets, r = setup
    ex, stats = attach_candidates(targets, r, 10)
    assert list(ex.columns) == EXAMPLE_COLUMNS
    assert (ex["candidates"].map(len) == 10).all() and (ex["retriever_scores"].map(len) == 10).all()
    assert all(c[y] == t for c, y, t in zip(ex.candidates, ex.label, ex.target, strict=True))
    # never inserted: each list is exactly the retriever's own top-10 for that example
    for row in ex.sample(25, random_state=0).itertuples():
        own = row.target if row.split == "train" else None
        known = r.known_history(row.user_id, row.target_pos, row.history)
        assert r.topn(row.history, 10, own, known)[0] == row.candidates
        assert not set(row.candidates) & set(known)
    # scores are in retriever order
    assert all(all(a >= b for a, b in zip(s, s[1:], strict=False)) for s in ex.retriever_scores)
    # stats: counts per split are consistent with the kept examples
    for split, st in stats["splits"].items():
        assert st["targets"] == int((targets.split == split).sum())
        assert st["hits"] == int((ex.split == split).sum())
        assert st["hit_rate"] == pytest.approx(st["hits"] / st["targets"])
    assert stats["splits"]["test"]["targets"] == 80 and 0 < stats["splits"]["test"]["hits"] < 80


def test_deterministic(setup):
    targets, r = setup
    a, _ = attach_candidates(targets, r, 10)
    b, _ = attach_candidates(targets.sample(frac=1.0, random_state=1).sort_index(), r, 10)
    pd.testing.assert_frame_equal(a, b)


def test_cut_lists_keep_the_held_out_item_and_the_retriever_order(setup):
    targets, r = setup
    ex, _ = attach_candidates(targets, r, 10)
    for n in (2, 3, 7, 10, 12):
        cut = cut_lists(ex, [n] * len(ex), seed=5)
        assert (cut["candidates"].map(len) == min(n, 10)).all()
        for full, y, short, k, sc in zip(
            ex.candidates, ex.label, cut.candidates, cut.label, cut.retriever_scores, strict=True
        ):
            assert short[k] == full[y]  # the held-out item, where the label says
            pos = [full.index(c) for c in short]
            assert pos == sorted(pos) and len(set(short)) == len(short)  # a subset in retriever order
            assert all(a >= b for a, b in zip(sc, sc[1:], strict=False))  # its scores follow
    assert cut_lists(ex, [3] * len(ex), seed=5).equals(cut_lists(ex, [3] * len(ex), seed=5))  # seeded
    some = shorten_some(ex, 0.5, seed=1)
    lengths = some["candidates"].map(len)
    assert 0.3 < (lengths < 10).mean() < 0.7 and lengths.min() >= 2 and lengths.max() == 10
