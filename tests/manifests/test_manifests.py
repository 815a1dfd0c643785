"""The overlays as the real kustomize renders them (`kubectl kustomize`, what `kubectl apply -k` deploys): core
kinds pass kubernetes-validate --strict; the InferenceService passes the strict schema derived from the
installed KServe models plus the project's rules (tests/manifests/kserve_schema.py), keeps the base's image,
command, env and resources through the overlay patches, and carries the hardening."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import kserve.models
import kubernetes_validate
import pytest
import yaml

from components._lib.gpu_pool import GPU_POOL_LABEL, GPU_POOL_VALUE, GPU_TOLERATION
from manifests.kustomize import KUBECTL, KustomizeError, build, pinned
from tests.manifests.kserve_schema import K8S_DEFS, errors, kserve_schema

ROOT = Path(__file__).resolve().parents[2] / "manifests"
OVERLAYS = ["dev", "prod"]
NAMESPACE = {"dev": "gr2-dev", "prod": "gr2"}
COMPONENTS = ["predictor", "transformer"]


@pytest.fixture(scope="module")
def rendered():
    return {"base": build(ROOT / "base")} | {name: build(ROOT / "overlays" / name) for name in OVERLAYS}


def isvc(docs):
    (d,) = [d for d in docs if d["kind"] == "InferenceService"]
    return d


def container(doc, component):
    (c,) = doc["spec"][component]["containers"]
    assert c["name"] == "kserve-container"
    return c


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_without_warnings_and_validates(overlay, rendered):
    r = subprocess.run(
        [KUBECTL, "kustomize", str(ROOT / "overlays" / overlay)], capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr  # e.g. no "'commonLabels' is deprecated"
    docs = rendered[overlay]
    kinds = sorted(d["kind"] for d in docs)
    assert {"ServiceAccount", "Role", "RoleBinding", "InferenceService"} <= set(kinds), kinds
    # Secret templates are never rendered: applying them would blank the real credentials
    assert "Secret" not in kinds
    for d in docs:
        assert d["metadata"]["namespace"] == NAMESPACE[overlay]
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "diffusion-gr2", d["kind"]
        if d["kind"] != "InferenceService":
            kubernetes_validate.validate(d, "1.33", strict=True)
    assert errors(isvc(docs)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_patches_keep_the_base_containers(overlay, rendered):
    """The bug this guards against: kustomize without merge keys replaces the containers list, and the
    predictor loses image, command, ports and env (STORAGE_URI), the transformer image and resources."""
    base, out = isvc(rendered["base"]), isvc(rendered[overlay])
    for comp in COMPONENTS:
        b, o = container(base, comp), container(out, comp)
        for key in ("image", "command", "ports", "securityContext", "readinessProbe", "livenessProbe"):
            assert o[key] == b[key], (comp, key)
        assert {e["name"] for e in b["env"]} <= {e["name"] for e in o["env"]}, comp
        assert {m["mountPath"] for m in b["volumeMounts"]} <= {m["mountPath"] for m in o["volumeMounts"]}
        assert o["resources"]["requests"] and o["resources"]["limits"], comp
        assert {v["name"] for v in base["spec"][comp]["volumes"]} <= {
            v["name"] for v in out["spec"][comp]["volumes"]
        }
    pred = container(out, "predictor")
    assert [e["name"] for e in pred["env"]].count("STORAGE_URI") == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_hardened(overlay, rendered):
    for comp in COMPONENTS:
        c = container(isvc(rendered[overlay]), comp)
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
        # probes on the served port (Knative requires the container port)
        port = c["ports"][0]["containerPort"]
        assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": port}
        assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": port}
        m = pinned(c["image"])
        assert m is not None and c["image"].rsplit(":", 1)[-1] not in {"latest", "dev", "stable"}, c["image"]
        # the read-only root filesystem leaves /tmp writable through an emptyDir
        assert {"mountPath": "/tmp", "name": "tmp"} in c["volumeMounts"]


def test_prod_has_gpu_pool_canary_scaling_and_redis(rendered):
    docs = rendered["prod"]
    s = isvc(docs)
    assert s["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Serverless"
    assert s["metadata"]["annotations"]["serving.kserve.io/enable-tag-routing"] == "true"
    assert s["metadata"]["annotations"]["serving.kserve.io/enable-prometheus-scraping"] == "true"
    p = s["spec"]["predictor"]
    c = container(s, "predictor")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # the one GPU pool definition, shared with the training steps (pipelines/resources.py)
    assert p["nodeSelector"] == {GPU_POOL_LABEL: GPU_POOL_VALUE} == {"gr2.dev/pool": "gpu"}
    assert p["tolerations"] == [GPU_TOLERATION]
    assert (p["minReplicas"], p["maxReplicas"], p["scaleMetric"], p["canaryTrafficPercent"]) == (
        2,
        16,
        "concurrency",
        10,
    )
    assert c["args"][c["args"].index("--max_batch") + 1] == "64"  # the overlay's args replace the base's
    assert {"name": "OMP_NUM_THREADS", "value": "1"} in c["env"]  # base env kept by the name-keyed merge
    t = container(s, "transformer")
    assert "--feast_yaml" in t["args"] and {"REDIS_URL", "GR2_FEAST_BUCKET", "HOME"} <= {
        e["name"] for e in t["env"]
    }
    assert {"mountPath": "/etc/gr2/feast", "name": "feast-config", "readOnly": True} in t["volumeMounts"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert "type: redis" in cm["data"]["feature_store.yaml"]


def test_dev_is_cpu_only_and_scales_to_zero(rendered):
    dev = isvc(rendered["dev"])
    assert "nvidia.com/gpu" not in json.dumps(dev) and "nodeSelector" not in dev["spec"]["predictor"]
    assert (
        dev["spec"]["predictor"]["minReplicas"] == 0
        and dev["spec"]["predictor"]["canaryTrafficPercent"] == 50
    )
    assert "--feast_url" in container(dev, "transformer")["args"]


def test_secret_templates_hold_no_values():
    for path in [
        ROOT / "base" / "s3-secret.template.yaml",
        ROOT / "overlays" / "prod" / "redis-secret.template.yaml",
    ]:
        (d,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert d["kind"] == "Secret" and "data" not in d
        assert all(v == "" for v in d["stringData"].values())


def test_image_override_is_pinned_through_kustomize():
    digest = "reg.example/gr2-serve@sha256:" + "ab" * 32
    for image in ["reg.example/team/gr2-serve:1a2b3c4", digest]:
        s = isvc(build(ROOT / "overlays" / "prod", image=image))
        assert {container(s, c)["image"] for c in COMPONENTS} == {image}
        assert errors(s) == []
    for mutable in ["reg.example/gr2-serve:latest", "reg.example/gr2-serve:stable", "reg.example/gr2-serve"]:
        with pytest.raises(KustomizeError, match="not pinned"):
            build(ROOT / "overlays" / "prod", image=mutable)


def test_schema_knows_every_kserve_field():
    """Every field of KServe's component specs is in the derived schema, under its JSON name."""
    schema = kserve_schema()
    for model in [
        "V1beta1InferenceServiceSpec",
        "V1beta1PredictorSpec",
        "V1beta1TransformerSpec",
        "V1beta1ExplainerSpec",
    ]:
        cls = getattr(kserve.models, model)
        props = schema["$defs"][f"kserve.{model}"]["properties"]
        assert set(props) == set(cls.attribute_map.values()), model
    assert len(schema["$defs"]["kserve.V1beta1PredictorSpec"]["properties"]) >= 71


