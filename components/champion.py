"""KFP component: champion against challenger, and drift (components/_lib/champion.py). The production model
(the attempt the pointer pins) and the candidate are scored on tonight's test lists: the paired comparison the
gate's production rule reads, and prediction drift; tonight's data against production's night: data drift.
Its Markdown summary (drift.md) is the drift section of the KFP UI; its metrics carry every drift figure. A GPU
step, like the evaluation: it decodes the test split with two models when a model is in production.
"""

# no `from __future__ import annotations`: KFP reads the real annotation objects

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from components._image import GPU_COMPONENT_KWARGS


@dsl.component(**GPU_COMPONENT_KWARGS)
def champion(
    sources: Input[Dataset],
    examples: Input[Dataset],
    candidate_model: Input[Model],
    comparison: Output[Artifact],
    summary: Output[Markdown],
    metrics: Output[Metrics],
    profile: str,
    run_id: str,
):
    """Writes champion.json (production record, paired comparison, drift) into `comparison`. A drift threshold
    crossed is a warning in the log, the summary and the outcome: the run goes on, the gate judges the model."""
    import shutil
    from pathlib import Path

    from components._lib.champion import champion as run

    res = run(sources.path, examples.path, candidate_model.path, comparison.path, profile, run_id)
    shutil.copy(Path(comparison.path) / "drift.md", summary.path)
    drift = res["drift"]
    comparison.metadata.update(
        production=(res["production"] or {}).get("run_id", ""), warnings=len(drift["warnings"])
    )
    paired = res["paired"] or {}
    for key in ("candidate", "production", "delta"):
        if key in paired:
            metrics.log_metric(f"paired/{key}_recall@1", float(paired[key]))
    for key, value in (drift.get("predictions") or {}).items():
        metrics.log_metric(f"drift/{key}", float(value))
    data = drift.get("data") or {}
    for key in ("new_users", "new_items"):
        if key in data:
            metrics.log_metric(f"drift/{key}", float(data[key]))
    for name, value in data.get("psi", {}).items():
        metrics.log_metric(f"drift/psi_{name}", float(value))
    for line in drift["warnings"]:
        print(f"DRIFT WARNING: {line}")
    if paired.get("error"):
        print(f"production could not be scored: {paired['error']}")
