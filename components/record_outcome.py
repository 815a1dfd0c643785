"""KFP exit-handler component: record how a run ended (SUCCEEDED / FAILED / CANCELED), whatever happened inside.

The pipeline wraps its whole DAG in `dsl.ExitHandler(record_outcome(...))`, so this task runs last even when a
step failed. It writes outcome.json (run id, status from `dsl.PipelineTaskFinalStatus`, error, timestamp, the
run's data version) as its `outcome` artifact (on the cluster: under the KFP pipeline root, i.e. S3), prints
one log line, and, when an artifact store is configured (a bucket via param / GR2_S3_BUCKET, or an explicit
local root), also publishes it there as `<prefix>/<run_id>/outcome/`. kfp.local 2.17.3 runs exit handlers
too (checked: the status is FAILED with error code 1 when an inner task raises), so `make run` records it.
"""

# no `from __future__ import annotations`: KFP reads the real annotation objects

from kfp import dsl
from kfp.dsl import Artifact, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def record_outcome(
    status: dsl.PipelineTaskFinalStatus,
    outcome: Output[Artifact],
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
    """Write outcome/outcome.json; publish it to the artifact store when one is configured (never fails the run
    because the store is unreachable: the log line and the KFP artifact still hold the outcome)."""
    import datetime as dt
    import json
    import os
    from pathlib import Path

    # Built inline: inside the executor a component module cannot be imported (see components/gate.py).
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
    out = Path(outcome.path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "outcome.json").write_text(json.dumps(rec, indent=2) + "\n")
    outcome.metadata.update({k: rec[k] for k in ("status", "run_id", "snapshot_date")})
    print(f"gr2 run outcome: {json.dumps(rec, sort_keys=True)}")
    if store_bucket or os.environ.get("GR2_S3_BUCKET") or store_local_root:
        from components.artifact_store import open_store

        try:
            store = open_store(
                bucket=store_bucket or None,
                prefix=store_prefix or None,
                endpoint_url=store_endpoint or None,
                local_root=store_local_root or None,
            )
            m = store.upload(run_id, "outcome", report=rec)
            print(f"outcome published: {m.uri}/report.json")
        except Exception as e:  # the outcome is already in the log and the KFP artifact
            print(f"WARNING: could not publish the outcome to the artifact store: {e!r}")