def test_schema_accepts_valid_kserve_fields_the_manifests_do_not_use(rendered):
    s = copy.deepcopy(isvc(rendered["prod"]))
    p = s["spec"]["predictor"]
    p["batcher"] = {"maxBatchSize": 32, "maxLatency": 500}
    p["logger"] = {"mode": "all", "url": "http://logger.gr2.svc"}
    p["autoScaling"] = {
        "metrics": [
            {
                "type": "Resource",
                "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}},
            }
        ]
    }
    p["containers"][0]["startupProbe"] = {"httpGet": {"path": "/v2/health/ready", "port": 8080}}
    s["spec"]["explainer"] = {"containers": [{"name": "kserve-container", "image": "reg.example/x:1a2b3c4"}]}
    assert errors(s) == []


@pytest.mark.parametrize(
    "mutate,expected",
    [
        (lambda s: s["spec"]["predictor"].__setitem__("storageURI", "s3://x"), "'storageURI' was unexpected"),
        (
            lambda s: s["spec"]["predictor"].__setitem__("canaryTrafficPercen", 5),
            "'canaryTrafficPercen' was unexpected",
        ),
        (
            lambda s: s["spec"]["predictor"].__setitem__("minReplicas", "1"),
            "minReplicas: '1' is not of type 'integer'",
        ),
        (
            lambda s: s["spec"]["predictor"].__setitem__("canaryTrafficPercent", 120),
            "greater than the maximum of 100",
        ),
        (
            lambda s: s["spec"]["predictor"].__setitem__("canaryTrafficPercent", -1),
            "less than the minimum of 0",
        ),
        (
            lambda s: s["spec"]["predictor"]["containers"][0].__setitem__("imagee", "x"),
            "'imagee' was unexpected",
        ),
        (
            lambda s: s["spec"]["predictor"]["containers"][0]["securityContext"].__setitem__(
                "runAsNonroot", True
            ),
            "'runAsNonroot' was unexpected",
        ),
        (
            lambda s: s["spec"]["predictor"].__setitem__("batcher", {"maxBatch": 3}),
            "'maxBatch' was unexpected",
        ),
        (
            lambda s: s["spec"]["predictor"]["containers"][0]["resources"]["limits"].__setitem__(
                "nvidia.com/gpus", "1"
            ),
            "'nvidia.com/gpus' is not one of",
        ),
        (lambda s: s["spec"]["predictor"].pop("nodeSelector"), "'nodeSelector' is a required property"),
        (
            lambda s: s["spec"]["predictor"].__setitem__("nodeSelector", {"gr2.ai/node-pool": "gpu"}),
            "nodeSelector",
        ),
        (lambda s: s["spec"]["predictor"].__setitem__("tolerations", []), "tolerations"),
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
        (lambda s: s.__setitem__("status", {}), "'status' was unexpected"),
    ],
    ids=[
        "storageURI-typo",
        "canary-typo",
        "string-minReplicas",
        "canary>100",
        "canary<0",
        "image-typo",
        "securityContext-typo",
        "batcher-typo",
        "gpu-key-typo",
        "gpu-without-pool",
        "other-pool-label",
        "gpu-without-toleration",
        "raw-mode",
        "apiVersion",
        "status",
    ],
)
def test_schema_rejects_mistakes(mutate, expected, rendered):
    s = copy.deepcopy(isvc(rendered["prod"]))
    mutate(s)
    found = errors(s)
    assert found and any(expected in e for e in found), found


