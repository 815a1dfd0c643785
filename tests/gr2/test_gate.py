"""The gate: one test per rule, each showing the rule can flip the decision on its own."""

import pandas as pd
import pytest

from gr2.config import GateConfig
from gr2.gate import decide, paired_comparison

CFG = GateConfig(min_validity=0.99, max_gap_to_ar=0.01, min_speedup=2.4, require_beats_floor=True)


def rows(**cand_overrides):
    cand = {
        "model": "diffusion",
        "tau": 0.9,
        "recall@1": 0.40,
        "validity": 0.995,
        "speedup_vs_ar": 3.0,
        "delta_vs_floor": {"recall@1": [0.05, 0.15]},
    }
    cand.update(cand_overrides)
    return [
        {"model": "floor", "tau": None, "recall@1": 0.30, "validity": 1.0, "delta_vs_floor": {}},
        {"model": "ar", "tau": None, "recall@1": 0.405, "validity": 1.0, "speedup_vs_ar": 1.0},
        {"model": "ltr", "tau": None, "recall@1": 0.395, "validity": 1.0},
        cand,
    ]


def test_all_rules_pass_with_one_reason_each():
    paired = {"n_lists": 500, "candidate": 0.40, "production": 0.39, "delta": 0.01, "ci95": [-0.01, 0.03]}
    d = decide(rows(), "diffusion", True, {"model": "old", "recall@1": 0.39, "run_id": "r0"}, CFG, paired)
    assert d.passed
    assert set(d.checks) == {"data", "floor", "ar_gap", "ltr", "validity", "speedup", "production"}
    assert len(d.reasons) == 7 and all(r.startswith("PASS") for r in d.reasons)
    floor_reason = next(r for r in d.reasons if " floor:" in r)
    assert "0.4000 vs floor 0.3000" in floor_reason and "excludes zero" in floor_reason


def test_data_validation_failure_blocks():
    d = decide(rows(), "diffusion", {"success": False, "failures": "history nulls"}, None, CFG)
    assert not d.passed and d.checks["data"] is False
    assert "history nulls" in d.reasons[0]
    assert decide(rows(), "diffusion", None, None, CFG).checks["data"] is False


def test_must_beat_floor_and_ci_is_reported():
    d = decide(rows(**{"recall@1": 0.30}), "diffusion", True, None, CFG)
    assert not d.passed and d.checks["floor"] is False
    d = decide(
        rows(**{"recall@1": 0.31, "delta_vs_floor": {"recall@1": [-0.01, 0.03]}}),
        "diffusion",
        True,
        None,
        GateConfig(max_gap_to_ar=0.2, max_gap_to_ltr=0.2),
    )
    assert d.checks["floor"] is True and "includes zero" in d.reasons[1]
    # not required: a loss to the floor is reported but does not block
    d = decide(
        rows(**{"recall@1": 0.29}),
        "diffusion",
        True,
        None,
        GateConfig(max_gap_to_ar=0.2, max_gap_to_ltr=0.2, require_beats_floor=False),
    )
    assert d.passed and d.checks["floor"] is None


def test_gap_to_ar():
    d = decide(rows(**{"recall@1": 0.39}), "diffusion", True, None, CFG)  # gap 0.015 > 0.01
    assert not d.passed and d.checks["ar_gap"] is False and "+0.0150" in d.reasons[2]
    no_ar = [r for r in rows() if r["model"] != "ar"]
    d = decide(no_ar, "diffusion", True, None, CFG)
    assert d.passed and d.checks["ar_gap"] is None


def test_not_below_the_gbdt_beyond_the_margin():
    # ltr 0.395: a candidate at 0.386 is 0.009 below (allowed), at 0.384 it is 0.011 below (refused), even
    # though it still beats the floor and is within the AR margin (with an AR row at 0.39).
    ar_close = [dict(r, **{"recall@1": 0.39}) if r["model"] == "ar" else r for r in rows()]
    d = decide(
        [r if r["model"] != "diffusion" else dict(r, **{"recall@1": 0.386}) for r in ar_close],
        "diffusion",
        True,
        None,
        CFG,
    )
    assert d.passed and d.checks["ltr"] is True
    d = decide(
        [r if r["model"] != "diffusion" else dict(r, **{"recall@1": 0.384}) for r in ar_close],
        "diffusion",
        True,
        None,
        CFG,
    )
    assert (
        not d.passed and d.checks["ltr"] is False and d.checks["ar_gap"] is True and d.checks["floor"] is True
    )
    assert "ltr (GBDT) recall@1 0.3950 - candidate 0.3840 = +0.0110 (max 0.01)" in d.reasons[3]
    no_ltr = [r for r in rows() if r["model"] != "ltr"]
    assert decide(no_ltr, "diffusion", True, None, CFG).checks["ltr"] is None


def test_validity_threshold():
    d = decide(rows(validity=0.98), "diffusion", True, None, CFG)
    assert not d.passed and d.checks["validity"] is False


