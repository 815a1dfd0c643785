"""The compiled DAG (both YAML documents): every step and its image, GPU settings on every training and
evaluation step, deploy under the gate's condition, the canary analysis under deploy's outcome, the exit
handler, caching keyed on snapshot_date."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from components._image import BASE_IMAGE, TAG, TRAIN_IMAGE
from components._lib.gpu_pool import GPU_POOL_LABEL, GPU_POOL_VALUE
from pipelines.pipeline import PIPELINE_NAME, compile_pipeline, mutable_images
from pipelines.resources import GPU_TYPE, S3_SECRET, TRAIN_MOUNT, TRAIN_PVC

# Training steps submit Kubeflow Trainer TrainJobs (the GPUs are the job's: tests/components/test_trainjob.py);
# the decoding step runs on the GPU pool itself.
TRAIN_STEPS = [
    "train-ar-teacher",
    "rl-ar-teacher",
    "train-ar-no-trace",
    "convert-cft",
    "distill-on-policy",
    "rl-diffusion",
]
# champion decodes tonight's test lists with two models; evaluate-ablation the AR teacher and its ablation
GPU_STEPS = ["evaluate-models", "champion", "evaluate-ablation"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = compile_pipeline(str(tmp_path_factory.mktemp("c") / "pipeline.yaml"))
    docs = [d for d in yaml.safe_load_all(open(path)) if d is not None]
    assert len(docs) == 2  # pipeline spec + Kubernetes platform spec
    return docs[0], docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def _tasks(spec) -> dict[str, tuple[str, dict]]:
    """Every task in every (nested) DAG by display name -> (the DAG holding it, the task)."""
    out = {"root": ("", spec["root"])}
    for comp_name, comp in [("root", spec["root"]), *spec["components"].items()]:
        for task in comp.get("dag", {}).get("tasks", {}).values():
            out[task["taskInfo"]["name"]] = (comp_name, task)
    return out


def _executor(spec, task) -> str:
    return spec["components"][task["componentRef"]["name"]]["executorLabel"]


def _condition(tasks, parent: str) -> tuple[str, dict]:
    """The condition task (its name and spec) whose branch is the component `parent`."""
    [(name, cond)] = [
        (n, t) for n, (_, t) in tasks.items() if t.get("componentRef", {}).get("name") == parent
    ]
    return name, cond


def test_dag_steps_images_and_parameters(compiled):
    spec, _ = compiled
    assert spec["pipelineInfo"]["name"] == PIPELINE_NAME
    names = set(_tasks(spec)) - {"root"}
    expected = {"ingest", "feast-apply", "extract", "validate-targets", "materialize", "candidates"}
    expected |= {"validate-examples"}
    expected |= {
        "evaluate-floor",
        "prepare-sft",
        *GPU_STEPS,
        "gate",
        "deploy",
        "canary-analysis",
        "record-outcome",
    }
    assert expected <= names
    for label, ex in spec["deploymentSpec"]["executors"].items():
        c = ex["container"]
        gpu = label in {_executor(spec, t) for n, (_, t) in _tasks(spec).items() if n in GPU_STEPS}
        assert c["image"] == (TRAIN_IMAGE if gpu else BASE_IMAGE), label
        assert "pip install" not in " ".join(
            c["command"]
        )  # the image has the project; nothing installed at run
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert {
        "dataset",
        "profile",
        "snapshot_date",
        "candidate",
        "bounds_json",
        "canary_percent",
        "prometheus_url",
        "ablation",
    } <= set(params)
    assert params["ablation"]["defaultValue"] is False  # a nightly run leaves the ablation out
    assert {"train_nodes", "train_gpus_per_node"} <= set(params)


def test_compiled_objects_name_only_immutable_images(compiled, tmp_path):
    """Every image in both compiled documents is a git-sha tag or a digest: by default this checkout's sha, the
    tag `make images` gives. A mutable one (here :latest) is found by the same check, and `make compile`'s command
    refuses to write it."""
    spec, executors = compiled
    assert not mutable_images(spec) and not mutable_images(executors)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert TAG == os.environ.get("GR2_IMAGE_TAG", head) and BASE_IMAGE.endswith(f"/gr2:{TAG}")
    assert TRAIN_IMAGE.endswith(f"/gr2-train-gpu:{TAG}")
    tampered = copy.deepcopy(spec)
    next(iter(tampered["deploymentSpec"]["executors"].values()))["container"]["image"] = (
        "reg.example/gr2:latest"
    )
    assert mutable_images(tampered) == ["reg.example/gr2:latest"]
    out = tmp_path / "p.yaml"
    r = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "pipeline", "compile", "--output", str(out)],
        env={**os.environ, "GR2_IMAGE": "reg.example/gr2:latest"},
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "mutable images ['reg.example/gr2:latest']" in r.stderr and not out.exists()


def test_gpu_steps_have_accelerator_node_selector_toleration_retries(compiled):
    spec, k8s = compiled
    tasks = _tasks(spec)
    for step in GPU_STEPS:
        _, task = tasks[step]
        label = _executor(spec, task)
        acc = spec["deploymentSpec"]["executors"][label]["container"]["resources"]["accelerator"]
        assert acc["resourceType"] == GPU_TYPE and int(acc["resourceCount"]) == 1, step
        plat = k8s[label]
        assert plat["nodeSelector"]["labels"] == {GPU_POOL_LABEL: GPU_POOL_VALUE}, step
        [tol] = plat["tolerations"]
        assert tol == {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, step
        retry = task["retryPolicy"]
        assert (
            retry["maxRetryCount"] == 2 and retry["backoffDuration"] == "60s" and retry["backoffFactor"] == 2
        )
        env = {e["envVar"] for s in plat["secretAsEnv"] for e in s["keyToEnv"]}
        assert {s["secretName"] for s in plat["secretAsEnv"]} == {S3_SECRET}, step
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= env, step
    # Training steps are small launcher pods: no GPU of their own, the shared workspace volume mounted, the
    # TrainJob's size wired from the pipeline parameters.
    for step in TRAIN_STEPS:
        _, task = tasks[step]
        label = _executor(spec, task)
        assert "accelerator" not in spec["deploymentSpec"]["executors"][label]["container"].get(
            "resources", {}
        )
        assert "nodeSelector" not in k8s[label], step
        [mount] = k8s[label]["pvcMount"]
        assert mount["constant"] == TRAIN_PVC and mount["mountPath"] == TRAIN_MOUNT, step
        params = task["inputs"]["parameters"]
        assert params["train_nodes"] == {"componentInputParameter": "pipelinechannel--train_nodes"}, step
        assert params["gpus_per_node"] == {"componentInputParameter": "pipelinechannel--train_gpus_per_node"}
        assert task["retryPolicy"]["maxRetryCount"] == 2
        assert "run_step(" in " ".join(spec["deploymentSpec"]["executors"][label]["container"]["command"])
    # CPU steps stay off the GPU pool.
    for step in ["gate", "deploy", "prepare-sft", "evaluate-floor"]:
        label = _executor(spec, tasks[step][1])
        assert "accelerator" not in spec["deploymentSpec"]["executors"][label]["container"].get(
            "resources", {}
        )
        assert "nodeSelector" not in k8s[label] and "tolerations" not in k8s[label]
        assert {s["secretName"] for s in k8s[label]["secretAsEnv"]} == {S3_SECRET}


def test_only_steps_that_talk_to_services_are_retried(compiled):
    """A deterministic data error must not run twice: the steps that read the dataset or compute on
    artifacts have no retry policy; the feature store and artifact store steps retry once."""
    spec, _ = compiled
    tasks = _tasks(spec)
    never = ["ingest", "validate-targets", "candidates", "validate-examples", "evaluate-floor", "prepare-sft"]
    for step in never:
        assert "retryPolicy" not in tasks[step][1], step
    for step in ["feast-apply", "extract", "materialize", "gate", "deploy", "record-outcome"]:
        assert tasks[step][1]["retryPolicy"]["maxRetryCount"] == 1, step


def test_the_ablation_sits_under_its_parameter(compiled):
    """train-ar-no-trace and evaluate-ablation run only when the pipeline's `ablation` is true (`make bench`)."""
    spec, _ = compiled
    tasks = _tasks(spec)
    parent, _ = tasks["train-ar-no-trace"]
    assert tasks["evaluate-ablation"][0] == parent
    cond_name, cond = _condition(tasks, parent)
    assert cond_name == "ablation"
    assert (
        cond["triggerPolicy"]["condition"] == "inputs.parameter_values['pipelinechannel--ablation'] == true"
    )
    assert "ar_no_trace_model" not in str(tasks["evaluate-models"][1]["inputs"])


