"""Evidence features from per-item tables: hand-computed values, own-target subtraction, round trip."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gr2.candidates import attach_candidates, cut_lists
from gr2.config import EvidenceConfig, SequenceConfig
from gr2.data import build_targets, train_sequences
from gr2.evidence import FEATURE_NAMES as ALL_FEATURES
from gr2.evidence import Evidence, title_tokens
from gr2.retriever import CoocRetriever
from gr2.sequential import SequenceFeature, fold_of
from tests.gr2.toys import real_slice

CFG = EvidenceConfig(top_k=10, window=2, recent=2, decay=0.5)
TRAIN = {"u1": ["a", "b", "c", "d"], "u2": ["b", "c", "e"], "u3": ["c", "e"], "u4": ["b", "d"]}
ITEMS = pd.DataFrame(
    {
        "item_id": ["a", "b", "c", "d", "e", "f"],
        "title": ["Red Lipstick", "Blue Nail Polish", "Red Nail Polish", "Shampoo", "", "Lipstick Case"],
        "categories": [["lips"], ["nails"], ["nails", "red"], ["hair"], [], ["lips"]],
    }
)
# The features of an evidence fitted without a sequence model (the fixtures'): all but `sequence`.
FEATURE_NAMES = tuple(f for f in ALL_FEATURES if f != "sequence")
F = {name: i for i, name in enumerate(FEATURE_NAMES)}


@pytest.fixture
def ev() -> Evidence:
    return Evidence.fit(TRAIN, ITEMS, CFG)


def test_item_tables(ev):
    t = ev.item_tables().set_index("item_id")
    assert t.loc["b", "trans_ids"] == ["c", "d"] and t.loc["b", "trans_counts"] == [2, 1]  # ties: id order
    assert t.loc["c", "cooc_ids"] == ["b", "e", "a", "d"] and t.loc["c", "cooc_counts"] == [2, 2, 1, 1]
    assert t["popularity"].to_dict() == {"a": 1, "b": 3, "c": 3, "d": 2, "e": 2, "f": 0}
    assert t.loc["c", "categories"] == ["nails", "red"]
    assert t.loc["b", "title_tokens"] == ["blue", "nail", "polish"]
    assert t.attrs["evidence"]["config"]["top_k"] == 10
    small = Evidence.fit(TRAIN, ITEMS, EvidenceConfig(top_k=1, window=2)).item_tables().set_index("item_id")
    assert small.loc["c", "cooc_ids"] == ["b"] and small.loc["c", "cooc_counts"] == [2]


def test_title_tokens():
    assert title_tokens("The Red-Lipstick 2.5 oz, for Lips!", 2) == ["red", "lipstick"]
    assert title_tokens("a b c", 5) == []


def test_features_by_hand(ev):
    X = ev.features(["a", "b"], ["c", "d", "e", "f"])
    assert X.shape == (4, len(FEATURE_NAMES))
    # transitions from the last item b: b->c 2, b->d 1
    np.testing.assert_allclose(X[:, F["trans_last"]], np.log1p([2, 1, 0, 0]))
    # recent (b weight 1, a weight 0.5): a->b only, so same as last
    np.testing.assert_allclose(X[:, F["trans_recent"]], np.log1p([2, 1, 0, 0]))
    # co-occurrence (window 2): c: b 2 + 0.5 * a 1; d: b 2 (u1 distance 2, u4) + a 0; e: b 1
    np.testing.assert_allclose(X[:, F["cooc_hist"]], np.log1p([2.5, 2, 1, 0]))
    np.testing.assert_allclose(X[:, F["popularity"]], np.log1p([3, 2, 2, 0]))
    # categories: history weights b 1 (nails), a 0.5 (lips); c has nails, red -> (1 + 0) / 2 / 1.5
    np.testing.assert_allclose(X[:, F["category_overlap"]], [0.5 / 1.5, 0, 0, 0.5 / 1.5])
    assert X[0, F["title_sim"]] > X[3, F["title_sim"]] > 0 and X[1, F["title_sim"]] == 0
    assert X[:, F["retriever_rank"]].tolist() == [0, 1, 2, 3]


def test_own_target_subtraction(ev):
    # u1's training target c at position 2 after a, b: its own pairs b->c (transition), (b,c), (a,c)
    own = ev.features(["a", "b"], ["c", "e"], own_target="c")
    plain = ev.features(["a", "b"], ["c", "e"])
    np.testing.assert_allclose(own[0, F["trans_last"]], np.log1p(1))
    np.testing.assert_allclose(own[0, F["cooc_hist"]], np.log1p(1 + 0.5 * 0))
    np.testing.assert_allclose(own[0, F["popularity"]], np.log1p(2))
    np.testing.assert_allclose(own[1], plain[1])  # other candidates untouched
    np.testing.assert_allclose(own[0, F["title_sim"]], plain[0, F["title_sim"]])
    # same as refitting without that interaction's pairs: u1 becomes a, b | d (no pairs through c)
    refit = Evidence.fit({**TRAIN, "u1": ["a", "b"], "u1b": ["d"]}, ITEMS, CFG)
    ref = refit.features(["a", "b"], ["c"])
    np.testing.assert_allclose(own[0, :4], ref[0, :4])


def test_round_trip_through_tables_and_parquet(ev, tmp_path):
    X = ev.features_batch([["a", "b"], ["c"], []], [["c", "d"], ["e", "f"], ["a", "b"]], ["c", None, None])
    ev.fit_buckets(X)
    ev2 = Evidence.from_item_tables(ev.item_tables())
    np.testing.assert_array_equal(
        ev2.features_batch([["a", "b"], ["c"], []], [["c", "d"], ["e", "f"], ["a", "b"]], ["c", None, None]),
        X,
    )
    ev.save(tmp_path / "ev")
    ev3 = Evidence.load(tmp_path / "ev")
    np.testing.assert_array_equal(
        ev3.features_batch([["a", "b"], ["c"], []], [["c", "d"], ["e", "f"], ["a", "b"]], ["c", None, None]),
        X,
    )
    np.testing.assert_array_equal(ev3.buckets(X), ev.buckets(X))


def test_buckets():
    ev = Evidence(CFG)
    with pytest.raises(RuntimeError, match="fit_buckets"):
        ev.buckets(np.zeros((1, 2, len(ev.feature_names))))
    x = np.zeros((10, 1, len(ev.feature_names)))
    x[:, 0, 0] = [0, 0, 0, 0, 1, 2, 3, 4, 5, 6]
    ev.fit_buckets(x)
    b = ev.buckets(x)
    assert b[:, 0, 0].tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 3, 3]
    assert b.min() >= 0 and b.max() <= 3 and b.dtype == np.int64
    # Finer buckets (PromptConfig.n_buckets): the values above the minimum split into n_buckets - 1 ranges.
    ev.fit_buckets(x, n_buckets=7)
    assert ev.buckets(x)[:, 0, 0].tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="n_buckets"):
        ev.fit_buckets(x, n_buckets=1)


def test_features_on_real_slice_train_matches_test_distribution():
    ds = real_slice(80)
    tr = train_sequences(ds)
    ex, _ = attach_candidates(build_targets(ds, 20), CoocRetriever().fit(tr, ds.items["item_id"]), 10)
    ev = Evidence.fit(tr, ds.items)
    own = [t if s == "train" else None for t, s in zip(ex.target, ex.split, strict=True)]
    X = ev.features_batch(list(ex.history), list(ex.candidates), own)
    assert X.shape == (len(ex), 10, len(FEATURE_NAMES)) and np.isfinite(X).all() and (X >= 0).all()
    np.testing.assert_array_equal(ev.features_batch(list(ex.history), list(ex.candidates), own, chunk=7), X)
    # a list computed alone equals its batch row to the bit (serving batches whichever requests wait: a
    # request's prompt must not depend on them)
    for i in range(0, len(ex), 7):
        np.testing.assert_array_equal(ev.features(ex.history.iat[i], ex.candidates.iat[i], own[i]), X[i])
    # lists of different lengths in one call (what serving batches): each list's rows are its features alone,
    # the rows past a short list's end are zeros
    cut = cut_lists(ex, [2 + k % 9 for k in range(len(ex))], seed=0)
    Xc = ev.features_batch(list(cut.history), list(cut.candidates), own, chunk=7)
    for k in range(0, len(cut), max(len(cut) // 20, 1)):
        n = len(cut.candidates.iat[k])
        np.testing.assert_array_equal(
            Xc[k, :n], ev.features(cut.history.iat[k], cut.candidates.iat[k], own[k])
        )
        assert not Xc[k, n:].any()
    # the content features against their definition, computed densely: the history profile is the sum of the
    # history items' vectors, weighted decay^(steps back), an item seen twice counted twice
    cats, titles = ev.cats.toarray(), ev.title_vec.toarray()
    for k in range(0, len(ex), 11):
        hist = [ev.index[h] for h in ex.history.iat[k] if h in ev.index]
        w = ev.config.decay ** np.arange(len(hist))[::-1]
        cand = [ev.index[c] for c in ex.candidates.iat[k]]
        prof = w @ cats[hist]
        overlap = (cats[cand] @ prof) / np.maximum(cats[cand].sum(1), 1) / max(w.sum(), 1e-12)
        np.testing.assert_allclose(X[k, :, F["category_overlap"]], overlap, rtol=1e-12, atol=1e-15)
        prof = w @ titles[hist]
        cosine = (titles[cand] @ prof) / max(np.linalg.norm(prof), 1e-12)
        np.testing.assert_allclose(X[k, :, F["title_sim"]], cosine, rtol=1e-12, atol=1e-15)
    # subtraction matters: without it the train target's transition evidence is inflated
    Xn = ev.features_batch(list(ex.history), list(ex.candidates))
    tr_m = (ex.split == "train").to_numpy()
    lab = ex.label.to_numpy()
    assert (Xn[tr_m, lab[tr_m], 0] >= X[tr_m, lab[tr_m], 0]).all()
    assert (Xn[tr_m, lab[tr_m], 0] > X[tr_m, lab[tr_m], 0]).mean() > 0.5


@pytest.mark.parametrize(
    "strip, dropped",
    [
        ({"title": ""}, {"title_sim": "no item has title tokens"}),
        ({"categories": [[]] * 6}, {"category_overlap": "no item has categories"}),
        (
            {"title": "", "categories": [[]] * 6},
            {"category_overlap": "no item has categories", "title_sim": "no item has title tokens"},
        ),
    ],
)
def test_features_the_data_cannot_supply_are_dropped(ev, tmp_path, strip, dropped):
    """No titles / no categories: the feature is not computed (it would be 0 for every candidate, a column
    that looks like evidence but says nothing); the other features are unchanged, and the choice survives the
    feature-store round trip and save/load, where the served table alone could not tell."""
    bare = Evidence.fit(TRAIN, ITEMS.assign(**strip), CFG)
    kept = tuple(f for f in FEATURE_NAMES if f not in dropped)
    assert bare.feature_names == kept and bare.dropped_features == dropped
    hist, cands = [["a", "b"], ["c"]], [["c", "d", "e"], ["e", "f", "a"]]
    X = bare.features_batch(hist, cands, ["c", None])
    assert X.shape == (2, 3, len(kept))
    np.testing.assert_array_equal(X, ev.features_batch(hist, cands, ["c", None])[:, :, [F[f] for f in kept]])
    bare.fit_buckets(X)
    assert bare.meta()["features"] == list(kept) and bare.meta()["dropped_features"] == dropped
    bare.save(tmp_path / "ev")
    back = Evidence.load(tmp_path / "ev")
    assert back.feature_names == kept and back.dropped_features == dropped
    np.testing.assert_array_equal(back.features_batch(hist, cands, ["c", None]), X)
    np.testing.assert_array_equal(back.buckets(X), bare.buckets(X))
    # Served rows that happen to carry no text keep the fitted features: the meta decides, not the rows.
    served = ev.item_tables().assign(title_tokens=[[]] * 6, categories=[[]] * 6)
    assert Evidence.from_item_tables(served, ev.meta()).feature_names == FEATURE_NAMES
    with pytest.raises(ValueError, match="columns"):
        bare.fit_buckets(np.zeros((1, 3, len(FEATURE_NAMES))))


def test_evidence_meta_that_does_not_match_is_rejected(ev):
    with pytest.raises(ValueError, match="unknown features"):
        Evidence.from_item_tables(ev.item_tables(), {**ev.meta(), "features": ["trans_last", "title_simm"]})
    ev.fit_buckets(np.zeros((2, 3, len(FEATURE_NAMES))))
    with pytest.raises(ValueError, match="bucket edges for 7 features"):
        Evidence.from_item_tables(ev.item_tables(), {**ev.meta(), "features": ["trans_last", "popularity"]})


def test_sequence_feature_scores_training_lists_out_of_fold_and_round_trips(tmp_path):
    """With sequence.folds >= 2 the SASRec score is the 8th feature. A training list (own target given) is scored
    by the model fitted without its user's fold, so its own next item was never learned; every other list by the
    model fitted on all users. Training lists without their users are refused (they would read a leaked score)."""
    seqs = {f"u{i}": ["a", "b", "c", "d"] if i % 2 else ["b", "c", "e", "f"] for i in range(20)}
    cfg = SequenceConfig(folds=2, max_len=4, d_model=8, n_heads=1, n_layers=1, epochs=3)
    ev = Evidence.fit(seqs, ITEMS, CFG, cfg, seed=0)
    assert ev.feature_names == ALL_FEATURES and ev.dropped_features == {}
    assert len(ev.sequence.folds) == 2
    hist, cands = [["a", "b"], ["b", "c"]], [["c", "d", "e"], ["e", "f", "a"]]
    served = ev.features_batch(hist, cands)[:, :, -1]
    np.testing.assert_allclose(served, ev.sequence.full.scores(hist, cands), rtol=1e-6)
    train = ev.features_batch(hist, cands, ["c", "e"], ["u1", "u2"])[:, :, -1]
    for i, u in enumerate(["u1", "u2"]):
        own_fold = ev.sequence.folds[fold_of(u, 2)].scores(hist[i : i + 1], cands[i : i + 1])
        np.testing.assert_allclose(train[i], own_fold[0], rtol=1e-6)
    assert not np.allclose(train, served)
    with pytest.raises(ValueError, match="need their users"):
        ev.features_batch(hist, cands, ["c", "e"])
    ev.save(tmp_path / "ev")
    back = Evidence.load(tmp_path / "ev")
    assert back.feature_names == ALL_FEATURES
    np.testing.assert_array_equal(
        back.features_batch(hist, cands, ["c", None], ["u1", None]),
        ev.features_batch(hist, cands, ["c", None], ["u1", None]),
    )
    with pytest.raises(ValueError, match="no sequence model"):
        Evidence.from_item_tables(ev.item_tables(), ev.meta())
    assert SequenceFeature.load(tmp_path / "nothing") is None
