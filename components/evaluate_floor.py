"""KFP component: floor (retriever order), popularity and ltr rows on the test examples, plus the run report."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Markdown, Metrics, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def evaluate_floor(
    sources: Input[Dataset],
    examples: Input[Dataset],
    report: Output[Artifact],
    summary: Output[Markdown],
    metrics: Output[Metrics],
    profile: str,
    dataset: str,
):
    """Write report.json / report.md into `report`; headline metrics per row go to the KFP UI."""
    import shutil
    from pathlib import Path

    from components._lib import steps

    rep = steps.evaluate_floor(sources.path, examples.path, report.path, profile, dataset)
    shutil.copy(Path(report.path) / "report.md", summary.path)
    for row in rep["rows"]:
        for k in ("recall@1", "recall@5", "ndcg@5"):
            metrics.log_metric(f"{row['model']}/{k}", row[k])
    metrics.log_metric("retriever/hit_rate", rep["retriever"]["hit_rate"])
