"""KFP component: start the gated model's canary (serving/rollout.py): upload to the artifact store, render the
overlay with the real kustomize (kubectl, in the image) with the model's storage URI and a canary percentage,
then either stop there (dry_run: manifests + plan.json only) or server-side apply every object, wait,
smoke-test the `latest-` tag URL, and leave the canary running (output "canary") or roll it back. Place it
under the gate's `dsl.If`; the canary-analysis step, under `outcome == "canary"`, promotes or rolls back.
Its single output is the outcome (kfp.local cannot resolve a condition on a NamedTuple field, see gate.py).
"""

# no `from __future__ import annotations`: KFP reads the real annotation objects

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Model, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def deploy(
    model: Input[Model],
    decision: Input[Artifact],
    plan: Output[Artifact],
    run_id: str,
    stage: str,
    overlay: str = "manifests/overlays/prod",
    canary_percent: int = 10,
    dry_run: bool = True,
    smoke_instance_json: str = "",
    store_bucket: str = "",
    store_prefix: str = "",
    store_endpoint: str = "",
    store_local_root: str = "",
    serve_image: str = "",
    examples: Input[Dataset] = None,
) -> str:
    """`decision` is the gate's output (its report row becomes the production record when promoted).
    `serve_image` ("" = the overlay's pinned image) must be a git-sha tag or an @sha256 digest. The smoke
    test asks `smoke_instance_json`, or else the newest test list of `examples` (the run's examples table)."""
    import json
    from pathlib import Path

    import components
    from components.artifact_store import open_store
    from gr2.gate import find_row, read_report
    from serving.rollout import rollout

    dec = json.loads((Path(decision.path) / "decision.json").read_text())
    if not dec["passed"]:
        raise RuntimeError("deploy called for a model that did not pass the gate")
    report = read_report(decision.path)
    row = find_row(report["rows"], dec["candidate"])
    record = {
        "model": dec["candidate"],
        "run_id": run_id,
        **{k: row[k] for k in ("recall@1", "ndcg@5") if k in row},
    }
    store = open_store(
        bucket=store_bucket or None,
        prefix=store_prefix or None,
        endpoint_url=store_endpoint or None,
        local_root=store_local_root or None,
    )
    overlay_path = Path(overlay)
    if not overlay_path.is_absolute() and not overlay_path.exists():
        overlay_path = Path(components.__file__).resolve().parents[1] / overlay  # relative to the repo root
    smoke = json.loads(smoke_instance_json) if smoke_instance_json else {}
    if not smoke and not dry_run:  # the canary must be asked something it can answer
        if examples is None:
            raise ValueError(
                "deploy needs smoke_instance_json or examples unless dry_run: one request to ask"
            )
        from serving.canary import probe_set

        smoke = probe_set(examples.path, 1)[0]
    from gr2.generative import bundle_dir

    p = rollout(
        str(bundle_dir(model.path)),
        run_id,
        stage,
        record,
        store,
        overlay_path,
        plan.path,
        smoke,
        canary_percent,
        dry_run,
        serve_image=serve_image or None,
    )
    plan.metadata.update(outcome=p.outcome, storage_uri=p.storage_uri)
    return p.outcome
