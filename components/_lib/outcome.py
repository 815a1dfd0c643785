"""A run's outcome, read back from the artifact store (called by the exit handler components/record_outcome.py).

An exit handler cannot take the inner tasks' outputs, so the steps publish what the outcome needs under
`<run_id>/<stage>` (components/artifact_store.py `publish`): ingest (the objects read, with their ETags),
validate-targets / validate-examples, champion (production before, both models on tonight's lists, drift),
gate; the deploy step's upload is `<run_id>/rl`. The outcome names the result of the night
  stopped_at_validation  a validation suite failed: nothing was materialized or trained
  held_by_gate           the gate failed the candidate: the production pointer is untouched
  promoted               the pointer names this run's model
  passed_gate            the gate passed and the model was uploaded; promotion waits for the canary
  failed                 a step failed (status FAILED or CANCELED)
and the production model before (what the gate compared against) and after (the pointer when the run ended).

Drift warnings (components/_lib/champion.py): every data warning, and the prediction warnings (production against
the candidate on tonight's lists) unless the gate held the candidate. Prediction drift warns about a model about
to replace production's rankings; a held candidate replaces nothing, and the gate's failure already says the night
went wrong. Its prediction figures stay in `drift`, and the warnings it would have raised in `drift_notes`.
"""

from __future__ import annotations

from typing import Any

STAGES = ("ingest", "validate-targets", "validate-examples", "champion", "gate")


def _who(record: dict[str, Any] | None) -> str | None:
    return None if not record else f"{record.get('run_id')}/{record.get('stage')}/{record.get('attempt')}"


def outcome(base: dict[str, Any], store: Any) -> dict[str, Any]:
    """`base` (run_id, status, ...) completed from what the run's steps published to `store`."""
    run_id = base["run_id"]
    got = {stage: store.report(run_id, stage) for stage in STAGES}
    ingest, champion, gate = got["ingest"] or {}, got["champion"] or {}, got["gate"]
    validation = {s: got[f"validate-{s}"]["passed"] for s in ("targets", "examples") if got[f"validate-{s}"]}
    after = store.production()
    before = champion.get("production") if got["champion"] else (gate or {}).get("production")
    if base.get("status") not in (None, "SUCCEEDED"):
        result = "failed"
    elif False in validation.values():
        result = "stopped_at_validation"
    elif gate is not None and not gate["passed"]:
        result = "held_by_gate"
    elif gate is not None:
        result = "promoted" if (after or {}).get("run_id") == run_id else "passed_gate"
    else:
        result = "incomplete"  # no gate decision was published (a store not reachable from every step)
    paired = champion.get("paired") or {}
    drift = champion.get("drift") or {}
    held = [w for w in drift.get("warnings", []) if result == "held_by_gate" and w.startswith("predictions:")]
    uploaded = store.manifest(run_id, "rl")
    return {
        **base,
        "result": result,
        "source": ingest.get("source"),
        "rows_ingested": ingest.get("n_interactions"),
        "objects_read": ingest.get("objects"),
        "validation": validation,
        "gate": None if gate is None else {"passed": gate["passed"], "reasons": gate["reasons"]},
        "champion_recall@1": paired.get("production"),
        # tonight's candidate: on the lists both were scored on, else its evaluation row (nothing in production)
        "challenger_recall@1": paired.get("candidate", (gate or {}).get("candidate_recall@1")),
        "paired": paired or None,
        "drift": {k: drift.get(k) for k in ("data", "predictions", "data_error", "predictions_error")},
        "drift_warnings": [w for w in drift.get("warnings", []) if w not in held],
        "drift_notes": held,  # prediction drift of a candidate the gate held (module docstring)
        "uploaded_attempt": None if uploaded is None else f"{run_id}/rl/{uploaded.attempt}",
        "production_before": before,
        "production_after": after,
    }


def outcome_markdown(rec: dict[str, Any]) -> str:
    """The outcome for the KFP UI: the result, the production model before and after, and why."""
    lines = [
        f"# Run {rec['run_id']}: {rec.get('result', rec['status'])}",
        "",
        f"- status: {rec['status']}, data `{rec['dataset']}` as of {rec['snapshot_date'] or '(run date)'}",
    ]
    if "result" not in rec:  # no artifact store: the status is all there is
        return "\n".join(
            [*lines, "- no artifact store configured: the steps' results are in their own artifacts", ""]
        )
    before, after = _who(rec["production_before"]), _who(rec["production_after"])
    lines += [
        f"- {rec.get('rows_ingested')} rows ingested"
        + (
            f" from {len(rec['objects_read'])} objects (keys and ETags in outcome.json)"
            if rec.get("objects_read")
            else ""
        ),
        f"- production before: `{before or 'none'}`",
        f"- production after: `{after or 'none'}`" + (" (unchanged)" if before == after else ""),
    ]
    if rec.get("uploaded_attempt") and rec["result"] == "passed_gate":
        lines.append(
            f"- uploaded for the canary: `{rec['uploaded_attempt']}` (promoted only after it passes)"
        )
    if rec.get("validation"):
        lines.append(
            "- validation: "
            + ", ".join(f"{k} {'passed' if v else 'FAILED'}" for k, v in rec["validation"].items())
        )
    if rec.get("champion_recall@1") is not None:
        p = rec["paired"]
        lines.append(
            f"- recall@1 on tonight's {p['n_lists']} test lists: challenger {p['candidate']:.4f}, champion "
            f"{p['production']:.4f} (delta {p['delta']:+.4f}, paired 95% CI [{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}])"
        )
    if rec.get("gate"):
        lines += ["", f"## Gate: {'PASSED' if rec['gate']['passed'] else 'FAILED'}", ""]
        lines += [f"- {r}" for r in rec["gate"]["reasons"]]
    lines += ["", f"## Drift: {'WARNING' if rec['drift_warnings'] else 'no warning'}", ""]
    lines += [f"- WARNING {w}" for w in rec["drift_warnings"]]
    lines += [f"- held candidate, not a warning: {w}" for w in rec.get("drift_notes") or []]
    if rec.get("error_message"):
        lines += ["", f"Error: {rec['error_message']}"]
    return "\n".join(lines) + "\n"
