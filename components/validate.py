"""KFP component: Great Expectations suites over interactions, items and a targets/examples table.

Returns `passed` as its single output (a parameter, so the DAG branches on it with dsl.If); the failing
expectations go to the JSON artifact, the Markdown summary and the Data Docs page shown in the KFP UI, and the
log. A single
output, not a NamedTuple: kfp 2.17's local runner cannot resolve a condition on a named output
("pipelinechannel--validate-passed" parses as a parent input), only on "<task>-Output".
"""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def validate(
    sources: Input[Dataset],
    table: Input[Dataset],
    results: Output[Artifact],
    summary: Output[Markdown],
    data_docs: Output[HTML],
    metrics: Output[Metrics],
    profile: str,
    stage: str = "targets",
    bounds_json: str = "{}",
    run_id: str = "",
) -> bool:
    """stage="targets" checks extracted targets; stage="examples" adds the N-candidate-list expectations.
    `data_docs` is Great Expectations' own Data Docs page of the suites (the KFP UI shows HTML artifacts). With
    `run_id` the result is also published to the artifact store, for the run's outcome."""
    import json
    import shutil
    from pathlib import Path

    from components._lib import steps
    from components.artifact_store import publish

    out = Path(results.path)
    report = steps.validate(sources.path, table.path, out, profile, stage, json.loads(bounds_json))
    shutil.copy(out / "validation.md", summary.path)
    shutil.copy(out / steps.DATA_DOCS, data_docs.path)
    if run_id:
        publish(run_id, f"validate-{stage}", {"stage": stage, **report.to_dict()})
    results.metadata["passed"] = report.passed
    metrics.log_metric("passed", float(report.passed))
    metrics.log_metric("failed_expectations", float(sum(len(s.failures) for s in report.suites)))
    print(report.message)
    return report.passed
