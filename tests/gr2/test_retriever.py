"""Co-occurrence retriever: hand-computed scores, exclusion, popularity fill, own-target subtraction."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from gr2.config import RetrieverConfig
from gr2.data import build_targets, train_sequences
from gr2.retriever import CoocRetriever
from tests.gr2.toys import real_slice

CFG = RetrieverConfig(window=2, recent=2, decay=0.5)
TRAIN = {"u1": ["a", "b", "c", "d"], "u2": ["b", "c", "e"], "u3": ["c", "e"], "u4": ["g"]}
CATALOG = ["a", "b", "c", "d", "e", "f", "g"]


@pytest.fixture
def toy() -> CoocRetriever:
    return CoocRetriever(CFG).fit(TRAIN, CATALOG)


def test_counts_and_popularity(toy):
    C = toy.C.toarray()
    i = toy.index
    assert C[i["b"], i["c"]] == C[i["c"], i["b"]] == 2  # u1 and u2, distance 1
    assert C[i["a"], i["c"]] == 1  # distance 2 is inside the window
    assert C[i["a"], i["d"]] == 0  # distance 3 is not
    assert C[i["c"], i["e"]] == 2
    # internal order = popularity desc, then id
    assert toy.items.tolist() == ["c", "b", "e", "a", "d", "g", "f"]
    assert toy.pop.tolist() == [3, 2, 2, 1, 1, 1, 0]


def test_scores_by_hand_with_exclusion_ties_and_fill(toy):
    items, scores = toy.topn(["a", "b"], 5)
    # b (weight 1) votes c 2, d 1, e 1; a (weight 0.5) votes c 1 -> c 2.5; d/e tie -> more popular e first;
    # then the popularity fill (g before f); history items a, b are excluded
    assert items == ["c", "e", "d", "g", "f"]
    assert scores.tolist() == [2.5, 1.0, 1.0, 0.0, 0.0]
    items, _ = toy.topn(["a", "b"], 3, exclude=["a", "b", "c"])
    assert items == ["e", "d", "g"]


def test_own_target_is_subtracted(toy):
    # u1's training target c at position 2 (history a, b): its pairs (b,c) and (a,c) are removed
    items, scores = toy.topn(["a", "b"], 4, own_target="c")
    assert items == ["c", "e", "d", "g"] and scores.tolist() == [1.0, 1.0, 1.0, 0.0]
    # target d at position 3: its only pairs are its own -> no votes; its popularity drops 1 -> 0, so it
    # moves behind g (pop 1) in the fill, ahead of f (pop 0, larger id)
    assert toy.topn(["a", "b", "c"], 4)[0] == ["e", "d", "g", "f"]
    items, scores = toy.topn(["a", "b", "c"], 4, own_target="d")
    assert items == ["e", "g", "d", "f"] and scores.tolist() == [2.5, 0.0, 0.0, 0.0]


def test_unknown_items_and_short_catalog(toy):
    items, scores = toy.topn(["zzz"], 3)
    assert items == ["c", "b", "e"] and scores.tolist() == [0.0, 0.0, 0.0]
    items, _ = toy.topn(["a", "b", "c", "d", "e"], 5)
    assert items == ["g", "f"]  # only two items left to recommend


def _reference(r: CoocRetriever, hist, n, own, exclude, train_pop):
    """Slow, obviously-correct scoring from the definition."""
    cfg = r.config
    score = Counter()
    for k, h in enumerate(reversed(hist[-cfg.recent :])):
        if h not in r.index:
            continue
        row = r.C[r.index[h]].toarray().ravel()
        for c in np.flatnonzero(row):
            v = row[c]
            if r.items[c] == own:
                v -= sum(1 for j in range(1, cfg.window + 1) if j <= len(hist) and hist[-j] == h)
            score[r.items[c]] += cfg.decay**k * v
    excl = set(exclude)
    scored = [(round(s, 9), x) for x, s in score.items() if round(s, 9) > 0 and x not in excl]
    order = {x: i for i, x in enumerate(r.items)}
    scored.sort(key=lambda t: (-t[0], order[t[1]]))
    out = scored[:n]
    rest = [x for x in r.items if x not in excl and x not in {x for _, x in scored}]
    rest.sort(key=lambda x: (-(train_pop[x] - (x == own)), x))
    out += [(0.0, x) for x in rest[: n - len(out)]]
    return [x for _, x in out], [s for s, _ in out]


def test_batch_matches_reference_on_real_slice():
    ds = real_slice(60)
    tr = train_sequences(ds)
    r = CoocRetriever(RetrieverConfig(window=3, recent=5, decay=0.7)).fit(tr, ds.items["item_id"])
    t = build_targets(ds, 20)
    t = t.iloc[np.random.default_rng(0).choice(len(t), 40, replace=False)]
    own = [x if s == "train" else None for x, s in zip(t.target, t.split, strict=True)]
    known = [r.known_history(u, p, h) for u, p, h in zip(t.user_id, t.target_pos, t.history, strict=True)]
    items, scores = r.topn_batch(list(t.history), 10, own, known)
    pop = Counter(x for s in tr.values() for x in s)
    pop = {x: pop.get(x, 0) for x in r.items}
    for i in range(len(t)):
        ref_items, ref_scores = _reference(r, list(t.history.iat[i]), 10, own[i], known[i], pop)
        assert items[i] == ref_items
        np.testing.assert_allclose(scores[i], ref_scores, atol=1e-9)
        assert not set(items[i]) & set(known[i])
    # the single-example API gives the same lists
    assert r.topn(list(t.history.iat[0]), 10, own[0], known[0])[0] == items[0]
