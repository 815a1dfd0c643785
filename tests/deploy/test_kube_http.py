"""KserveKube (the real kubernetes-client code path of the rollout) against the fake Kubernetes API server of
tests/deploy/fake_kube.py: every object server-side applied by field manager gr2, redeploys idempotent, a
changed ConfigMap updated, promote removing the canary field, and conflicts with another manager reported."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from components.artifact_store import ArtifactStore, LocalBackend
from deploy.rollout import (
    FIELD_MANAGER,
    ApplyConflict,
    KserveKube,
    Plan,
    promote,
    read_manifests,
    rollout,
    smoke_test,
)
from tests.deploy.fake_kube import APPLY, FakeApi

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
KINDS = {"serviceaccounts", "roles", "rolebindings", "configmaps", "inferenceservices"}


@pytest.fixture
def fake_api(predictor):
    from serving.serve_local import wait_ready

    wait_ready(f"{predictor['url']}/v1/models/reranker", proc=predictor["proc"])
    api = FakeApi(
        traffic={"prev": ("gr2-reranker-predictor-00001", "http://prev"), "latest": ("r2", predictor["url"])}
    )
    yield api
    api.close()


def kube_for(api: FakeApi) -> KserveKube:
    cfg = client.Configuration()
    cfg.host = api.url
    return KserveKube(api_client=client.ApiClient(cfg))


def deploy(api, store, model_dir, run_id, out, overlay, smoke_items, **kw):
    return rollout(
        model_dir,
        run_id,
        "model",
        {"model": "floor", "recall@1": 0.3},
        store,
        overlay,
        out,
        {"user_id": "1", "candidates": smoke_items},
        dry_run=False,
        kube=kube_for(api),
        poll_s=0,
        smoke=lambda url, name, inst: smoke_test(url, "reranker", inst),
        **kw,
    )


def test_rollout_server_side_applies_everything_then_promotes(fake_api, model_dir, ml_slice, tmp_path):
    store = ArtifactStore(LocalBackend(tmp_path / "store"))
    items = list(ml_slice["items"]["item_id"])[:4]
    plan = deploy(
        fake_api, store, model_dir, "run7", tmp_path / "out", MANIFESTS / "overlays" / "prod", items
    )
    assert plan.outcome == "canary", plan.actions
    writes = [r for r in fake_api.requests if r.method != "GET"]
    # every write is a server-side apply by gr2, never forced; one per rendered object
    assert {
        (r.method, r.content_type, r.query.get("fieldManager"), r.query.get("force")) for r in writes
    } == {("PATCH", APPLY, FIELD_MANAGER, None)}
    assert {r.path.split("/")[-2] for r in writes} == KINDS
    assert {key[1] for key in fake_api.objects} == KINDS and {key[0] for key in fake_api.objects} == {"gr2"}
    isvc = fake_api.isvc()
    assert isvc["spec"]["predictor"]["canaryTrafficPercent"] == 10
    env = isvc["spec"]["predictor"]["containers"][0]["env"]
    assert {"name": "STORAGE_URI", "value": plan.storage_uri} in env
    assert store.production() is None  # the canary runs; nothing is promoted before its analysis

    # promote: the same InferenceService applied without the canary field; gr2 owned it, so it goes away
    isvc_doc = next(d for d in read_manifests(tmp_path / "out") if d["kind"] == "InferenceService")
    pointer = promote(kube_for(fake_api), isvc_doc, store, Plan.read(tmp_path / "out"))
    assert "canaryTrafficPercent" not in fake_api.isvc()["spec"]["predictor"]
    assert pointer["run_id"] == "run7" and store.production()["uri"] == plan.storage_uri


def test_redeploy_is_idempotent_and_updates_a_changed_configmap(fake_api, model_dir, ml_slice, tmp_path):
    store = ArtifactStore(LocalBackend(tmp_path / "store"))
    items = list(ml_slice["items"]["item_id"])[:4]
    manifests = tmp_path / "manifests"
    shutil.copytree(MANIFESTS, manifests)
    overlay = manifests / "overlays" / "prod"
    deploy(fake_api, store, model_dir, "run1", tmp_path / "a", overlay, items)
    versions = dict(fake_api.versions)

    # the same objects again (a new model: only the InferenceService's STORAGE_URI changes)
    deploy(fake_api, store, model_dir, "run2", tmp_path / "b", overlay, items)
    changed = {key[1] for key, v in fake_api.versions.items() if v != versions[key]}
    assert changed == {"inferenceservices"}, changed

    # a changed ConfigMap is updated in place (create-only would have kept the old one)
    cm_file = overlay / "feast-config.yaml"
    cm_file.write_text(cm_file.read_text().replace("cache_ttl_seconds: 60", "cache_ttl_seconds: 5"))
    deploy(fake_api, store, model_dir, "run3", tmp_path / "c", overlay, items)
    cm = fake_api.get("gr2", "configmaps", "gr2-feast-serving")
    assert "cache_ttl_seconds: 5" in cm["data"]["feature_store.yaml"]
    assert (
        fake_api.versions[("gr2", "configmaps", "gr2-feast-serving")]
        == versions[("gr2", "configmaps", "gr2-feast-serving")] + 1
    )
    assert {m["manager"] for m in cm["metadata"]["managedFields"]} == {FIELD_MANAGER}


def test_a_conflict_with_another_manager_is_reported(fake_api, model_dir, ml_slice, tmp_path):
    store = ArtifactStore(LocalBackend(tmp_path / "store"))
    items = list(ml_slice["items"]["item_id"])[:4]
    overlay = MANIFESTS / "overlays" / "prod"
    deploy(fake_api, store, model_dir, "run1", tmp_path / "a", overlay, items)
    # someone scales the predictor by hand (kubectl edit: an update by another field manager)
    kube_for(fake_api).api.call_api(
        "/apis/serving.kserve.io/v1beta1/namespaces/gr2/inferenceservices/gr2-reranker",
        "PATCH",
        query_params=[("fieldManager", "kubectl-edit")],
        header_params={"Content-Type": "application/merge-patch+json"},
        body={"spec": {"predictor": {"minReplicas": 5}}},
        auth_settings=["BearerToken"],
    )
    with pytest.raises(
        ApplyConflict,
        match=r'InferenceService gr2/gr2-reranker: .*"kubectl-edit": \.spec\.predictor\.minReplicas',
    ):
        deploy(fake_api, store, model_dir, "run2", tmp_path / "b", overlay, items)
    plan = Plan.read(tmp_path / "b")
    assert plan.outcome == "failed" and "kubectl-edit" in plan.actions[-1]["conflict"]
    assert fake_api.isvc()["spec"]["predictor"]["minReplicas"] == 5  # not overwritten: no force
    assert store.production() is None
    assert yaml.safe_load((tmp_path / "b" / "plan.json").read_text())["run_id"] == "run2"
