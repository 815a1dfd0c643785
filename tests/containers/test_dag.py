"""The smoke DAG with every step in the image the compiled pipeline names for it (kfp.local.DockerRunner, nothing
installed at run time, no network), against the same DAG in this venv (SubprocessRunner) on the same data and
seed: the `dag` fixture (conftest.py) runs both. What a venv run cannot show: a module missing from an image, a
file not copied, the images' user and the pipeline root, kfp's executor as the image has it."""

from __future__ import annotations

import json

import pytest
import yaml

from pipelines.pipeline import compile_pipeline
from pipelines.run_local import run_local
from tests.components.slices import malformed_slice
from tests.containers.support import executed_images, executed_tasks, run_output

pytestmark = pytest.mark.slow

R1_TOLERANCE = 0.002  # the bound; identical is expected (same wheels, same CPU kernels, same seed)


def report(run_dir) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def compiled_images(tmp_path) -> tuple[dict[str, str], list[str]]:
    """task name -> the image the compiled pipeline runs it in; and every executor's command line."""
    docs = list(yaml.safe_load_all(open(compile_pipeline(str(tmp_path / "pipeline.yaml")))))
    spec = docs[0]
    executors = spec["deploymentSpec"]["executors"]
    images = {}
    for comp in [spec["root"], *spec["components"].values()]:
        for name, task in comp.get("dag", {}).get("tasks", {}).items():
            label = spec["components"][task["componentRef"]["name"]].get("executorLabel")
            if label:
                images[name] = executors[label]["container"]["image"]
    commands = [
        " ".join(e["container"]["command"] + e["container"].get("args", [])) for e in executors.values()
    ]
    return images, commands


def test_containerized_dag_report_matches_the_venv_run(dag):
    """Same rows; R@1 within the issue's 0.002 (and every quality metric is in fact identical here); and, a check
    that does not saturate on a smoke model, the same training trajectories: each stage's losses, rewards and KLs
    (timings excepted)."""
    docker, venv = report(dag["docker"]), report(dag["subprocess"])
    assert [(r["model"], r["tau"]) for r in docker["rows"]] == [(r["model"], r["tau"]) for r in venv["rows"]]
    assert len(docker["rows"]) == 13  # floor .. spec: every stage ran in its image
    for a, b in zip(docker["rows"], venv["rows"], strict=True):
        assert abs(a["recall@1"] - b["recall@1"]) <= R1_TOLERANCE, (
            a["model"],
            a["tau"],
            a["recall@1"],
            b["recall@1"],
        )
        quality = [k for k in a if k.startswith(("recall@", "ndcg@")) or k in ("validity", "n_users")]
        assert {k: a[k] for k in quality} == pytest.approx({k: b[k] for k in quality}, abs=R1_TOLERANCE), a[
            "model"
        ]
    assert docker["retriever"] == venv["retriever"]
    # the steps in the images name the commit they were built from, as the venv run names its checkout's
    assert docker["git_sha"] == venv["git_sha"] != "unknown"
    assert docker["gate"]["passed"] == venv["gate"]["passed"]
    assert set(docker["training"]) == set(venv["training"]) == {"ar_sft", "ar", "naive", "cft", "opd", "rl"}
    for stage, a in docker["training"].items():
        b = venv["training"][stage]
        learned = {
            k: v for k, v in a.items() if isinstance(v, float) and "loss" in k or "kl_" in k or "reward" in k
        }
        # abs: a policy-gradient loss whose advantages sum to zero is float32 rounding (~1e-8), and its last
        # digits follow the summation order (a fresh-clone CI read -8.4e-9 in the image against -1.2e-8 in the venv).
        # rel: the two runs are bitwise equal almost always (four reruns here, and 12 repeats of the AR stage under
        # load in each), but one CI run at 0de66a1 had the image's AR teacher differ in the last bit of its step-1
        # gradient norm; the stages after it carry that forward and grow it: cft's loss 4e-6 apart, opd's KLs
        # 3.0e-4. 1e-3 passes that with room; another seed moves the AR teacher's final loss alone by 1.4%.
        assert learned and learned == pytest.approx({k: b[k] for k in learned}, rel=1e-3, abs=1e-6), stage


def test_every_step_ran_in_the_image_the_pipeline_names(dag, images, tmp_path):
    want, commands = compiled_images(tmp_path)
    ran = executed_images(dag["logs"]["docker"])
    assert len(ran) >= 16, ran  # the data steps, five training stages, evaluation, gate, deploy, outcome
    for task, image in ran:
        assert task in want, f"{task} is not a task of the compiled pipeline"
        assert image == want[task], (task, image, want[task])
    assert {image for _, image in ran} == {images["data"], images["train-gpu"]}
    # The same tasks ran as in the venv: nothing was left out in the containers.
    assert sorted(t for t, _ in ran) == sorted(executed_tasks(dag["logs"]["subprocess"]))
    # Nothing is installed at run time, exactly as on the cluster.
    assert not any("pip install" in c for c in commands)
    assert "pip install" not in dag["logs"]["docker"]


def test_steps_wrote_as_the_images_user(dag):
    """kfp.local mounts the pipeline root at the same path: what the steps wrote is the images' user's (10001)."""
    for pattern in ("candidates/examples", "materialize/feature_store/online_store.db"):
        assert run_output(dag["docker"], pattern).stat().st_uid == 10001, pattern


def test_a_step_failing_in_its_container_fails_the_run(images, docker_client, tmp_path, capfd):
    """Malformed data fails ingest inside the data image, and the run stops there, as on the cluster (kfp.local's
    own Docker handler read an auto-removed container's exit as success: pipelines/containers.py run_container)."""
    bad = malformed_slice(tmp_path / "bad")  # user 1's seq_idx goes down
    with pytest.raises(RuntimeError, match=r"Inner task failed: .*ingest"):
        run_local(str(bad), "smoke", tmp_path, "bad", "2026-01-01", serve_smoke=False, runner="docker")
    assert "seq_idx 3 of user '1' comes after" in "".join(capfd.readouterr())
    [outcome] = (tmp_path / "bad" / "kfp").glob("**/outcome/outcome.json")
    assert json.loads(outcome.read_text())["status"] == "FAILED"