def test_deploy_sits_under_the_gate_condition(compiled):
    spec, _ = compiled
    tasks = _tasks(spec)
    parent, _ = tasks["deploy"]
    # the condition branch holding deploy is triggered by the gate's boolean output
    cond_name, cond = _condition(tasks, parent)
    assert cond_name == "gate-passed"
    assert (
        cond["triggerPolicy"]["condition"]
        == "inputs.parameter_values['pipelinechannel--gate-Output'] == true"
    )
    assert cond["inputs"]["parameters"]["pipelinechannel--gate-Output"]["taskOutputParameter"] == {
        "outputParameterKey": "Output",
        "producerTask": "gate",
    }
    assert "deploy" in spec["components"][parent]["dag"]["tasks"]
    # ... and the gate itself is not conditional on itself: it sits beside the branch
    assert tasks["gate"][0] == tasks["gate-passed"][0]


def test_online_store_is_filled_only_after_targets_pass_validation(compiled):
    """materialize (the online store serving reads) sits in the targets-valid branch, beside candidates, and
    reads the registry feast-apply wrote; feast-apply itself writes no online rows (tests/feature_repo)."""
    spec, _ = compiled
    tasks = _tasks(spec)
    parent, task = tasks["materialize"]
    assert parent == tasks["candidates"][0]
    cond_name, cond = _condition(tasks, parent)
    assert cond_name == "targets-valid"
    assert (
        cond["triggerPolicy"]["condition"]
        == "inputs.parameter_values['pipelinechannel--validate-Output'] == true"
    )
    assert cond["inputs"]["parameters"]["pipelinechannel--validate-Output"]["taskOutputParameter"] == {
        "outputParameterKey": "Output",
        "producerTask": "validate",  # the task validate-targets displays as
    }
    assert "feast-apply" in str(task["inputs"]["artifacts"]["registry"])