def test_speedup_only_when_reported():
    d = decide(rows(speedup_vs_ar=2.0), "diffusion", True, None, CFG)
    assert not d.passed and d.checks["speedup"] is False and "2.00x" in d.reasons[5]
    d = decide(rows(speedup_vs_ar=None), "diffusion", True, None, CFG)
    assert d.passed and d.checks["speedup"] is None


def test_speedup_reads_the_lower_bound_of_its_interval():
    """A 2.6x point estimate whose timing interval reaches below 2.4x does not pass; a tight one does."""
    d = decide(rows(speedup_vs_ar=2.6, speedup_ci95=[2.3, 2.9]), "diffusion", True, None, CFG)
    assert not d.passed and d.checks["speedup"] is False and "lower bound 2.30x" in d.reasons[5]
    d = decide(rows(speedup_vs_ar=2.6, speedup_ci95=[2.5, 2.7]), "diffusion", True, None, CFG)
    assert d.passed and d.checks["speedup"] is True


def tonight(cand_hits: list[int], prod_hits: list[int]) -> tuple[pd.DataFrame, list, list]:
    """Test lists of 3 candidates, the label first; a model's hit puts it on top, a miss puts it last."""
    examples = pd.DataFrame({"candidates": [["a", "b", "c"]] * len(cand_hits), "label": 0, "user_id": "u"})

    def ranks(hits):
        return [[0, 1, 2] if h else [1, 2, 0] for h in hits]

    return examples, ranks(cand_hits), ranks(prod_hits)


def test_production_rule_pairs_tonights_lists_not_the_stored_figure():
    """The stored production figure (another night's lists) would pass a worse candidate and fail a better one;
    the paired rule on tonight's lists decides the other way both times."""
    # Tonight production gets 60 of 100 lists right and the candidate only 40 of the same (it loses 20, wins none).
    examples, cand, prod = tonight([1] * 40 + [0] * 60, [1] * 60 + [0] * 40)
    paired = paired_comparison(examples, cand, prod, n_boot=500, seed=0)
    assert (paired["candidate"], paired["production"], paired["n_lists"]) == (0.40, 0.60, 100)
    assert paired["delta"] == pytest.approx(-0.20) and paired["ci95"][1] < -0.1
    lucky_old = {"model": "rl", "recall@1": 0.39, "run_id": "r0"}  # measured on an easier night
    d = decide(rows(), "diffusion", True, lucky_old, CFG, paired)
    assert not d.passed and [k for k, v in d.checks.items() if v is False] == ["production"]
    reason = d.reasons[-1]
    assert reason.startswith("FAIL production: recall@1 on tonight's 100 test lists: candidate 0.4000 vs ")
    assert "production rl (run r0) 0.6000, delta -0.2000" in reason and "wholly below -0.005" in reason
    assert "stored figure 0.3900" in reason

    # The reverse: tonight's lists are hard for both; the candidate wins 3 lists and loses 1 against production.
    examples, cand, prod = tonight([1] * 42 + [0] * 58, [1] * 39 + [0] + [1] + [0] * 59)
    paired = paired_comparison(examples, cand, prod, n_boot=500, seed=0)
    assert paired["delta"] == pytest.approx(0.02) and paired["ci95"][0] <= 0.02 <= paired["ci95"][1]
    unlucky_old = {"model": "rl", "recall@1": 0.46}  # the old rule: 0.40 < 0.46 - 0.005 fails
    d = decide(rows(), "diffusion", True, unlucky_old, CFG, paired)
    assert d.passed and d.checks["production"] is True and "not wholly below" in d.reasons[-1]


@pytest.mark.parametrize("hi,ok", [(-0.004, True), (-0.006, False)])
def test_production_rule_fails_only_when_the_whole_interval_is_below_the_tolerance(hi, ok):
    paired = {"n_lists": 500, "candidate": 0.38, "production": 0.40, "delta": -0.02, "ci95": [-0.04, hi]}
    d = decide(rows(), "diffusion", True, {"model": "rl"}, CFG, paired)  # tolerance 0.005
    assert d.checks["production"] is ok and d.passed is ok


def test_production_that_cannot_be_scored_fails_clearly():
    d = decide(rows(), "diffusion", True, None, CFG)
    assert d.passed and d.checks["production"] is None and "no model in production" in d.reasons[-1]
    missing = "s3://b/reranker/production.json: attempt r0/rl/a1 is missing"
    for paired, why in [
        (None, "no paired comparison on tonight's lists was made"),
        ({"error": missing}, missing),
    ]:
        d = decide(rows(), "diffusion", True, {"model": "rl", "run_id": "r0", "recall@1": 0.3}, CFG, paired)
        assert not d.passed and d.checks["production"] is False
        assert f"production rl (run r0) could not be scored on tonight's lists: {why}" in d.reasons[-1]


def test_missing_candidate_row_fails():
    d = decide(rows(), "rl", True, None, CFG)
    assert not d.passed and "no report row for candidate 'rl'" in d.reasons[-1]
