"""The replay's night plan and its shifted night's events (pipelines/nightly.py; the replay itself is the
benchmark benchmarks/nightly.md, `make nightly`)."""

from __future__ import annotations

import pandas as pd
import pytest

from pipelines.nightly import DEFAULT_NIGHTS, day_end, parse_nights, promotion


def test_night_plan():
    nights = parse_nights(DEFAULT_NIGHTS)
    assert len(nights) >= 6 and {f for _, f in nights} == {"", "corrupted", "degraded", "shifted"}
    assert nights[-1][1] == "shifted"
    with pytest.raises(ValueError, match="unknown fault"):
        parse_nights("2024-01-01:flood")
    with pytest.raises(ValueError, match="increasing"):
        parse_nights("2024-01-02,2024-01-01")
    with pytest.raises(ValueError, match="the shifted night must be the last"):
        parse_nights("2024-01-01:shifted,2024-01-02")


def test_promotion_appends_one_event_per_chosen_user():
    t = day_end("2024-01-01") - 100
    events = pd.DataFrame(
        {
            "user_id": [f"u{i // 3}" for i in range(30)],
            "item_id": [f"i{i}" for i in range(30)],
            "timestamp": [t] * 30,
            "seq_idx": [i % 3 for i in range(30)],
        }
    )
    promo = promotion(events, "2024-01-01", 0.5, 2, [f"i{i}" for i in range(30)], seed=0)
    assert len(promo) == 5 and promo["user_id"].is_unique and promo["item_id"].nunique() <= 2
    assert (promo["seq_idx"] == 3).all()  # each user's next position
    assert (promo["timestamp"] > t).all() and (promo["timestamp"] <= day_end("2024-01-01")).all()
    assert promotion(events, "2023-12-31", 0.5, 2, ["i0", "i1"], seed=0).empty  # nobody had events yet
