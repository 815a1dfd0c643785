"""KFP component: start the gated model's canary (deploy/rollout.py): upload to the artifact store, render the
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

    from components._lib import rollout_steps

    p = rollout_steps.deploy(
        model.path,
        decision.path,
        plan.path,
        run_id,
        stage,
        overlay,
        canary_percent,
        dry_run,
        json.loads(smoke_instance_json) if smoke_instance_json else None,
        {
            "bucket": store_bucket,
            "prefix": store_prefix,
            "endpoint_url": store_endpoint,
            "local_root": store_local_root,
        },
        serve_image,
        examples.path if examples is not None else None,
    )
    plan.metadata.update(outcome=p.outcome, storage_uri=p.storage_uri)
    return p.outcome
