"""Reasoning teacher: listwise fit, rejection sampling, traces that cite evidence, SFT records."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gr2.candidates import attach_candidates
from gr2.config import Profile, SIDConfig, TeacherConfig
from gr2.data import build_targets, data_root, load_dataset, train_sequences
from gr2.evidence import FEATURE_NAMES, Evidence
from gr2.prompt import parse_response
from gr2.retriever import CoocRetriever
from gr2.sid import SemanticIds, build_semantic_ids
from gr2.teacher import (
    Teacher,
    build_sft_records,
    build_sft_records_from_arrays,
    fit_teacher,
    make_trace,
    rejection_sample,
)
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
    # Learned direction: transition and co-occurrence raise the score, popularity (noise) barely matters.
    c = t.contributions(xv[:1])[0]
    assert c.shape == (10, len(NAMES))
    np.testing.assert_allclose(c.sum(0), 0.0, atol=1e-9)  # relative to the list mean
    t.save(tmp_path / "t.json")
    back = Teacher.load(tmp_path / "t.json")
    np.testing.assert_allclose(back.scores(xv[:5]), t.scores(xv[:5]))
    sub = fit_teacher(x, y, NAMES, TeacherConfig(max_train_lists=500))
    assert sub.recall_at(xv, yv, 1) > floor + 0.1


def test_rejection_sample_puts_target_first():
    rng = np.random.default_rng(0)
    scores = np.array([2.0, 1.0, 0.5, 0.0])
    r, tries = rejection_sample(scores, 0, rng, TeacherConfig(greedy_first=True))
    assert tries == 1 and list(r) == [0, 1, 2, 3]  # greedy first try is the teacher's own ranking
    kept = [rejection_sample(scores, 2, rng, TeacherConfig(max_tries=8)) for _ in range(300)]
    assert all(r is None or (r[0] == 2 and sorted(r) == [0, 1, 2, 3]) for r, _ in kept)
    frac = np.mean([r is not None for r, _ in kept])
    p2 = np.exp(0.5) / np.exp(scores).sum()  # Plackett-Luce probability that item 2 is sampled first
    assert frac == pytest.approx(1 - (1 - p2) ** 7, abs=0.08)  # 7 sampled tries after the greedy one
    hopeless = np.array([0.0, -1e9])
    assert rejection_sample(hopeless, 1, rng, TeacherConfig(max_tries=5)) == (None, 5)


def test_make_trace_cites_top_candidates_with_evidence():
    b = np.zeros((10, 4), dtype=int)
    b[2] = [3, 2, 0, 0]
    b[0] = [0, 3, 1, 0]
    contrib = np.zeros((10, 4))
    contrib[2] = [1.0, 0.5, 0.0, -0.2]
    contrib[0] = [0.0, 0.8, -0.1, 0.3]
    trace = make_trace(b, np.zeros(10), [2, 0, 5, 1, 3, 4, 6, 7, 8, 9], NAMES, contrib, top_k=3)
    assert trace == (
        "step 1 : [C] follows-last-item <trans_3> co-occurs-with-history <co_2> ; "
        "step 2 : [A] co-occurs-with-history <co_3> ; "
        "step 3 : [F] no-strong-signal ; top [C] [A] [F]"
    )
    tok = build_tokenizer((4, 4, 4, 1), NAMES)
    assert tok.unk_token_id not in tok(trace, add_special_tokens=False)["input_ids"]
    # Without a ranking the trace follows the scores; default contributions = the buckets.
    scores = np.zeros(10)
    scores[[0, 2, 5]] = [3.0, 2.0, 1.0]
    assert make_trace(b, scores, None, NAMES).endswith("top [A] [C] [F]")


def _toy_sids(n_items: int) -> SemanticIds:
    codes = {f"i{k}": (k % 4, (k // 4) % 4, k // 16, 0) for k in range(n_items)}
    return SemanticIds(codes=codes, codebook_sizes=(4, 4, 4, 1))


def test_build_sft_records_from_arrays_variants():
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
        recs = build_sft_records_from_arrays(
            examples, x, b, NAMES, _toy_sids(64), teacher, tok, cfg, seed=0, variant=variant, stats=stats
        )
        assert 0.3 < stats["kept_frac"] < 1.0 and stats["n_kept"] == len(recs)
        out[variant] = (recs, stats)
    (rt, st), (ra, sa) = out["trace"], out["ar_no_trace"]
    assert len(rt) == len(ra) and sa["mean_trace_tokens"] == 0 and 20 < st["mean_trace_tokens"] < 80
    assert st["mean_answer_tokens"] == sa["mean_answer_tokens"] == 26
    for a, c in zip(rt, ra, strict=True):
        assert a.prompt_ids == c.prompt_ids  # same prompt
        pa, pc = parse_response(a.response_ids, 10, tok), parse_response(c.response_ids, 10, tok)
        assert pa.ranking == pc.ranking and pa.ranking is not None  # same sampled ranking
        text = tok.decode(a.response_ids, skip_special_tokens=True)
        assert text.startswith("step 1 : ")
        assert text.split(" top ")[1].split()[:3] == [f"[{chr(65 + i)}]" for i in pa.ranking[:3]]
        assert (
            max(a.response_weights) == cfg.sft.answer_weight > min(a.response_weights) == cfg.sft.trace_weight
        )
    # Every kept example has its held-out item first.
    assert st["kept_rows"] == sa["kept_rows"] and len(st["kept_rows"]) == len(rt)
    for rec, row in zip(rt, st["kept_rows"], strict=True):
        assert parse_response(rec.response_ids, 10, tok).ranking[0] == y[row]
    with pytest.raises(ValueError, match="variant"):
        build_sft_records_from_arrays(examples, x, b, NAMES, _toy_sids(64), teacher, tok, cfg, variant="x")


def test_integration_on_real_slice(tmp_path):
    """ml-latest-small, 80 users: retriever -> examples -> evidence -> teacher -> SFT records that parse."""
    ds = load_dataset(data_root() / "ml-latest-small")
    users = ds.interactions["user_id"].drop_duplicates().iloc[:80]
    ds.interactions = ds.interactions[ds.interactions["user_id"].isin(users)].reset_index(drop=True)
    ds.items = ds.items[ds.items["item_id"].isin(ds.interactions["item_id"])].reset_index(drop=True)
    tr = train_sequences(ds)
    cfg = Profile()
    examples, _ = attach_candidates(
        build_targets(ds, cfg.data.history_len), CoocRetriever(cfg.retriever).fit(tr, ds.items["item_id"]), 10
    )
    ev = Evidence.fit(tr, ds.items, cfg.evidence)
    train = examples[examples["split"] == "train"].reset_index(drop=True)
    x = ev.features_batch(train["history"].tolist(), train["candidates"].tolist(), train["target"].tolist())
    teacher = fit_teacher(x, train["label"].to_numpy(), FEATURE_NAMES, cfg.teacher)
    assert teacher.recall_at(x, train["label"].to_numpy()) > float((train["label"] == 0).mean())
    # Content-free SIDs keep this test fast (the title model is tested in test_sid.py).
    sids = build_semantic_ids(
        "ml150", ds.items, tr, SIDConfig(content_weight=0.0, kmeans_iters=5), cache_dir=tmp_path
    )
    tok = tokenizer_for(sids, FEATURE_NAMES, cfg.prompt)
    stats: dict = {}
    recs = build_sft_records(examples, ev, sids, teacher, tok, cfg, seed=0, stats=stats)
    assert ev.bucket_edges is not None and stats["n_examples"] == len(train) > 100
    assert len(recs) == stats["n_kept"] > 0.3 * len(train)
    assert stats["max_prompt_tokens"] <= 1 + 2 + 80 + 10 * (5 + len(FEATURE_NAMES))
    for r in recs[:50]:
        res = parse_response(r.response_ids, 10, tok)
        assert res.reason is None and sorted(res.ranking) == list(range(10))


def test_answer_order_keeps_the_argued_top_and_the_retriever_tail():
    from gr2.teacher import answer_order

    r = [6, 2, 9, 0, 8, 1, 7, 3, 5, 4]
    assert answer_order(r, 3).tolist() == [6, 2, 9, 0, 1, 3, 4, 5, 7, 8]
    assert answer_order(r, 3, "sampled").tolist() == r
    assert sorted(answer_order(r, 0).tolist()) == answer_order(r, 0).tolist() == list(range(10))
    with pytest.raises(ValueError, match="tail_order"):
        answer_order(r, 3, "random")