def test_canary_analysis_runs_only_when_the_canary_runs(compiled):
    spec, _ = compiled
    tasks = _tasks(spec)
    parent, task = tasks["canary-analysis"]
    cond_name, cond = _condition(tasks, parent)
    assert cond_name == "canary-running"
    assert (
        cond["triggerPolicy"]["condition"]
        == "inputs.parameter_values['pipelinechannel--deploy-Output'] == 'canary'"
    )
    assert tasks["canary-running"][0] == tasks["deploy"][0]  # beside deploy, inside the gate's branch
    assert cond["inputs"]["artifacts"]["pipelinechannel--deploy-plan"]["taskOutputArtifact"] == {
        "outputArtifactKey": "plan",
        "producerTask": "deploy",
    }
    assert set(task["inputs"]["artifacts"]) == {"plan", "examples"}
    assert task["cachingOptions"] == {}  # a decision about the live cluster, never a cached one


def test_exit_handler_records_the_outcome(compiled):
    spec, k8s = compiled
    root = spec["root"]["dag"]["tasks"]
    assert sorted(root) == ["exit-handler-1", "record-outcome"]  # the whole DAG inside the exit handler
    rec = root["record-outcome"]
    assert rec["dependentTasks"] == ["exit-handler-1"]
    assert rec["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"  # runs on failure too
    assert rec["inputs"]["parameters"]["status"] == {"taskFinalStatus": {"producerTask": "exit-handler-1"}}
    assert rec["inputs"]["parameters"]["run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
    assert rec["cachingOptions"] == {}  # never a cached outcome
    assert k8s[_executor(spec, rec)]["secretAsEnv"][0]["secretName"] == S3_SECRET


def test_caching_cannot_reuse_another_snapshot(compiled):
    spec, _ = compiled
    tasks = _tasks(spec)
    _, ing = tasks["ingest"]
    # snapshot_date flows from the pipeline parameter into ingest (a new date = a new cache key) ...
    assert ing["inputs"]["parameters"]["snapshot_date"] == {
        "componentInputParameter": "pipelinechannel--snapshot_date"
    }
    # ... and ingest never caches (a schedule repeats its parameters), so it re-reads the data every run.
    assert ing["cachingOptions"] == {}
    # Every other data step consumes ingest's fresh artifact, so its cache key changes with it.
    for step in [
        "feast-apply",
        "extract",
        "validate-targets",
        "materialize",
        "candidates",
        "validate-examples",
    ]:
        arts = tasks[step][1]["inputs"]["artifacts"]
        assert any("ingest" in str(a) for a in arts.values()), step
    for step in ["prepare-sft", "evaluate-floor", "evaluate-models"]:
        arts = tasks[step][1]["inputs"]["artifacts"]
        assert any("sources" in k or "examples" in k for k in arts), step
