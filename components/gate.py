"""KFP component: the evaluation gate. Reads the evaluation report and the champion step's comparison (the
production model's record, and both models scored on tonight's lists), decides with gr2.gate's rules, and
returns `passed` as its single output (so the DAG puts deploy under `dsl.If(gate_task.outputs["Output"] ==
True)`; kfp.local 2.17 cannot resolve a condition on a NamedTuple field: it parses the channel `gate-passed` as
a pipeline input). The reasons are written into a copy of the report (top-level `gate`), decision.json, a
Markdown summary for the KFP UI, the task log and the artifact store (for the run's outcome).
The body imports its helpers (gr2.gate.run_gate, artifact_store.production_record) at run time: inside the
KFP executor `kfp.dsl` is a runtime stub, so a component module cannot be imported there.
"""

# no `from __future__ import annotations`: KFP reads the real annotation objects

from kfp import dsl
from kfp.dsl import Artifact, Input, Markdown, Metrics, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def gate(
    report: Input[Artifact],
    decision: Output[Artifact],
    summary: Output[Markdown],
    metrics: Output[Metrics],
    candidate: str,
    data_validation_passed: bool,
    profile: str = "quick",
    production_json: str = "",
    store_bucket: str = "",
    store_prefix: str = "",
    store_endpoint: str = "",
    store_local_root: str = "",
    champion: Input[Artifact] = None,
    run_id: str = "",
) -> bool:
    """`champion`: the champion step's output (components/champion.py), the production record it scored and the
    paired comparison on tonight's lists. Without it the record is read from the store and nothing was scored
    (with a model in production the rule then fails). `production_json` overrides both ("null" = nothing in
    production). With `run_id` the decision is also published to the store for the run's outcome."""
    import shutil
    from pathlib import Path

    from components._lib.champion import read_comparison
    from components.artifact_store import production_record, publish
    from gr2.gate import run_gate

    store = {
        "bucket": store_bucket,
        "prefix": store_prefix,
        "endpoint_url": store_endpoint,
        "local_root": store_local_root,
    }
    paired = None
    if champion is not None and not production_json:
        prod, paired = read_comparison(champion.path)
    else:
        prod = production_record(production_json, **store)
    res = run_gate(report.path, decision.path, candidate, data_validation_passed, profile, prod, paired)
    if run_id:
        publish(run_id, "gate", res, **store)
    shutil.copy(Path(decision.path) / "gate.md", summary.path)
    decision.metadata["passed"] = res["passed"]
    metrics.log_metric("gate/passed", float(res["passed"]))
    for line in res["reasons"]:
        print(line)
    return res["passed"]
