"""Champion against challenger (components/_lib/champion.py) on a real slice, with the local artifact store: no
production model, a production model scored on tonight's lists beside the candidate (lists with an item it
does not know fall back to the upstream order, counted), a production attempt that cannot be loaded, and the
gate reading each result. Servable floor models stand in for trained ones: the step is the same for any
reranker (a generative bundle goes through the evaluation's decoder)."""

from __future__ import annotations

import json

import pytest

from components._lib import sources
from components._lib.champion import DATA_PROFILE, champion
from components.artifact_store import open_store
from gr2.config import load_profile
from gr2.gate import decide
from gr2.inference import FloorReranker
from tests.components.slices import examples_slice

CAND_ROW = {
    "model": "rl",
    "tau": None,
    "recall@1": 0.3,
    "validity": 1.0,
    "delta_vs_floor": {"recall@1": [0.01, 0.05]},
}
FLOOR_ROW = {"model": "floor", "tau": None, "recall@1": 0.2, "validity": 1.0}


@pytest.fixture(scope="module")
def tonight(tmp_path_factory):
    return examples_slice(tmp_path_factory.mktemp("champion"))


def test_champion_against_challenger(tonight, tmp_path, monkeypatch):
    src, examples = tonight
    monkeypatch.delenv("GR2_S3_BUCKET", raising=False)
    monkeypatch.setenv("GR2_ARTIFACT_ROOT", str(tmp_path / "store"))
    store = open_store()
    cfg = load_profile("smoke").gate
    candidate = FloorReranker(name="rl").save(tmp_path / "candidate")

    # Nothing in production: tonight's data profile is stored (a later night's reference), nothing is scored.
    res = champion(src, examples, candidate, tmp_path / "c1", "smoke", "run-1")
    assert res["production"] is None and res["paired"] is None and res["drift"]["warnings"] == []
    assert store.manifest("run-1", DATA_PROFILE) is not None
    assert "No model in production" in (tmp_path / "c1" / "drift.md").read_text()
    assert store.report("run-1", "champion")["n_test_lists"] == res["n_test_lists"] > 0

    # Production: a model that does not know the most frequent candidate item (an older catalog).
    test = sources.read_test_lists(examples)
    items = sources.read_dataset(src).items["item_id"].tolist()
    frequent = test["candidates"].explode().value_counts().index[0]
    older = FloorReranker(name="rl", items=[i for i in items if i != frequent]).save(tmp_path / "older")
    store.upload("run-1", "rl", older)
    store.promote("run-1", "rl", {"model": "rl", "recall@1": 0.9})
    res = champion(src, examples, candidate, tmp_path / "c2", "smoke", "run-2")
    assert res["production"]["run_id"] == "run-1"
    paired = res["paired"]
    unknown = int(test["candidates"].map(lambda c: frequent in c).sum())
    assert paired["production_unknown_lists"] == unknown > 0 and paired["n_lists"] == len(test)
    # Both rank in upstream order (the older model falls back to it where it cannot read a list): no difference.
    assert paired["candidate"] == paired["production"] and paired["delta"] == 0 and paired["ci95"] == [0, 0]
    drift = res["drift"]
    assert drift["predictions"] == {"n_lists": len(test), "top1_agreement": 1.0, "rank_corr": 1.0}
    assert drift["data"]["new_users"] == 0 and set(drift["data"]["psi"].values()) == {0.0}  # the same data
    assert drift["warnings"] == []
    decision = decide([FLOOR_ROW, CAND_ROW], "rl", True, res["production"], cfg, paired)
    assert decision.checks["production"] is True and "stored figure 0.9000" in decision.reasons[-1]

    # The pinned attempt changed in the store: production cannot be scored, and the gate's rule fails, named.
    (
        tmp_path / "store" / "reranker" / "run-1" / "rl" / res["production"]["attempt"] / "items.txt"
    ).write_text("x\n")
    res = champion(src, examples, candidate, tmp_path / "c3", "smoke", "run-3")
    assert "production model could not be loaded: ArtifactError" in res["paired"]["error"]
    assert "sha256 mismatch" in res["paired"]["error"]
    assert res["drift"]["warnings"] == [f"predictions: not measured ({res['paired']['error']})"]
    decision = decide([FLOOR_ROW, CAND_ROW], "rl", True, res["production"], cfg, res["paired"])
    assert not decision.passed and "could not be scored on tonight's lists" in decision.reasons[-1]
    written = json.loads((tmp_path / "c3" / "champion.json").read_text())
    assert written["paired"] == res["paired"] and "WARNING" in (tmp_path / "c3" / "drift.md").read_text()
