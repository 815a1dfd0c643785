"""KFP component: the no-trace ablation, what the reasoning trace buys (the AR teacher against the same model
trained on the answer alone, paired on the same test lists). Runs only when the pipeline's `ablation` is set
(`make bench`): a nightly retraining does not need it."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from components._image import GPU_COMPONENT_KWARGS


@dsl.component(**GPU_COMPONENT_KWARGS)
def evaluate_ablation(
    examples: Input[Dataset],
    ar_model: Input[Model],
    ar_no_trace_model: Input[Model],
    ablation: Output[Artifact],
    summary: Output[Markdown],
    metrics: Output[Metrics],
    profile: str,
):
    """Decode the test split with the AR teacher and its no-trace ablation; write report.json / report.md (the
    two rows and the paired difference) into `ablation` (not named `report`: the stage table is the run's
    report); the difference and its CI to the KFP UI."""
    from pathlib import Path

    from components._lib import model_steps

    bundles = {"ar": ar_model.path, "ar_no_trace": ar_no_trace_model.path}
    rep = model_steps.evaluate_ablation(examples.path, bundles, ablation.path, profile)
    Path(summary.path).write_text((Path(ablation.path) / "report.md").read_text())
    for row in rep["rows"]:
        metrics.log_metric(f"{row['model']}/recall@1", row["recall@1"])
    d = rep["ar_minus_ar_no_trace"]
    metrics.log_metric("ar_minus_ar_no_trace/recall@1", d["delta"])
    metrics.log_metric("ar_minus_ar_no_trace/ci95_low", d["ci95"][0])
    metrics.log_metric("ar_minus_ar_no_trace/ci95_high", d["ci95"][1])
