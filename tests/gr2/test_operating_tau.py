"""The operating tau's rule (gr2/stages/opd_rl.py `choose_tau`): the lowest tau within the margin of `ar` on
validation, at the gate's minimum validity; when none is, the lowest within the margin of the student's best. The
DAG test (tests/pipelines) runs the whole choice on a real student."""

from gr2.stages.opd_rl import choose_tau, holds_rule

AR = {"recall@1": 0.300, "validity": 1.0}


def curve(*points: tuple[float, float, float]) -> list[dict]:
    return [{"tau": t, "recall@1": r, "validity": v} for t, r, v in points]


def test_the_lowest_tau_within_the_margin_is_chosen():
    c = curve((0.4, 0.290, 1.0), (0.6, 0.296, 1.0), (0.9, 0.301, 1.0))
    assert choose_tau(AR, c, 0.005, 0.99) == (0.6, True)
    assert choose_tau(AR, c, 0.02, 0.99) == (0.4, True)
    assert choose_tau(AR, list(reversed(c)), 0.005, 0.99) == (0.6, True)  # in any order


def test_validity_below_the_gates_minimum_rules_a_tau_out():
    c = curve((0.4, 0.300, 0.98), (0.9, 0.299, 1.0))
    assert choose_tau(AR, c, 0.005, 0.99) == (0.9, True)


def test_no_tau_within_the_margin_gives_the_lowest_as_good_as_the_students_best():
    c = curve((0.4, 0.250, 1.0), (0.9, 0.280, 1.0))
    assert choose_tau(AR, c, 0.005, 0.99) == (0.9, False)  # 0.4 is worse than the student at 0.9
    # below `ar` at every tau, and flat: the slowest tau buys nothing (Beauty at 5bb07a2)
    c = curve((0.4, 0.292, 1.0), (0.6, 0.293, 1.0), (0.9, 0.290, 1.0), (1.0, 0.290, 1.0))
    assert choose_tau(AR, c, 0.005, 0.99) == (0.4, False)
    # an invalid tau is not the student's best, however it scores
    c = curve((0.4, 0.299, 0.90), (0.6, 0.280, 1.0), (0.9, 0.286, 1.0))
    assert choose_tau(AR, c, 0.005, 0.99) == (0.9, False)


def test_no_valid_tau_gives_the_highest():
    c = curve((0.4, 0.300, 0.5), (0.9, 0.300, 0.9))
    assert choose_tau(AR, c, 0.005, 0.99) == (0.9, False)


def test_bf16_holds_what_chose_the_tau():
    c = curve((0.4, 0.446, 1.0), (0.9, 0.445, 1.0))
    ar = {"recall@1": 0.454, "validity": 1.0}
    tau, within = choose_tau(ar, c, 0.005, 0.99)  # below ar everywhere: the student's best rules
    assert (tau, within) == (0.4, False)
    assert holds_rule({"recall@1": 0.447, "validity": 1.0}, ar, c, within, 0.005, 0.99)  # Beauty at b02afb0
    assert not holds_rule({"recall@1": 0.440, "validity": 1.0}, ar, c, within, 0.005, 0.99)
    assert not holds_rule({"recall@1": 0.447, "validity": 0.98}, ar, c, within, 0.005, 0.99)
    # a tau within ar's margin: bf16 must be within it too, not merely near the float32 student
    c = curve((0.4, 0.296, 1.0), (0.9, 0.300, 1.0))
    tau, within = choose_tau(AR, c, 0.005, 0.99)
    assert (tau, within) == (0.4, True)
    assert holds_rule({"recall@1": 0.295, "validity": 1.0}, AR, c, within, 0.005, 0.99)
    assert not holds_rule({"recall@1": 0.293, "validity": 1.0}, AR, c, within, 0.005, 0.99)
    assert not holds_rule({"recall@1": 0.3, "validity": 1.0}, AR, curve((0.4, 0.3, 0.5)), False, 0.005, 0.99)
