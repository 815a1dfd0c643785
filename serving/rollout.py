"""Canary rollout of a gated model (DESIGN.md "Evaluation gate and rollout", STACK.md B.4).

    upload model -> render the InferenceService (STORAGE_URI = the upload's URI, canaryTrafficPercent = N)
    -> apply -> wait until the latest revision is ready -> smoke-test it through its `latest-` tag URL
    -> promote (remove canaryTrafficPercent; write the store's production pointer) or roll back (canary 0).

Every action is appended to a plan that is written as plan.json next to the rendered manifests. With
`dry_run=True` nothing touches a cluster: the plan and the canary/promote/rollback manifests are written and
the model is uploaded (so `make run` can serve exactly what a cluster would). The Kubernetes side goes through
the small `Kube` protocol; `KserveKube` implements it with the kubernetes Python client.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from manifests.render import ISVC_KIND, build, set_rollout, to_yaml

GROUP, VERSION, PLURAL = "serving.kserve.io", "v1beta1", "inferenceservices"


class Kube(Protocol):
    def apply(self, doc: dict[str, Any]) -> None: ...
    def get(self, name: str, namespace: str) -> dict[str, Any] | None: ...


class KserveKube:
    """Apply/get InferenceServices (and core kinds) with the kubernetes client (in-cluster or kubeconfig)."""

    def __init__(self, api_client: Any = None) -> None:
        from kubernetes import client, config, utils

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
        self.api = api_client or client.ApiClient()
        self.custom = client.CustomObjectsApi(self.api)
        self.utils = utils
        self.ApiException = client.exceptions.ApiException

    def apply(self, doc: dict[str, Any]) -> None:
        ns, name = doc["metadata"].get("namespace", "default"), doc["metadata"]["name"]
        if doc["kind"] != ISVC_KIND:
            try:
                self.utils.create_from_dict(self.api, doc, namespace=ns)
            except self.utils.FailToCreateError as e:  # already exists: core kinds rarely change
                if not all(getattr(x, "status", None) == 409 for x in e.api_exceptions):
                    raise
            return
        try:
            self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        except self.ApiException as e:
            if e.status != 404:
                raise
            self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, doc)
            return
        # a JSON merge patch cannot remove canaryTrafficPercent by omission: send null explicitly
        patch = copy.deepcopy(doc)
        patch["spec"]["predictor"].setdefault("canaryTrafficPercent", None)
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, patch)

    def get(self, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except self.ApiException as e:
            if e.status == 404:
                return None
            raise


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
    actions: list[dict[str, Any]] = field(default_factory=list)
    outcome: str = "pending"  # dry-run | promoted | rolled-back | failed

    def log(self, action: str, **detail: Any) -> None:
        self.actions.append({"action": action, "at": dt.datetime.now(dt.UTC).isoformat(), **detail})


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
) -> Plan:
    """Upload, render, and (unless dry_run) apply -> wait -> smoke -> promote or roll back. Writes plan.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = store.upload(run_id, stage, model_dir, metadata=record)
    plan = Plan(
        storage_uri=manifest.uri, overlay=str(overlay), canary_percent=canary_percent, dry_run=dry_run
    )
    plan.log("upload", uri=manifest.uri, files=len(manifest.files))

    docs = build(overlay)
    set_rollout(docs, manifest.uri, canary_percent)
    variants = {"canary": docs}
    for name, pct in (("promote", -1), ("rollback", 0)):
        variants[name] = copy.deepcopy(docs)
        set_rollout(variants[name], canary_percent=pct)
    for name, d in variants.items():
        (out / f"{name}.yaml").write_text(to_yaml(d))
    plan.log("render", files=[f"{n}.yaml" for n in variants])
    isvc = next(d for d in docs if d["kind"] == ISVC_KIND)
    name, ns = isvc["metadata"]["name"], isvc["metadata"].get("namespace", "default")

    def finish(outcome: str) -> Plan:
        plan.outcome = outcome
        (out / "plan.json").write_text(json.dumps(plan.__dict__, indent=2) + "\n")
        return plan

    if dry_run:
        plan.log("apply", skipped="dry-run", target=f"{ns}/{name}", canary_percent=canary_percent)
        return finish("dry-run")
    if kube is None:
        kube = KserveKube()
    for d in docs:
        kube.apply(d)
    plan.log("apply", target=f"{ns}/{name}", canary_percent=canary_percent)

    deadline = time.monotonic() + wait_timeout_s
    ready, url = latest_ready(kube.get(name, ns))
    while not (ready and url) and time.monotonic() < deadline:
        time.sleep(poll_s)
        ready, url = latest_ready(kube.get(name, ns))
    plan.log("wait", ready=ready, url=url)

    ok, detail = smoke(url, name, smoke_instance) if ready and url else (False, "canary never became ready")
    plan.log("smoke", passed=ok, detail=detail)
    target = variants["promote" if ok else "rollback"]
    kube.apply(next(d for d in target if d["kind"] == ISVC_KIND))
    if ok:
        pointer = store.promote(run_id, stage, record, attempt=manifest.attempt)  # the attempt smoke-tested
        plan.log("promote", pointer=pointer)
        return finish("promoted")
    plan.log("rollback", canary_percent=0)
    return finish("rolled-back")
