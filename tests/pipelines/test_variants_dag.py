"""The whole DAG (kfp.local, smoke profile, a tiny slice) on real data of the shapes Beauty and MovieLens do
not have: no titles and no categories, no timestamps, repeat purchases, very long histories beside users at
the minimum length. Each variant is built from ../shared/data by gr2/data/variants.py into a temp folder.
`stripped` (no titles, no timestamps) stands for "Beauty without timestamps": it is also the variant of the
documented bench recipe. A DAG run costs about 4 minutes of CPU (most of it each step's process importing torch,
transformers, Feast or Great Expectations), so `make test` runs one: `all_shapes` (every shape at once, text and
numeric ids in one catalog) in tests/pipelines/test_local_run.py, with serving and the speed and comparison
tools. GR2_ALL_VARIANTS=1 runs each variant on its own here."""

from __future__ import annotations

import json
import os

import pytest

from gr2.data import data_root
from gr2.data.variants import VARIANTS, build_variant
from pipelines.run_local import run_local

pytestmark = pytest.mark.slow

# Users per variant (the source's first N by id; 0 = all). Beauty's first 300 users give ~100 retrieval-hit training lists
# and a few validation and test lists. `long` is small already: 3 users with 2,108 to 2,698 interactions, 3 cut
# to 2, 3 and 4 items, 40 as they are.
SLICES = {"no_text": 300, "stripped": 300, "repeats": 300, "long": 0, "all_shapes": 300}
USERS = {"no_text": 300, "stripped": 300, "repeats": 300, "long": 46, "all_shapes": 346}
BOUNDS = {"min_examples": 10}
LACKS = {
    "no_text": ["titles", "categories"],
    "stripped": ["titles", "timestamps"],
    "repeats": [],
    "long": [],
    "all_shapes": ["titles", "categories", "timestamps"],
}
# Evidence features the data cannot supply: dropped, and the report says why (never a constant column).
NO_TITLES, NO_CATEGORIES = (
    ("title_sim", "no item has title tokens"),
    ("category_overlap", "no item has categories"),
)
DROPPED = {
    "no_text": dict([NO_CATEGORIES, NO_TITLES]),
    "stripped": dict([NO_TITLES]),
    "repeats": {},
    "long": {},
    "all_shapes": dict([NO_CATEGORIES, NO_TITLES]),
}
STAGES = [
    "floor",
    "popularity",
    "ltr",
    "teacher",
    "ar_sft",
    "ar",
    "naive",
    "cft",
    "opd",
    "rl",
    "spec",
]


def check_variant_report(rep: dict, md: str, name: str) -> None:
    """What every variant's report must say: every stage evaluated, a gate decision with reasons, what the data
    has and lacks, and the evidence features it could not supply (dropped, never a constant column)."""
    assert sorted({r["model"] for r in rep["rows"]}) == sorted(STAGES)
    assert isinstance(rep["gate"]["passed"], bool) and rep["gate"]["reasons"]
    prof = rep["dataset_profile"]
    assert prof["lacks"] == LACKS[name] and prof["users"] == USERS[name]
    assert ("repeats" in prof["has"]) == (name in ("repeats", "all_shapes"))
    if name == "long":
        assert prof["history_length"]["min"] == 2 and prof["history_length"]["max"] == 2698
    if name == "all_shapes":  # `long`'s users with repeats injected
        assert prof["history_length"]["min"] == 2 and prof["history_length"]["max"] == 3226
    assert rep["evidence"]["dropped_features"] == DROPPED[name]
    assert not set(DROPPED[name]) & set(rep["evidence"]["features"])
    assert "## Dataset profile" in md and f"lacks: {', '.join(LACKS[name]) or 'nothing'}" in md
    assert ("evidence features dropped: " in md) == bool(DROPPED[name])


@pytest.mark.parametrize("name", list(SLICES))
def test_smoke_dag_on_variant(tmp_path, name):
    if not os.environ.get("GR2_ALL_VARIANTS"):
        pytest.skip(
            "set GR2_ALL_VARIANTS=1 to run every variant's DAG (make test runs `stripped` in test_local_run)"
        )
    if not (data_root() / VARIANTS[name].source / "interactions.tsv").exists():
        pytest.skip("shared data not available")
    data = build_variant(name, tmp_path / name, max_users=SLICES[name])
    res = run_local(
        str(data),
        "smoke",
        tmp_path / "runs",
        name,
        "2026-01-01",
        0,
        json.dumps(BOUNDS),
        serve_smoke=False,
    )
    rep = res["report"]
    assert rep is not None, res["validation"]
    assert [v["passed"] for v in res["validation"]] == [True, True]
    check_variant_report(rep, (tmp_path / "runs" / name / "report.md").read_text(), name)
