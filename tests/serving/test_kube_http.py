"""KserveKube (the real kubernetes-client code path of the rollout) against a fake Kubernetes API server on
127.0.0.1: a few REST routes with create/get/merge-patch semantics, every request recorded. No real API
server can run here (no cluster, no kind/minikube), so this is the HTTP-level fake the issue allows."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from kubernetes import client

from components.artifact_store import ArtifactStore, LocalBackend
from serving.rollout import KserveKube, rollout

OVERLAY = Path(__file__).resolve().parents[2] / "manifests" / "overlays" / "prod"
COLLECTION = re.compile(r"^/(?:api/v1|apis/[^/]+/[^/]+)/namespaces/([^/]+)/([^/]+)(?:/([^/]+))?$")


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch (what `application/merge-patch+json` means)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class FakeApi:
    def __init__(self, latest_url: str):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.requests: list[tuple[str, str, str, dict | None]] = []
        self.latest_url = latest_url
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                path = self.path.split("?")[0]
                api.requests.append((self.command, path, self.headers.get("Content-Type", ""), body))
                m = COLLECTION.match(path)
                if not m:
                    return self._send(404, {"kind": "Status", "code": 404, "message": f"no route {path}"})
                ns, plural, name = m.groups()
                key = (ns, plural, name or (body or {}).get("metadata", {}).get("name"))
                if self.command == "GET":
                    if key not in api.objects:
                        return self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                    return self._send(200, api.objects[key])
                if self.command == "POST":
                    if key in api.objects:
                        return self._send(409, {"kind": "Status", "code": 409, "reason": "AlreadyExists"})
                    api.objects[key] = api.with_status(plural, body)
                    return self._send(201, api.objects[key])
                if self.command == "PATCH":
                    assert self.headers["Content-Type"] == "application/merge-patch+json"
                    api.objects[key] = api.with_status(plural, merge_patch(api.objects[key], body))
                    return self._send(200, api.objects[key])
                return self._send(405, {"kind": "Status", "code": 405})

            do_GET = do_POST = do_PATCH = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def with_status(self, plural, obj):
        if plural == "inferenceservices":  # the controller's job: Ready, with tag-routing URLs
            obj = dict(obj)
            obj["status"] = {
                "conditions": [{"type": "Ready", "status": "True"}],
                "components": {"transformer": {"traffic": [{"tag": "latest", "url": self.latest_url}]}},
            }
        return obj


@pytest.fixture
def fake_api(predictor):
    from serving.serve_local import wait_ready

    wait_ready(f"{predictor['url']}/v1/models/reranker", proc=predictor["proc"])
    api = FakeApi(predictor["url"])
    yield api
    api.server.shutdown()


def kube_for(api: FakeApi) -> KserveKube:
    cfg = client.Configuration()
    cfg.host = api.url
    return KserveKube(api_client=client.ApiClient(cfg))


def test_rollout_through_the_kubernetes_client(fake_api, model_dir, ml_slice, tmp_path):
    from serving.rollout import smoke_test

    store = ArtifactStore(LocalBackend(tmp_path / "store"))
    items = list(ml_slice["items"]["item_id"])[:4]
    plan = rollout(
        model_dir,
        "run7",
        "model",
        {"model": "floor", "recall@1": 0.3},
        store,
        OVERLAY,
        tmp_path / "out",
        {"user_id": "1", "candidates": items},
        canary_percent=10,
        dry_run=False,
        kube=kube_for(fake_api),
        poll_s=0,
        smoke=lambda url, name, inst: smoke_test(url, "reranker", inst),
    )
    assert plan.outcome == "promoted", plan.actions
    posted = [p for m, p, _, _ in fake_api.requests if m == "POST"]
    assert any(p.endswith("/namespaces/gr2/serviceaccounts") for p in posted)
    assert any(p.endswith("/namespaces/gr2/secrets") for p in posted)
    assert any(p.startswith("/apis/rbac.authorization.k8s.io/v1/namespaces/gr2/") for p in posted)
    isvc_calls = [(m, ct, b) for m, p, ct, b in fake_api.requests if "/inferenceservices" in p]
    methods = [m for m, _, _ in isvc_calls]
    # first apply: GET 404 -> POST with the canary; polling GET; promote: GET -> PATCH removing the canary
    assert methods[:2] == ["GET", "POST"] and methods[-1] == "PATCH", methods
    assert isvc_calls[1][2]["spec"]["predictor"]["canaryTrafficPercent"] == 10
    assert isvc_calls[-1][1] == "application/merge-patch+json"
    assert isvc_calls[-1][2]["spec"]["predictor"]["canaryTrafficPercent"] is None  # explicit null = remove
    stored = fake_api.objects[("gr2", "inferenceservices", "gr2-reranker")]
    assert "canaryTrafficPercent" not in stored["spec"]["predictor"]
    env = stored["spec"]["predictor"]["containers"][0]["env"]
    assert {"name": "STORAGE_URI", "value": plan.storage_uri} in env
    assert store.production()["run_id"] == "run7"

    # a second rollout re-applies core kinds (409 AlreadyExists is fine) and patches the existing ISVC
    plan = rollout(
        model_dir,
        "run8",
        "model",
        {"model": "floor"},
        store,
        OVERLAY,
        tmp_path / "out2",
        {"user_id": "1", "candidates": ["nope", "nada"]},
        canary_percent=20,
        dry_run=False,
        kube=kube_for(fake_api),
        poll_s=0,
        smoke=lambda url, name, inst: smoke_test(url, "reranker", inst),
    )
    assert plan.outcome == "rolled-back"
    stored = fake_api.objects[("gr2", "inferenceservices", "gr2-reranker")]
    assert stored["spec"]["predictor"]["canaryTrafficPercent"] == 0
    assert store.production()["run_id"] == "run7"
