"""KFP component: automated canary analysis after the deploy step started the canary (deploy/canary.py).
It moves the canary's traffic through the profile's steps (`canary.steps`, e.g. 10 -> 50 -> 100 %), compares
canary and stable at every step on error rate, p99 latency, validity and fallback rate (Prometheus, the
predictor's serving/metrics.py series) and on ranking agreement over a probe set of recent requests (the
newest test lists of the run's examples), then promotes (writing the production pointer) or rolls back by
itself. Place it under `dsl.If(deploy.output == "canary")`; its single output is the outcome.
"""

# no `from __future__ import annotations`: KFP reads the real annotation objects

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Markdown, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def canary_analysis(
    plan: Input[Artifact],
    examples: Input[Dataset],
    analysis: Output[Artifact],
    summary: Output[Markdown],
    profile: str = "quick",
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090",
    revision_label: str = "serving_knative_dev_revision",
    scrape_interval_s: float = 30.0,
    model_name: str = "",
    store_bucket: str = "",
    store_prefix: str = "",
    store_endpoint: str = "",
    store_local_root: str = "",
) -> str:
    """`plan` is the deploy step's output (plan.json + the rendered canary.yaml). `revision_label` is the
    Prometheus label holding the Knative revision name; `model_name` "" = the InferenceService's name."""
    import shutil
    from pathlib import Path

    from components._lib import rollout_steps

    store = {
        "bucket": store_bucket,
        "prefix": store_prefix,
        "endpoint_url": store_endpoint,
        "local_root": store_local_root,
    }
    report = rollout_steps.canary_analysis(
        plan.path,
        examples.path,
        analysis.path,
        profile,
        prometheus_url,
        revision_label,
        scrape_interval_s,
        model_name,
        store,
    )
    shutil.copy(Path(analysis.path) / "analysis.md", summary.path)
    analysis.metadata["outcome"] = report["outcome"]
    for step in report["steps"]:
        print(f"{step['canary_percent']}%: {step.get('failures') or 'passed'}")
    return report["outcome"]
