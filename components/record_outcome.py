"""KFP exit-handler component: record how a run ended, whatever happened inside.

The pipeline wraps its whole DAG in `dsl.ExitHandler(record_outcome(...))`, so this task runs last even when a
step failed. It writes outcome.json: the run id, status from `dsl.PipelineTaskFinalStatus`, error, timestamp, the
run's data version, and what the steps published to the artifact store (components/_lib/outcome.py: the
objects read, validation, the gate's decision, both models on tonight's lists, drift warnings, the production
model before and after, and the night's result: promoted, held_by_gate, stopped_at_validation, ...). It is the
`outcome` artifact (on the cluster: under the KFP pipeline root, i.e. S3), with a Markdown summary for the KFP
UI, one log line, and `<prefix>/<run_id>/outcome/` in the artifact store. kfp.local 2.17.3 runs exit handlers
too (checked: the status is FAILED with error code 1 when an inner task raises), so `make run` records it.
"""

# no `from __future__ import annotations`: KFP reads the real annotation objects

from kfp import dsl
from kfp.dsl import Artifact, Markdown, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def record_outcome(
    status: dsl.PipelineTaskFinalStatus,
    outcome: Output[Artifact],
    summary: Output[Markdown],
    run_id: str,
    pipeline: str,
    dataset: str,
    profile: str,
    snapshot_date: str,
    store_bucket: str = "",
    store_prefix: str = "",
    store_endpoint: str = "",
    store_local_root: str = "",
):
    """Write outcome/outcome.json and its Markdown summary, and publish it to the artifact store when one is
    configured (params, GR2_S3_BUCKET or GR2_ARTIFACT_ROOT; `make run` sets the last). Never fails the run because
    the store is unreachable: the log line and the KFP artifact still hold the status."""
    import datetime as dt
    import json
    import os
    from pathlib import Path

    from components._lib.outcome import outcome as complete
    from components._lib.outcome import outcome_markdown
    from components.artifact_store import open_store

    rec = {
        "run_id": run_id,
        "pipeline": pipeline,
        "job_resource_name": status.pipeline_job_resource_name,
        "status": status.state,  # SUCCEEDED | FAILED | CANCELED
        "error_code": status.error_code,
        "error_message": status.error_message,
        "dataset": dataset,
        "profile": profile,
        "snapshot_date": snapshot_date,
        "recorded_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    store = None
    env = os.environ
    try:  # the same store the steps published to (the environment's, unless given here)
        if not (store_bucket or store_local_root or env.get("GR2_S3_BUCKET") or env.get("GR2_ARTIFACT_ROOT")):
            raise RuntimeError("no artifact store configured (GR2_S3_BUCKET or GR2_ARTIFACT_ROOT)")
        store = open_store(
            bucket=store_bucket or None,
            prefix=store_prefix or None,
            endpoint_url=store_endpoint or None,
            local_root=store_local_root or None,
        )
        rec = complete(rec, store)
    except Exception as e:  # the status is still recorded below
        print(f"WARNING: the outcome holds the status only: {e}")
    out = Path(outcome.path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "outcome.json").write_text(json.dumps(rec, indent=2, default=str) + "\n")
    outcome.metadata.update({k: rec[k] for k in ("status", "run_id", "snapshot_date")})
    outcome.metadata["result"] = rec.get("result", "unknown")
    Path(summary.path).write_text(outcome_markdown(rec))
    print(
        f"gr2 run outcome: {json.dumps({k: v for k, v in rec.items() if k != 'objects_read'}, sort_keys=True, default=str)}"
    )
    if store is not None:
        try:
            m = store.upload(run_id, "outcome", report=json.loads((out / "outcome.json").read_text()))
            print(f"outcome published: {m.uri}/report.json")
        except Exception as e:  # the outcome is already in the log and the KFP artifact
            print(f"WARNING: could not publish the outcome to the artifact store: {e!r}")
