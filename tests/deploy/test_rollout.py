"""Canary rollout: dry run (manifests + plan, no cluster), and the apply -> wait -> smoke -> canary/rollback
logic against an in-memory fake of the Kubernetes API (no real cluster can run here) whose InferenceService
status points its `latest` tag at the real predictor server on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from components.artifact_store import ArtifactStore, LocalBackend
from deploy.rollout import rollout, set_rollout, smoke_test
from manifests.kustomize import build
from tests.deploy.fake_kube import OVERLAY, FakeKube


def test_dry_run_writes_manifests_and_plan_without_promoting(model_dir, tmp_path):
    store = ArtifactStore(LocalBackend(tmp_path / "store"))
    plan = rollout(
        model_dir,
        "run1",
        "model",
        {"model": "floor", "recall@1": 0.3},
        store,
        OVERLAY,
        tmp_path / "out",
        smoke_instance={},
        canary_percent=20,
        dry_run=True,
    )
    assert plan.outcome == "dry-run" and store.production() is None
    assert [a["action"] for a in plan.actions] == ["upload", "render", "apply"]
    canary = [
        d
        for d in yaml.safe_load_all((tmp_path / "out" / "canary.yaml").read_text())
        if d["kind"] == "InferenceService"
    ][0]
    env = canary["spec"]["predictor"]["containers"][0]["env"]
    assert {"name": "STORAGE_URI", "value": plan.storage_uri} in env
    assert canary["spec"]["predictor"]["canaryTrafficPercent"] == 20
    promote = yaml.safe_load_all((tmp_path / "out" / "promote.yaml").read_text())
    assert all(
        "canaryTrafficPercent" not in d["spec"]["predictor"]
        for d in promote
        if d["kind"] == "InferenceService"
    )
    assert json.loads((tmp_path / "out" / "plan.json").read_text())["outcome"] == "dry-run"
    # what was uploaded is exactly the model directory, downloadable by a reader
    out = store.download("run1", "model", tmp_path / "dl")
    assert (out / "reranker.json").read_text() == (Path(model_dir) / "reranker.json").read_text()


def test_set_rollout_storage_uri_canary_and_promote():
    docs = build(OVERLAY)
    isvc = set_rollout(docs, storage_uri="s3://gr2-models/reranker/r1/model/a1", canary_percent=25)
    p = isvc["spec"]["predictor"]
    env = p["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "STORAGE_URI"] == ["s3://gr2-models/reranker/r1/model/a1"]
    assert p["canaryTrafficPercent"] == 25
    set_rollout(docs, canary_percent=-1)  # promote: the field goes away
    assert "canaryTrafficPercent" not in isvc["spec"]["predictor"]
    set_rollout(docs, canary_percent=0)  # roll back: pin the previous revision
    assert isvc["spec"]["predictor"]["canaryTrafficPercent"] == 0
    with pytest.raises(ValueError, match="canary_percent"):
        set_rollout(docs, canary_percent=150)


def test_canary_smoke_passes_then_the_canary_runs(model_dir, predictor, ml_slice, tmp_path):
    from serving.serve_local import wait_ready

    wait_ready(f"{predictor['url']}/v1/models/reranker", proc=predictor["proc"])
    store = ArtifactStore(LocalBackend(tmp_path / "store"))
    kube = FakeKube(predictor["url"])
    items = list(ml_slice["items"]["item_id"])[:5]
    smoke = {"user_id": "1", "candidates": items}
    plan = rollout(
        model_dir,
        "run2",
        "model",
        {"model": "floor", "recall@1": 0.3},
        store,
        OVERLAY,
        tmp_path / "out",
        smoke,
        canary_percent=10,
        dry_run=False,
        kube=kube,
        poll_s=0,
        smoke=lambda url, name, inst: smoke_test(url, "reranker", inst),
    )
    assert plan.outcome == "canary", plan.actions
    (isvc,) = [d for d in kube.applied if d["kind"] == "InferenceService"]  # no promote before the analysis
    assert isvc["spec"]["predictor"]["canaryTrafficPercent"] == 10
    assert store.production() is None
    assert plan.run_id == "run2" and plan.target == {"name": "gr2-reranker", "namespace": "gr2"}
    smoke_step = next(a for a in plan.actions if a["action"] == "smoke")
    assert smoke_step["passed"] and "HTTP 200" in smoke_step["detail"]


def test_failed_smoke_rolls_back_and_keeps_production(model_dir, predictor, tmp_path):
    store = ArtifactStore(LocalBackend(tmp_path / "store"))
    store.upload("old", "model", model_dir)
    store.promote("old", "model", {"model": "floor", "recall@1": 0.3})
    kube = FakeKube(predictor["url"])

    bad = {"user_id": "1", "candidates": ["not-an-item", "also-not"]}  # the canary answers 400
    plan = rollout(
        model_dir,
        "run3",
        "model",
        {"model": "floor"},
        store,
        OVERLAY,
        tmp_path / "out",
        bad,
        dry_run=False,
        kube=kube,
        poll_s=0,
        smoke=lambda url, name, inst: smoke_test(url, "reranker", inst),
    )
    assert plan.outcome == "rolled-back"
    assert "HTTP 400" in next(a for a in plan.actions if a["action"] == "smoke")["detail"]
    assert [d for d in kube.applied if d["kind"] == "InferenceService"][-1]["spec"]["predictor"][
        "canaryTrafficPercent"
    ] == 0
    assert store.production()["run_id"] == "old"
    # a canary that never becomes ready is rolled back too
    plan = rollout(
        model_dir,
        "run4",
        "model",
        {},
        store,
        OVERLAY,
        tmp_path / "out2",
        bad,
        dry_run=False,
        kube=FakeKube(None),
        poll_s=0,
        wait_timeout_s=0,
    )
    assert plan.outcome == "rolled-back" and store.production()["run_id"] == "old"


def test_deploy_component_dry_run_in_a_local_pipeline(model_dir, tmp_path):
    from kfp import dsl, local

    from components.deploy import deploy
    from gr2.gate import run_gate

    rows = [
        {"model": "floor", "recall@1": 0.3, "validity": 1.0},
        {"model": "floor2", "recall@1": 0.31, "validity": 1.0},
    ]
    (tmp_path / "report.json").write_text(json.dumps({"rows": rows}))
    res = run_gate(tmp_path / "report.json", tmp_path / "decision", "floor2", True, "quick", None)
    assert res["passed"]

    @dsl.pipeline(name="deploy-test")
    def p():
        m = dsl.importer(artifact_uri=str(model_dir), artifact_class=dsl.Model, reimport=False)
        d = dsl.importer(artifact_uri=str(tmp_path / "decision"), artifact_class=dsl.Artifact, reimport=False)
        deploy(
            model=m.output,
            decision=d.output,
            run_id="r1",
            stage="model",
            overlay="manifests/overlays/dev",
            canary_percent=30,
            dry_run=True,
            store_local_root=str(tmp_path / "store"),
        )

    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path / "root"),
        raise_on_error=True,
    )
    p()
    (plan_file,) = (tmp_path / "root").rglob("plan.json")  # written by the plain function, as in a cluster
    plan = json.loads(plan_file.read_text())
    assert plan["outcome"] == "dry-run" and plan["canary_percent"] == 30
    assert plan["storage_uri"].startswith(str((tmp_path / "store").resolve()))
    store = ArtifactStore(LocalBackend(tmp_path / "store"), prefix="reranker")
    assert store.manifest("r1", "model").metadata == {"model": "floor2", "run_id": "r1", "recall@1": 0.31}
    canary = (plan_file.parent / "canary.yaml").read_text()
    assert "namespace: gr2-dev" in canary and "canaryTrafficPercent: 30" in canary
