"""Reasoning teacher: listwise fit, score levels, SFT records (trace = per-candidate verdicts, answer = the
held-out item first then the teacher's order)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gr2.candidates import attach_candidates
from gr2.config import Profile, PromptConfig, SIDConfig, TeacherConfig
from gr2.data import build_targets, data_root, load_dataset, train_sequences
from gr2.evidence import FEATURE_NAMES, Evidence, bucketize
from gr2.prompt import parse_response
from gr2.retriever import CoocRetriever
from gr2.sid import SemanticIds, build_semantic_ids
from gr2.stages.prepare import list_features
from gr2.teacher import Teacher, answer_ranking, build_sft_records, fit_teacher, score_quantiles
from gr2.tokenizer import build_tokenizer, tokenizer_for

NAMES = ("trans_last", "cooc_hist", "popularity", "retriever_rank")


def _synthetic(n_lists: int, seed: int, n: int = 10):
    """Lists where the target has higher transition/co-occurrence than the rest; popularity is noise; the
    retriever puts the target first 25% of the time."""
    rng = np.random.default_rng(seed)
    labels = np.where(rng.random(n_lists) < 0.25, 0, rng.integers(0, n, n_lists))
    x = np.zeros((n_lists, n, len(NAMES)))
    x[:, :, 0] = rng.exponential(1.0, (n_lists, n))
    x[:, :, 1] = rng.exponential(1.0, (n_lists, n))
    x[:, :, 2] = rng.normal(size=(n_lists, n))
    x[np.arange(n_lists), labels, 0] += 1.5
    x[np.arange(n_lists), labels, 1] += 0.8
    x[:, :, 3] = np.arange(n)[None, :]
    buckets = np.clip((x[:, :, :3] * 1.2).astype(int), 0, 3)
    buckets = np.concatenate([buckets, np.minimum(x[:, :, 3:], 3).astype(int)], axis=2)
    return x, buckets, labels


def test_teacher_beats_floor_on_validation(tmp_path):
    x, _, y = _synthetic(3000, 0)
    xv, _, yv = _synthetic(1000, 1)
    t = Teacher.fit(x, y, NAMES)
    floor = float((yv == 0).mean())
    r1 = t.recall_at(xv, yv, 1)
    assert r1 > floor + 0.2 and t.recall_at(xv, yv, 3) > r1
    t.save(tmp_path / "t.json")
    back = Teacher.load(tmp_path / "t.json")
    np.testing.assert_allclose(back.scores(xv[:5]), t.scores(xv[:5]))
    np.testing.assert_array_equal(back.levels(xv[:50]), t.levels(xv[:50]))
    sub = fit_teacher(x, y, NAMES, TeacherConfig(max_train_lists=500, inputs="raw"), score_levels=8)
    assert sub.recall_at(xv, yv, 1) > floor + 0.1


def test_score_levels_follow_the_score_in_equal_count_levels():
    x, _, y = _synthetic(3000, 0)
    t = Teacher.fit(x, y, NAMES, score_levels=8)
    assert len(t.score_edges) == 7 and np.all(np.diff(t.score_edges) > 0)
    lv, sc = t.levels(x), t.scores(x)
    assert lv.min() == 0 and lv.max() == 7
    # Monotone in the score: a higher level never has a lower score.
    order = np.argsort(sc.ravel())
    assert np.all(np.diff(lv.ravel()[order]) >= 0)
    # Level shares follow score_quantiles: equal counts, so low-scoring lists keep their order too.
    share = np.bincount(lv.ravel(), minlength=8) / lv.size
    expected = np.diff(np.concatenate([[0.0], score_quantiles(8), [1.0]]))
    np.testing.assert_allclose(share, expected, atol=0.01)
    np.testing.assert_allclose(expected, np.full(8, 1 / 8))
    # The held-out item is usually the best-levelled candidate of its list.
    assert float((lv[np.arange(len(y)), y] == lv.max(1)).mean()) > 0.5


def test_answer_ranking_teacher_or_held_out_item_first():
    scores = [0.1, 0.9, 0.5, 0.5, -1.0]
    assert answer_ranking(scores, 4) == [
        1,
        2,
        3,
        0,
        4,
    ]  # the teacher's order; ties (C, D) keep retriever order
    assert answer_ranking(scores, 4, "label") == [
        4,
        1,
        2,
        3,
        0,
    ]  # the held-out item first, then the teacher's
    assert answer_ranking(scores, 1, "label") == [1, 2, 3, 0, 4]
    # "levels": by the trace's levels, ties (A, C, D at level 1) in retriever order, whatever the scores say.
    assert answer_ranking(scores, 4, "levels", [1, 2, 1, 1, 0]) == [1, 0, 2, 3, 4]
    with pytest.raises(ValueError, match="levels"):
        answer_ranking(scores, 4, "levels")
    with pytest.raises(ValueError, match="teacher.answer"):
        answer_ranking(scores, 1, "sampled")


def _toy_sids(n_items: int) -> SemanticIds:
    codes = {f"i{k}": (k % 4, (k // 4) % 4, k // 16, 0) for k in range(n_items)}
    return SemanticIds(codes=codes, codebook_sizes=(4, 4, 4, 1))


def test_build_sft_records_variants():
    x, b, y = _synthetic(200, 3)
    rng = np.random.default_rng(3)
    examples = pd.DataFrame(
        {
            "history": [[f"i{k}" for k in rng.integers(0, 64, 5)] for _ in range(200)],
            "candidates": [[f"i{k}" for k in rng.permutation(64)[:10]] for _ in range(200)],
            "label": y,
        }
    )
    teacher = Teacher.fit(x, y, NAMES)
    tok = build_tokenizer((4, 4, 4, 1), NAMES)
    cfg = Profile()
    out = {}
    for variant in ("trace", "ar_no_trace"):
        stats: dict = {}
        recs = build_sft_records(
            examples, x, b, NAMES, _toy_sids(64), teacher, tok, cfg, variant=variant, stats=stats
        )
        assert stats["n_records"] == len(recs) == 200  # every list: nothing is dropped
        out[variant] = (recs, stats)
    (rt, st), (ra, sa) = out["trace"], out["ar_no_trace"]
    assert sa["mean_trace_tokens"] == 0 and st["mean_trace_tokens"] == 20  # 10 x (label, level)
    assert st["mean_answer_tokens"] == sa["mean_answer_tokens"] == 26
    levels, scores = teacher.levels(x), teacher.scores(x)
    for i, (a, c) in enumerate(zip(rt, ra, strict=True)):
        assert a.prompt_ids == c.prompt_ids  # same prompt
        pa, pc = parse_response(a.response_ids, 10, tok), parse_response(c.response_ids, 10, tok)
        assert pa.ranking == pc.ranking == answer_ranking(scores[i], int(y[i]))  # same answer: the teacher's
        words = tok.decode(a.response_ids, skip_special_tokens=True).split()
        assert words[:20:2] == [f"[{chr(65 + k)}]" for k in range(10)]  # every candidate, in prompt order
        assert words[1:20:2] == [f"<score_{v}>" for v in levels[i]]  # with the teacher's level
        assert words[20] == "{"
        assert a.response_weights[:20] == [cfg.sft.trace_weight] * 20
        assert set(a.response_weights[20:]) == {cfg.sft.answer_weight}
    # teacher.answer "label": the same trace, the held-out item moved to the front of the answer.
    lab_cfg = Profile(teacher=TeacherConfig(answer="label"))
    lab = build_sft_records(examples, x, b, NAMES, _toy_sids(64), teacher, tok, lab_cfg)
    assert [parse_response(r.response_ids, 10, tok).ranking[0] for r in lab] == y.tolist()
    assert all(a.response_ids[:20] == c.response_ids[:20] for a, c in zip(rt, lab, strict=True))
    with pytest.raises(ValueError, match="variant"):
        build_sft_records(examples, x, b, NAMES, _toy_sids(64), teacher, tok, cfg, variant="x")


@pytest.mark.parametrize("item_tokens", ["none", "candidates", "all"])
def test_integration_on_real_slice(tmp_path, item_tokens):
    """ml-latest-small, 80 users: retriever -> examples -> evidence -> teacher -> SFT records that parse."""
    ds = load_dataset(data_root() / "ml-latest-small")
    users = ds.interactions["user_id"].drop_duplicates().iloc[:80]
    ds.interactions = ds.interactions[ds.interactions["user_id"].isin(users)].reset_index(drop=True)
    ds.items = ds.items[ds.items["item_id"].isin(ds.interactions["item_id"])].reset_index(drop=True)
    tr = train_sequences(ds)
    cfg = Profile(prompt=PromptConfig(item_tokens=item_tokens))
    examples, _ = attach_candidates(
        build_targets(ds, cfg.data.history_len), CoocRetriever(cfg.retriever).fit(tr, ds.items["item_id"]), 10
    )
    ev = Evidence.fit(tr, ds.items, cfg.evidence)
    train = examples[examples["split"] == "train"].reset_index(drop=True)
    x = list_features(ev, train)
    edges = ev.fit_buckets(x, cfg.prompt.n_buckets)
    teacher = fit_teacher(
        x,
        train["label"].to_numpy(),
        ev.feature_names,
        cfg.teacher,
        cfg.prompt.score_levels,
        bucket_edges=edges,
    )
    assert teacher.recall_at(x, train["label"].to_numpy()) > float((train["label"] == 0).mean())
    # Content-free SIDs keep this test fast (the title model is tested in test_sid.py).
    sids = build_semantic_ids(
        "ml150", ds.items, tr, SIDConfig(content_weight=0.0, kmeans_iters=5), cache_dir=tmp_path
    )
    tok = tokenizer_for(sids, ev.feature_names, cfg.prompt)
    stats: dict = {}
    recs = build_sft_records(train, x, ev.buckets(x), ev.feature_names, sids, teacher, tok, cfg, stats=stats)
    assert len(recs) == stats["n_records"] == len(train) > 100
    # <bos> 'candidates' + per candidate its label, evidence buckets (+ SID); "all" adds 'history' + its SIDs.
    per_candidate = 1 + len(ev.feature_names) + (4 if item_tokens != "none" else 0)
    if item_tokens == "all":
        assert 2 + 10 * per_candidate + 1 + 4 < stats["max_prompt_tokens"] <= 2 + 10 * per_candidate + 81
    else:
        assert stats["max_prompt_tokens"] == 2 + 10 * per_candidate
    for r in recs[:50]:
        res = parse_response(r.response_ids, 10, tok)
        assert res.reason is None and sorted(res.ranking) == list(range(10))


def test_prepare_without_titles_or_categories_drops_their_features(tmp_path):
    """ml-latest-small, 40 users (their items only), titles and categories emptied: the teacher, the prompt
    vocabulary and the SFT prompts carry no title_sim / category_overlap (no constant bucket that looks like
    evidence), and the stats say why."""
    from gr2.stages.prepare import prepare_sft

    ds = load_dataset(data_root() / "ml-latest-small")
    users = ds.interactions["user_id"].drop_duplicates().iloc[:40]
    ds.interactions = ds.interactions[ds.interactions["user_id"].isin(users)].reset_index(drop=True)
    ds.items = ds.items[ds.items["item_id"].isin(ds.interactions["item_id"])].reset_index(drop=True)
    ds.items = ds.items.assign(title="", categories=[[] for _ in range(len(ds.items))])
    cfg = Profile(sid=SIDConfig(content_weight=0.0, kmeans_iters=5))
    tr = train_sequences(ds)
    examples, _ = attach_candidates(
        build_targets(ds, cfg.data.history_len), CoocRetriever(cfg.retriever).fit(tr, ds.items["item_id"]), 10
    )
    sft = prepare_sft(examples, ds, cfg)
    kept = [
        f for f in FEATURE_NAMES if f not in ("category_overlap", "title_sim", "sequence")
    ]  # no sequence model
    assert sft.stats["features"] == kept and sft.teacher.feature_names == tuple(kept)
    assert sft.stats["dropped_features"] == {
        "category_overlap": "no item has categories",
        "title_sim": "no item has title tokens",
    }
    vocab = sft.tokenizer.get_vocab()
    assert "<trans_0>" in vocab and not any(t.startswith(("<sim_", "<cat_")) for t in vocab)
    n = len(sft.records["trace"][0].prompt_ids)
    assert n == 2 + 10 * (1 + len(kept))  # <bos> 'candidates' + per candidate its label and kept buckets


def test_bucketed_teacher_reads_only_the_prompts_buckets(tmp_path):
    """teacher.inputs "buckets": two lists whose evidence falls in the same prompt buckets get the same scores
    and levels, whatever their raw values; the fit still learns (beats the floor), and save/load keeps it."""
    x, _, y = _synthetic(3000, 0)
    xv, _, yv = _synthetic(1000, 1)
    ev = Evidence()
    ev.feature_names = NAMES
    edges = ev.fit_buckets(x, 8)
    cfg = TeacherConfig()  # inputs "buckets", the default
    t = fit_teacher(x, y, NAMES, cfg, score_levels=8, bucket_edges=edges)
    assert t.bucket_values is not None and t.bucket_values.shape == (len(NAMES), 8)
    # Each bucket stands for the mean training value inside it, so values rise with the bucket.
    assert np.all(np.diff(t.bucket_values, axis=1) > 0)
    # Move every value to another point of its own bucket: the teacher cannot tell.
    b = bucketize(xv, edges)
    hi = np.concatenate([edges, np.full((len(NAMES), 1), np.inf)], axis=1)
    f = np.arange(len(NAMES))
    # The top of each bucket (a value equal to an edge stays below it); the open top bucket moves up by 1.
    inside = np.where(np.isfinite(hi[f, b]), hi[f, b], xv + 1.0)
    assert np.array_equal(bucketize(inside, edges), b)
    np.testing.assert_allclose(t.scores(inside), t.scores(xv))
    raw = fit_teacher(x, y, NAMES, TeacherConfig(inputs="raw"), score_levels=8)
    assert not np.allclose(raw.scores(inside), raw.scores(xv))  # a raw teacher does see the move
    assert t.recall_at(xv, yv, 1) > float((yv == 0).mean()) + 0.1
    t.save(tmp_path / "t.json")
    back = Teacher.load(tmp_path / "t.json")
    np.testing.assert_array_equal(back.levels(inside), t.levels(xv))
    with pytest.raises(ValueError, match="bucket edges"):
        fit_teacher(x, y, NAMES, cfg, score_levels=8)
    with pytest.raises(ValueError, match="teacher.inputs"):
        fit_teacher(x, y, NAMES, TeacherConfig(inputs="bucket"), score_levels=8, bucket_edges=edges)