def test_core_kind_typo_fails_strict_validation(rendered):
    sa = copy.deepcopy(next(d for d in rendered["prod"] if d["kind"] == "ServiceAccount"))
    sa["secret"] = sa.pop("secrets")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sa, "1.33", strict=True)


def test_kustomize_merge_keys_are_kubernetes_own():
    """The base's openapi file gives kustomize the merge keys Kubernetes itself uses for every PodSpec and
    Container list, on fields KServe's component specs really have."""
    schema = json.loads((ROOT / "base" / "inferenceservice-openapi.json").read_text())["definitions"]
    k8s = json.loads((K8S_DEFS / "_definitions.json").read_text())["$defs"]

    def merge_keys(props):
        return {
            k: (v["x-kubernetes-patch-merge-key"], v["x-kubernetes-patch-strategy"])
            for k, v in props.items()
            if "x-kubernetes-patch-merge-key" in v
        }

    pod = schema["io.kserve.serving.v1beta1.ComponentPodSpec"]["properties"]
    assert merge_keys(pod) == merge_keys(k8s["io.k8s.api.core.v1.PodSpec"]["properties"])
    assert merge_keys(schema["io.k8s.api.core.v1.Container"]["properties"]) == merge_keys(
        k8s["io.k8s.api.core.v1.Container"]["properties"]
    )
    spec = schema["io.kserve.serving.v1beta1.InferenceServiceSpec"]["properties"]
    for comp in spec:
        model = getattr(kserve.models, f"V1beta1{comp.capitalize()}Spec")
        assert set(pod) <= set(model.attribute_map.values()), comp
    (gvk,) = schema["io.kserve.serving.v1beta1.InferenceService"]["x-kubernetes-group-version-kind"]
    assert gvk == {"group": "serving.kserve.io", "kind": "InferenceService", "version": "v1beta1"}


def test_istio_policy_example_is_documented_and_not_rendered(rendered):
    path = ROOT / "examples" / "istio-authorizationpolicy.yaml"
    policy = yaml.safe_load(path.read_text())
    assert (policy["apiVersion"], policy["kind"]) == ("security.istio.io/v1", "AuthorizationPolicy")
    s = isvc(rendered["prod"])
    assert policy["metadata"]["namespace"] == s["metadata"]["namespace"]
    assert policy["spec"]["selector"]["matchLabels"] == {
        "serving.kserve.io/inferenceservice": s["metadata"]["name"]
    }
    paths = {p for r in policy["spec"]["rules"] for t in r.get("to", []) for p in t["operation"]["paths"]}
    assert paths == {
        f"/v1/models/{s['metadata']['name']}:predict",
        f"/v2/models/{s['metadata']['name']}/infer",
        "/metrics",
    }
    assert "AuthorizationPolicy" not in {d["kind"] for o in OVERLAYS for d in rendered[o]}
    assert (
        "manifests/examples/istio-authorizationpolicy.yaml"
        in (ROOT.parent / "docs" / "OPERATIONS.md").read_text()
    )
