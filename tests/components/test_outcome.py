"""The run's outcome, read back from what its steps published to the artifact store (components/_lib/outcome.py):
each kind of night, the objects read, the production model before and after, the drift warnings."""

from __future__ import annotations

from components._lib.outcome import outcome, outcome_markdown
from components.artifact_store import open_store, publish

OBJECTS = [
    {"key": "log/items.parquet", "etag": "e0", "size": 10},
    {"key": "log/events/date=2024-01-02/events.parquet", "etag": "e1", "size": 20},
]


def night(store, root, run_id: str, validation: dict, gate: bool | None = None, champion: dict | None = None):
    publish(
        run_id, "ingest", {"n_interactions": 123, "objects": OBJECTS, "source": "s3://b/log"}, local_root=root
    )
    for stage, passed in validation.items():
        publish(run_id, f"validate-{stage}", {"stage": stage, "passed": passed}, local_root=root)
    if champion is not None:
        publish(run_id, "champion", champion, local_root=root)
    if gate is not None:
        publish(
            run_id,
            "gate",
            {"passed": gate, "reasons": [f"{'PASS' if gate else 'FAIL'} production: ..."]},
            local_root=root,
        )
    base = {"run_id": run_id, "status": "SUCCEEDED", "dataset": "s3://b/log", "snapshot_date": "2024-01-02"}
    return outcome(base, store)


def test_each_kind_of_night(tmp_path):
    root = str(tmp_path)
    store = open_store(local_root=root, prefix="reranker")

    rec = night(store, root, "r1", {"targets": False})
    assert rec["result"] == "stopped_at_validation" and rec["gate"] is None
    assert rec["objects_read"] == OBJECTS and rec["rows_ingested"] == 123
    assert rec["production_before"] is None and rec["production_after"] is None
    md = outcome_markdown(rec)
    assert md.startswith("# Run r1: stopped_at_validation") and "validation: targets FAILED" in md
    assert "from 2 objects" in md and "production after: `none` (unchanged)" in md

    rec = night(store, root, "r2", {"targets": True, "examples": True}, gate=True)
    assert rec["result"] == "passed_gate"  # uploaded and waiting for its canary; the pointer has not moved
    store.upload("r2", "rl", report={"model": "rl"})
    prod = store.promote("r2", "rl", {"model": "rl", "recall@1": 0.4})
    rec = outcome({"run_id": "r2", "status": "SUCCEEDED", "dataset": "d", "snapshot_date": ""}, store)
    assert rec["result"] == "promoted" and rec["production_after"] == prod

    paired = {"n_lists": 50, "candidate": 0.3, "production": 0.4, "delta": -0.1, "ci95": [-0.2, -0.05]}
    scored = {
        "production": prod,
        "paired": paired,
        "drift": {"warnings": ["data: PSI of history_len 0.400 > 0.2"]},
    }
    rec = night(store, root, "r3", {"targets": True, "examples": True}, gate=False, champion=scored)
    assert rec["result"] == "held_by_gate" and rec["production_before"] == rec["production_after"] == prod
    assert (rec["champion_recall@1"], rec["challenger_recall@1"]) == (0.4, 0.3)
    md = outcome_markdown(rec)
    assert "production before: `r2/rl/" in md and "(unchanged)" in md and "## Gate: FAILED" in md
    assert "challenger 0.3000, champion 0.4000 (delta -0.1000" in md
    assert "## Drift: WARNING" in md and "- WARNING data: PSI of history_len 0.400 > 0.2" in md

    # A held candidate's prediction drift is a note, not a warning (it replaces nothing); its data drift warns.
    pred = "predictions: top1 agreement 0.393 < 0.4"
    scored["drift"] = {"warnings": ["data: PSI of history_len 0.400 > 0.2", pred]}
    rec = night(store, root, "r5", {"targets": True, "examples": True}, gate=False, champion=scored)
    assert rec["drift_warnings"] == ["data: PSI of history_len 0.400 > 0.2"] and rec["drift_notes"] == [pred]
    assert f"- held candidate, not a warning: {pred}" in outcome_markdown(rec)
    # A candidate that passed the gate is about to replace production: the same figure warns.
    rec = night(store, root, "r6", {"targets": True, "examples": True}, gate=True, champion=scored)
    assert pred in rec["drift_warnings"] and rec["drift_notes"] == []

    rec = outcome(
        {"run_id": "r4", "status": "FAILED", "dataset": "d", "snapshot_date": "", "error_message": "x"}, store
    )
    assert rec["result"] == "failed" and rec["objects_read"] is None and "Error: x" in outcome_markdown(rec)
