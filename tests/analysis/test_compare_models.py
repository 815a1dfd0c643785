"""analysis/compare_models.py: the top-1 breakdown on hand-made rankings (the paired CIs are tested end to end in
test_local_run.py)."""

import pytest

from analysis.compare_models import top1_breakdown


def test_top1_breakdown_splits_wins_by_whether_the_label_was_upstream_first():
    labels = [0, 0, 2, 1, 3]
    a = [
        [0, 1, 2, 3],
        [0, 2, 1, 3],
        [0, 2, 1, 3],
        [0, 1, 2, 3],
        [3, 0, 1, 2],
    ]  # a always keeps 0 on top but once
    b = [[1, 0, 2, 3], [0, 1, 2, 3], [2, 0, 1, 3], [1, 0, 2, 3], [1, 3, 0, 2]]
    out = top1_breakdown(a, b, labels, "ar", "ar_sft")
    assert out["label_first"] == {"lists": 2, "ar_wins": 1, "ar_sft_wins": 0}
    assert out["label_not_first"] == {"lists": 3, "ar_wins": 1, "ar_sft_wins": 2}
    assert out["top1_is_first"] == {"ar": pytest.approx(4 / 5), "ar_sft": pytest.approx(1 / 5)}
    # Net top-1 wins over all lists equal n * (recall@1 of A - recall@1 of B).
    r1 = lambda rs: sum(r[0] == y for r, y in zip(rs, labels, strict=True)) / len(labels)  # noqa: E731
    wins = sum(c["ar_wins"] - c["ar_sft_wins"] for c in (out["label_first"], out["label_not_first"]))
    assert wins == pytest.approx(len(labels) * (r1(a) - r1(b)))


def test_top1_breakdown_of_identical_rankings_has_no_wins():
    rs = [[1, 0, 2], [0, 2, 1]]
    out = top1_breakdown(rs, rs, [1, 2], "x", "y")
    assert out["label_first"]["lists"] == 0 and out["label_not_first"] == {
        "lists": 2,
        "x_wins": 0,
        "y_wins": 0,
    }
    assert out["top1_is_first"] == {"x": 0.5, "y": 0.5}
