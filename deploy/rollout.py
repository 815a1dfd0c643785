"""Canary rollout of a gated model (docs/CONTRACTS.md "Evaluation gate and rollout"; docs/DEPENDENCIES.md).

    upload model -> render the overlay with the real kustomize (manifests/kustomize.py; STORAGE_URI = the
    upload's URI, canaryTrafficPercent = N, the serving image optionally pinned) -> server-side apply every
    object -> wait until the latest revision is ready -> smoke-test it through its `latest-` tag URL
    -> the canary runs (outcome "canary"), or is rolled back at once (canary 0) when the smoke test fails.

The canary-analysis step (deploy/canary.py) then moves traffic in steps and calls `promote` or `roll_back`.

Every action is appended to a plan written as plan.json next to the rendered manifests (canary, promote and
rollback variants, for a person to apply by hand too). With `dry_run=True` nothing touches a cluster: the plan
and manifests are written and the model is uploaded. The Kubernetes side goes through the small `Kube`
protocol; `KserveKube` implements it with the kubernetes Python client and server-side apply.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import yaml

from manifests.kustomize import build

GROUP, VERSION, PLURAL = "serving.kserve.io", "v1beta1", "inferenceservices"
ISVC_KIND = "InferenceService"
FIELD_MANAGER = "gr2"  # every object the rollout applies is owned by this server-side-apply field manager
# REST collection of each kind the overlays render (a new kind in the manifests needs its line here).
PLURALS = {
    "ServiceAccount": "serviceaccounts",
    "ConfigMap": "configmaps",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    ISVC_KIND: PLURAL,
}


class ApplyConflict(RuntimeError):
    """Server-side apply refused a change: another field manager owns a field we set to another value."""


class Kube(Protocol):
    def apply(self, doc: dict[str, Any]) -> dict[str, Any]: ...
    def get(self, name: str, namespace: str) -> dict[str, Any] | None: ...  # the InferenceService


def object_path(doc: dict[str, Any]) -> str:
    """The REST path of one namespaced object: /api/v1/... for the core group, /apis/<group>/<v>/... else."""
    kind, api_version = doc["kind"], doc["apiVersion"]
    if kind not in PLURALS:
        raise ValueError(f"{kind}: no REST collection known for this kind (add it to PLURALS)")
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    meta = doc["metadata"]
    return f"{prefix}/namespaces/{meta.get('namespace', 'default')}/{PLURALS[kind]}/{meta['name']}"


class KserveKube:
    """Server-side apply and InferenceService reads with the kubernetes client (in-cluster or kubeconfig)."""

    def __init__(self, api_client: Any = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
        self.api = api_client or client.ApiClient()
        self.custom = client.CustomObjectsApi(self.api)
        self.ApiException = client.exceptions.ApiException

    def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply `doc` as field manager gr2, without force. It creates the object or updates the
        fields gr2 owns, and removes those gr2 set before and no longer sets (promote drops
        canaryTrafficPercent this way). The same document twice changes nothing. A field another manager owns
        with another value (someone ran `kubectl edit`) is a conflict: raised as ApplyConflict, never forced."""
        try:
            return self.api.call_api(
                object_path(doc),
                "PATCH",
                query_params=[("fieldManager", FIELD_MANAGER)],
                header_params={"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"},
                body=doc,
                response_type="object",
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
            )
        except self.ApiException as e:
            if e.status != 409:
                raise
            try:
                message = json.loads(e.body)["message"]
            except (TypeError, ValueError, KeyError):
                message = str(e.body)
            meta = doc["metadata"]
            raise ApplyConflict(f"{doc['kind']} {meta.get('namespace')}/{meta['name']}: {message}") from e

    def get(self, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except self.ApiException as e:
            if e.status == 404:
                return None
            raise


def set_rollout(
    docs: list[dict[str, Any]], storage_uri: str | None = None, canary_percent: int | None = None
) -> dict[str, Any]:
    """Point the InferenceService at a model (STORAGE_URI env of the predictor) and set or remove the canary.
    Returns the InferenceService document (edited in place).

    canary_percent None leaves the overlay's value; -1 removes the field (promote: all traffic to latest)."""
    isvcs = [d for d in docs if d.get("kind") == ISVC_KIND]
    if len(isvcs) != 1:
        raise ValueError(f"expected one {ISVC_KIND}, found {len(isvcs)}")
    pred = isvcs[0]["spec"]["predictor"]
    if storage_uri is not None:
        container = next(c for c in pred["containers"] if c["name"] == "kserve-container")
        env = [e for e in container.get("env", []) if e["name"] != "STORAGE_URI"]
        container["env"] = [{"name": "STORAGE_URI", "value": storage_uri}, *env]
    if canary_percent is not None:
        if canary_percent == -1:
            pred.pop("canaryTrafficPercent", None)
        elif 0 <= canary_percent <= 100:
            pred["canaryTrafficPercent"] = canary_percent
        else:
            raise ValueError(
                f"canary_percent must be within [0, 100] (or -1 to remove), got {canary_percent}"
            )
    return isvcs[0]


def latest_ready(isvc: dict[str, Any] | None) -> tuple[bool, str | None]:
    """(ready, latest-tag URL) from an InferenceService status (Serverless mode with tag routing)."""
    if not isvc:
        return False, None
    status = isvc.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
    comps = status.get("components") or {}
    comp = comps.get("transformer") or comps.get("predictor") or {}
    url = next((t.get("url") for t in comp.get("traffic", []) if t.get("tag") == "latest"), None)
    return ready, url


def wait_latest_ready(
    kube: Kube, name: str, namespace: str, timeout_s: float, poll_s: float
) -> tuple[bool, str | None]:
    """Poll the InferenceService until its latest revision is ready with a tag URL, or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    ready, url = latest_ready(kube.get(name, namespace))
    while not (ready and url) and time.monotonic() < deadline:
        time.sleep(poll_s)
        ready, url = latest_ready(kube.get(name, namespace))
    return ready, url


def smoke_test(
    url: str, model_name: str, instance: dict[str, Any], timeout_s: float = 30.0
) -> tuple[bool, str]:
    """POST one v1 instance; pass = 200 and a ranking that is a permutation of the candidates."""
    try:
        r = httpx.post(
            f"{url.rstrip('/')}/v1/models/{model_name}:predict",
            json={"instances": [instance]},
            timeout=timeout_s,
        )
    except httpx.HTTPError as e:
        return False, f"request failed: {e}"
    if r.status_code != 200:
        return False, f"HTTP {r.status_code}: {r.text[:200]}"
    pred = r.json()["predictions"][0]
    if sorted(pred["ranking"]) != sorted(instance["candidates"]):
        return False, f"ranking {pred['ranking']} is not a permutation of the candidates"
    return True, f"HTTP 200, valid={pred['valid']}, nfe={pred['nfe']}"


@dataclass
class Plan:
    storage_uri: str
    overlay: str
    canary_percent: int
    dry_run: bool
    run_id: str = ""
    stage: str = ""
    attempt: str = ""  # the upload the canary serves: promote pins exactly it
    record: dict[str, Any] = field(default_factory=dict)  # the production record `promote` writes
    target: dict[str, str] = field(default_factory=dict)  # the InferenceService: name, namespace
    actions: list[dict[str, Any]] = field(default_factory=list)
    outcome: str = "pending"  # dry-run | canary | promoted | rolled-back | failed

    def log(self, action: str, **detail: Any) -> None:
        self.actions.append({"action": action, "at": dt.datetime.now(dt.UTC).isoformat(), **detail})

    def write(self, out_dir: str | Path) -> None:
        (Path(out_dir) / "plan.json").write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, out_dir: str | Path) -> Plan:
        return cls(**json.loads((Path(out_dir) / "plan.json").read_text()))


def read_manifests(out_dir: str | Path, variant: str = "canary") -> list[dict[str, Any]]:
    """The documents of one rendered variant (canary, promote or rollback) of a plan folder."""
    return [d for d in yaml.safe_load_all((Path(out_dir) / f"{variant}.yaml").read_text()) if d]


def set_traffic(kube: Kube, isvc: dict[str, Any], canary_percent: int) -> dict[str, Any]:
    """Apply the InferenceService with canaryTrafficPercent = canary_percent (-1: the field removed)."""
    doc = copy.deepcopy(isvc)
    set_rollout([doc], canary_percent=canary_percent)
    return kube.apply(doc)


def promote(kube: Kube, isvc: dict[str, Any], store: Any, plan: Plan) -> dict[str, Any]:
    """All traffic to the new revision, then the production pointer (the only place the rollout writes it)."""
    set_traffic(kube, isvc, -1)
    # the attempt the canary served, not whatever was uploaded for (run, stage) since
    pointer = store.promote(plan.run_id, plan.stage, plan.record, attempt=plan.attempt or None)
    plan.log("promote", pointer=pointer)
    plan.outcome = "promoted"
    return pointer


def roll_back(kube: Kube, isvc: dict[str, Any], plan: Plan, reason: str) -> None:
    """All traffic back to the previous revision; the production pointer is left alone."""
    set_traffic(kube, isvc, 0)
    plan.log("rollback", canary_percent=0, reason=reason)
    plan.outcome = "rolled-back"


def rollout(
    model_dir: str | Path,
    run_id: str,
    stage: str,
    record: dict[str, Any],
    store: Any,
    overlay: str | Path,
    out_dir: str | Path,
    smoke_instance: dict[str, Any],
    canary_percent: int = 10,
    dry_run: bool = True,
    kube: Kube | None = None,
    smoke: Callable[[str, str, dict[str, Any]], tuple[bool, str]] = smoke_test,
    wait_timeout_s: float = 600.0,
    poll_s: float = 5.0,
    serve_image: str | None = None,
) -> Plan:
    """Upload, render, and (unless dry_run) apply -> wait -> smoke -> leave the canary running (outcome
    "canary") or roll it back. `serve_image` (a git-sha tag or digest) overrides the overlay's pinned image.
    Writes plan.json; an apply conflict is logged (outcome "failed") and raised."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = store.upload(run_id, stage, model_dir, metadata=record)
    plan = Plan(
        storage_uri=manifest.uri,
        overlay=str(overlay),
        canary_percent=canary_percent,
        dry_run=dry_run,
        run_id=run_id,
        stage=stage,
        attempt=manifest.attempt,
        record=record,
    )
    plan.log("upload", uri=manifest.uri, files=len(manifest.files))

    docs = build(overlay, image=serve_image)
    isvc = set_rollout(docs, manifest.uri, canary_percent)
    plan.target = {
        "name": isvc["metadata"]["name"],
        "namespace": isvc["metadata"].get("namespace", "default"),
    }
    for name, pct in (("canary", canary_percent), ("promote", -1), ("rollback", 0)):
        variant = copy.deepcopy(docs)
        set_rollout(variant, canary_percent=pct)
        (out / f"{name}.yaml").write_text(yaml.safe_dump_all(variant, sort_keys=False))
    plan.log(
        "render", files=["canary.yaml", "promote.yaml", "rollback.yaml"], image=serve_image or "overlay's"
    )
    name, ns = plan.target["name"], plan.target["namespace"]

    def finish(outcome: str) -> Plan:
        plan.outcome = outcome
        plan.write(out)
        return plan

    if dry_run:
        plan.log("apply", skipped="dry-run", target=f"{ns}/{name}", canary_percent=canary_percent)
        return finish("dry-run")
    if kube is None:
        kube = KserveKube()
    try:
        for d in docs:
            kube.apply(d)
    except ApplyConflict as e:
        plan.log("apply", conflict=str(e))
        finish("failed")
        raise
    plan.log("apply", target=f"{ns}/{name}", canary_percent=canary_percent, field_manager=FIELD_MANAGER)

    ready, url = wait_latest_ready(kube, name, ns, wait_timeout_s, poll_s)
    plan.log("wait", ready=ready, url=url)
    ok, detail = smoke(url, name, smoke_instance) if ready and url else (False, "canary never became ready")
    plan.log("smoke", passed=ok, detail=detail)
    if not ok:
        roll_back(kube, isvc, plan, detail)
        return finish(plan.outcome)
    return finish("canary")
