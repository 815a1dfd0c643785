"""KFP component: Great Expectations suites over interactions, items and a targets/examples table.

Returns `passed` as its single output (a parameter, so the DAG branches on it with dsl.If); the failing
expectations go to the JSON artifact, the Markdown summary shown in the KFP UI, and the log. A single
output, not a NamedTuple: kfp 2.17's local runner cannot resolve a condition on a named output
("pipelinechannel--validate-passed" parses as a parent input), only on "<task>-Output".
"""

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
) -> bool:
    """stage="targets" checks extracted targets; stage="examples" adds the N-candidate-list expectations."""
    import json
    import shutil
    from pathlib import Path

    from components._lib import steps

    out = Path(results.path)
    report = steps.validate(sources.path, table.path, out, profile, stage, json.loads(bounds_json))
    shutil.copy(out / "validation.md", summary.path)
    results.metadata["passed"] = report.passed
    metrics.log_metric("passed", float(report.passed))
    metrics.log_metric("failed_expectations", float(sum(len(s.failures) for s in report.suites)))
    print(report.message)
    return report.passed
