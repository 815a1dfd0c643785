"""Manifests render without kubectl; core kinds pass kubernetes-validate --strict (k8s 1.33); the
InferenceService passes our own strict schema, which rejects typos and wrong types."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest

from manifests.render import RenderError, build, merge, set_rollout, to_yaml

ROOT = Path(__file__).resolve().parents[2] / "manifests"
SCHEMA = json.loads((ROOT / "schemas" / "inferenceservice.schema.json").read_text())
VALIDATOR = jsonschema.Draft7Validator(SCHEMA)
OVERLAYS = ["dev", "prod"]


def isvc(docs):
    (d,) = [d for d in docs if d["kind"] == "InferenceService"]
    return d


def schema_errors(doc) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(doc))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay):
    docs = build(ROOT / "overlays" / overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert {"ServiceAccount", "Secret", "Role", "RoleBinding", "InferenceService"} <= set(kinds)
    ns = {"dev": "gr2-dev", "prod": "gr2"}[overlay]
    for d in docs:
        assert d["metadata"]["namespace"] == ns
        if d["kind"] != "InferenceService":
            kubernetes_validate.validate(d, "1.33", strict=True)
        if d["kind"] == "Secret":  # templates only: no secret values committed
            assert all(v == "" for v in d.get("stringData", {}).values()) and "data" not in d
    assert schema_errors(isvc(docs)) == []


def test_prod_has_gpu_canary_scaling_and_redis():
    docs = build(ROOT / "overlays" / "prod")
    s = isvc(docs)
    assert s["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Serverless"
    assert s["metadata"]["annotations"]["serving.kserve.io/enable-tag-routing"] == "true"
    p = s["spec"]["predictor"]
    c = p["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert p["nodeSelector"] == {"gr2.ai/node-pool": "gpu"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in p["tolerations"]
    assert (p["minReplicas"], p["maxReplicas"], p["scaleMetric"], p["canaryTrafficPercent"]) == (
        2,
        16,
        "concurrency",
        10,
    )
    assert c["image"] == "ghcr.io/diffusion-gr2/gr2-serve:stable"
    assert {"name": "OMP_NUM_THREADS", "value": "2"} in c["env"]  # base env kept by the name-keyed merge
    t = s["spec"]["transformer"]["containers"][0]
    assert "--feast_yaml" in t["args"] and t["volumeMounts"][0]["mountPath"] == "/etc/gr2/feast"
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert "type: redis" in cm["data"]["feature_store.yaml"]
    dev = isvc(build(ROOT / "overlays" / "dev"))
    assert "nvidia.com/gpu" not in json.dumps(dev) and dev["spec"]["predictor"]["minReplicas"] == 0


def test_set_rollout_storage_uri_canary_and_promote():
    docs = build(ROOT / "overlays" / "prod")
    set_rollout(docs, storage_uri="s3://gr2-models/reranker/r1/model/a1", canary_percent=25)
    p = isvc(docs)["spec"]["predictor"]
    env = p["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "STORAGE_URI"] == ["s3://gr2-models/reranker/r1/model/a1"]
    assert p["canaryTrafficPercent"] == 25
    set_rollout(docs, canary_percent=-1)  # promote: the field goes away
    assert "canaryTrafficPercent" not in isvc(docs)["spec"]["predictor"]
    set_rollout(docs, canary_percent=0)  # roll back: pin the previous revision
    assert isvc(docs)["spec"]["predictor"]["canaryTrafficPercent"] == 0
    assert schema_errors(isvc(docs)) == []
    with pytest.raises(RenderError, match="canary_percent"):
        set_rollout(docs, canary_percent=150)
    assert "kind: InferenceService" in to_yaml(docs)


@pytest.mark.parametrize(
    "mutate,expected",
    [
        (lambda s: s["spec"]["predictor"].__setitem__("storageURI", "s3://x"), "'storageURI' was unexpected"),
        (
            lambda s: s["spec"]["predictor"].__setitem__("minReplicas", "1"),
            "spec/predictor/minReplicas: '1' is not of type 'integer'",
        ),
        (
            lambda s: s["spec"]["predictor"].__setitem__("canaryTrafficPercent", 120),
            "120 is greater than the maximum of 100",
        ),
        (lambda s: s["spec"]["predictor"].__setitem__("scaleMetric", "qps"), "'qps' is not one of"),
        (
            lambda s: s["spec"]["predictor"]["containers"][0].__setitem__("imagee", "x"),
            "'imagee' was unexpected",
        ),
        (
            lambda s: s["spec"]["predictor"]["containers"][0]["resources"]["limits"].__setitem__(
                "nvidia.com/gpus", "1"
            ),
            "nvidia.com/gpus",
        ),
        (
            lambda s: s["metadata"]["annotations"].__setitem__(
                "serving.kserve.io/deploymentMode", "RawDeployment"
            ),
            "'Serverless' was expected",
        ),
        (
            lambda s: s.__setitem__("apiVersion", "serving.kserve.io/v1alpha1"),
            "'serving.kserve.io/v1beta1' was expected",
        ),
    ],
    ids=[
        "storageURI-typo",
        "string-minReplicas",
        "canary>100",
        "scaleMetric",
        "image-typo",
        "gpu-key-typo",
        "raw-mode",
        "apiVersion",
    ],
)
def test_schema_rejects_mistakes(mutate, expected):
    s = copy.deepcopy(isvc(build(ROOT / "overlays" / "prod")))
    mutate(s)
    errors = schema_errors(s)
    assert errors and any(expected in e for e in errors), errors


def test_core_kind_typo_fails_strict_validation():
    docs = build(ROOT / "overlays" / "prod")
    sa = copy.deepcopy(next(d for d in docs if d["kind"] == "ServiceAccount"))
    sa["secret"] = sa.pop("secrets")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sa, "1.33", strict=True)


def test_strategic_merge_semantics():
    base = {"a": {"b": 1, "c": 2}, "l": [{"name": "x", "v": 1}, {"name": "y", "v": 2}], "s": [1, 2]}
    patch = {"a": {"c": None, "d": 4}, "l": [{"name": "y", "v": 3}, {"name": "z", "v": 4}], "s": [3]}
    assert merge(base, patch) == {
        "a": {"b": 1, "d": 4},
        "l": [{"name": "x", "v": 1}, {"name": "y", "v": 3}, {"name": "z", "v": 4}],
        "s": [3],
    }
    assert base["a"] == {"b": 1, "c": 2}  # inputs untouched


def test_renderer_rejects_unknown_kustomize_keys(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nconfigMapGenerator: []\n")
    with pytest.raises(RenderError, match="configMapGenerator"):
        build(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("resources: []\npatches: [{path: p.yaml}]\n")
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: nope}\n")
    with pytest.raises(RenderError, match="matched 0 documents"):
        build(tmp_path)
