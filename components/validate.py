"""KFP component: Great Expectations suites over interactions, items and a targets/examples table.

Returns `passed` (a parameter, so the DAG can branch on it with dsl.If) and the failure message; writes
the GX results as JSON and a Markdown summary shown in the KFP UI.
"""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Markdown, Metrics, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def validate(
    sources: Input[Dataset],
    table: Input[Dataset],
    results: Output[Artifact],
    summary: Output[Markdown],
    metrics: Output[Metrics],
    profile: str,
    stage: str = "targets",
    bounds_json: str = "{}",
) -> NamedTuple("ValidationOutputs", passed=bool, message=str):
    """stage="targets" checks extracted targets; stage="examples" adds the N-candidate-list expectations."""
    import json
    import shutil
    from collections import namedtuple
    from pathlib import Path

    from components._lib import steps

    out = Path(results.path)
    report = steps.validate(sources.path, table.path, out, profile, stage, json.loads(bounds_json))
    shutil.copy(out / "validation.md", summary.path)
    results.metadata["passed"] = report.passed
    metrics.log_metric("passed", float(report.passed))
    metrics.log_metric("failed_expectations", float(sum(len(s.failures) for s in report.suites)))
    print(report.message)
    return namedtuple("ValidationOutputs", ["passed", "message"])(report.passed, report.message)
