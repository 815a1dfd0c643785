"""The compiled DAG: every step, its image, both validation conditions, and the snapshot_date parameter."""

from __future__ import annotations

import yaml

from components._image import BASE_IMAGE
from pipelines.pipeline import PIPELINE_NAME, compile_pipeline

STEPS = ["ingest", "feast-apply", "extract", "validate", "candidates", "validate-2", "evaluate-floor"]


def test_compile_parses_and_wires_the_dag(tmp_path):
    path = compile_pipeline(str(tmp_path / "pipeline.yaml"))
    docs = [d for d in yaml.safe_load_all(open(path)) if d is not None]
    spec = docs[0]
    assert spec["pipelineInfo"]["name"] == PIPELINE_NAME
    executors = spec["deploymentSpec"]["executors"]
    assert sorted(executors) == sorted(f"exec-{s}" for s in STEPS)
    for ex in executors.values():
        c = ex["container"]
        assert c["image"] == BASE_IMAGE
        assert "pip install" not in " ".join(
            c["command"]
        )  # image has the project; nothing installed at run time
    root = spec["root"]
    assert {"dataset", "profile", "snapshot_date", "fs_yaml"} <= set(root["inputDefinitions"]["parameters"])
    assert sorted(root["dag"]["tasks"]) == ["condition-1", "extract", "feast-apply", "ingest", "validate"]
    # ingest takes snapshot_date, so a new date is a new cache key for everything downstream.
    ing = root["dag"]["tasks"]["ingest"]["inputs"]["parameters"]
    assert ing["snapshot_date"]["componentInputParameter"] == "snapshot_date"
    cond1 = root["dag"]["tasks"]["condition-1"]
    assert (
        cond1["triggerPolicy"]["condition"]
        == "inputs.parameter_values['pipelinechannel--validate-Output'] == true"
    )
    inner = spec["components"]["comp-condition-1"]["dag"]["tasks"]
    assert sorted(inner) == ["candidates", "condition-2", "validate-2"]
    assert inner["condition-2"]["triggerPolicy"]["condition"] == (
        "inputs.parameter_values['pipelinechannel--validate-2-Output'] == true"
    )
    assert list(spec["components"]["comp-condition-2"]["dag"]["tasks"]) == ["evaluate-floor"]
