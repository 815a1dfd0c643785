"""A fake Kubernetes API server on 127.0.0.1 for the rollout and canary tests (no real API server can run
here: no cluster, no kind/minikube). It serves the REST routes KserveKube calls, with:

- server-side apply (PATCH application/apply-patch+yaml?fieldManager=M[&force=true]) as the API server does
  it, simplified to lists being atomic: the fields a manager applies become its own; fields it applied before
  and leaves out are removed (unless another manager owns them too); a field another manager owns with another
  value is a 409 Conflict naming manager and field, unless forced; an apply that changes nothing leaves the
  resourceVersion alone;
- merge-patch updates (application/merge-patch+json?fieldManager=M), which take ownership of the fields they
  change, so a test can play someone running `kubectl edit`;
- GET, and an InferenceService status playing the KServe controller: Ready, with the predictor's traffic split
  between the `prev` and `latest` revisions per canaryTrafficPercent (tag URLs and revision names given);
- every request recorded with its method, path, content type, query and body.

`FakeKube` is the in-memory stand-in: it records applied documents and reports a Ready InferenceService.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

OBJECT = re.compile(r"^/(?:api/v1|apis/[^/]+/[^/]+)/namespaces/([^/]+)/([^/]+)/([^/]+)$")
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
Path_ = tuple[str, ...]


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    content_type: str
    query: dict[str, str]
    body: Any


def leaves(obj: Any, prefix: Path_ = ()) -> dict[Path_, Any]:
    """Field path -> value; maps recurse, anything else (lists included: atomic here) is a leaf."""
    if isinstance(obj, dict) and obj:
        out: dict[Path_, Any] = {}
        for k, v in obj.items():
            out.update(leaves(v, (*prefix, k)))
        return out
    return {prefix: obj}


def set_field(obj: dict, path: Path_, value: Any) -> None:
    for k in path[:-1]:
        obj = obj.setdefault(k, {})
    obj[path[-1]] = copy.deepcopy(value)


def remove_field(obj: dict, path: Path_) -> None:
    """Delete the field and any map it leaves empty."""
    parents = [obj]
    for k in path[:-1]:
        if not isinstance(parents[-1].get(k), dict):
            return
        parents.append(parents[-1][k])
    parents[-1].pop(path[-1], None)
    for parent, k in zip(reversed(parents[:-1]), reversed(path[:-1]), strict=True):
        if parent[k] == {}:
            del parent[k]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def dotted(path: Path_) -> str:
    return "".join(f".{k}" for k in path)


class FakeApi:
    """`traffic`: {"prev": (revision name, tag URL), "latest": (...)} for the InferenceService status."""

    def __init__(self, traffic: dict[str, tuple[str, str]] | None = None, ready: bool = True):
        self.objects: dict[tuple[str, str, str], dict] = {}  # (namespace, plural, name) -> object, no status
        self.owners: dict[tuple[str, str, str], dict[str, set[Path_]]] = {}
        self.versions: dict[tuple[str, str, str], int] = {}
        self.requests: list[Request] = []
        self.traffic = traffic or {}
        self.ready = ready
        self._lock = threading.Lock()
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
                body = json.loads(self.rfile.read(n)) if n else None  # JSON is YAML: the client sends JSON
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                req = Request(self.command, url.path, self.headers.get("Content-Type", ""), query, body)
                with api._lock:
                    api.requests.append(req)
                    code, obj = api.handle(req)
                self._send(code, obj)

            do_GET = do_PATCH = do_POST = do_PUT = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()

    def kubeconfig(self) -> str:
        """A kubeconfig pointing at this server (for code that loads its own configuration)."""
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                "users": [{"name": "fake", "user": {"token": "fake"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )

    # --- what the API server does -------------------------------------------------------------------------

    def handle(self, req: Request) -> tuple[int, dict]:
        m = OBJECT.match(req.path)
        if not m:
            return 404, {"kind": "Status", "code": 404, "message": f"no route {req.path}"}
        key = m.groups()
        if req.method == "GET":
            if key not in self.objects:
                return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
            return 200, self.view(key)
        if req.method == "PATCH" and req.content_type == APPLY:
            return self.apply(key, req.body, req.query["fieldManager"], req.query.get("force") == "true")
        if req.method == "PATCH" and req.content_type == MERGE:
            return self.update(key, req.body, req.query.get("fieldManager", "unknown"))
        return 415, {"kind": "Status", "code": 415, "message": f"{req.method} {req.content_type} not served"}

    def apply(self, key, config: dict, manager: str, force: bool) -> tuple[int, dict]:
        current = self.objects.get(key, {})
        have, applied = leaves(current), leaves(config)
        owners = self.owners.setdefault(key, {})
        conflicts = sorted(
            (other, p)
            for other, paths in owners.items()
            if other != manager
            for p in paths & applied.keys()
            if have.get(p) != applied[p]
        )
        if conflicts and not force:
            detail = "; ".join(f'conflict with "{o}": {dotted(p)}' for o, p in conflicts)
            return 409, {
                "kind": "Status",
                "code": 409,
                "reason": "Conflict",
                "message": f"Apply failed with {len(conflicts)} conflict(s): {detail}",
                "details": {
                    "causes": [
                        {
                            "reason": "FieldManagerConflict",
                            "message": f'conflict with "{o}"',
                            "field": dotted(p),
                        }
                        for o, p in conflicts
                    ]
                },
            }
        new = copy.deepcopy(current)
        others = set().union(*(paths for o, paths in owners.items() if o != manager))
        for p in owners.get(manager, set()) - applied.keys() - others:
            remove_field(new, p)
        for p, v in applied.items():
            set_field(new, p, v)
        for other in owners:
            if other != manager and force:
                owners[other] -= applied.keys()
        owners[manager] = set(applied)
        return self.store(key, new)

    def update(self, key, patch: dict, manager: str) -> tuple[int, dict]:
        if key not in self.objects:
            return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
        before = leaves(self.objects[key])
        new = merge_patch(self.objects[key], patch)
        changed = {p for p, v in leaves(new).items() if before.get(p) != v}
        owners = self.owners.setdefault(key, {})
        for other in owners:
            owners[other] -= changed
        owners.setdefault(manager, set()).update(changed)
        return self.store(key, new)

    def store(self, key, new: dict) -> tuple[int, dict]:
        created = key not in self.objects
        if created or new != self.objects[key]:
            self.versions[key] = self.versions.get(key, 0) + 1
            self.objects[key] = new
        return (201 if created else 200), self.view(key)

    def view(self, key) -> dict:
        obj = copy.deepcopy(self.objects[key])
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self.versions[key])
        meta["managedFields"] = [
            {"manager": m, "fields": sorted(dotted(p) for p in paths)}
            for m, paths in self.owners[key].items()
        ]
        if key[1] == "inferenceservices":
            obj["status"] = self.isvc_status(obj)
        return obj

    def isvc_status(self, obj: dict) -> dict:
        """The KServe controller's part: Ready, and the predictor's traffic per canaryTrafficPercent."""
        pct = obj["spec"]["predictor"].get("canaryTrafficPercent")
        split = {"prev": 100 - pct, "latest": pct} if pct is not None else {"latest": 100}
        traffic = [
            {
                "tag": tag,
                "revisionName": rev,
                "url": url,
                "percent": split[tag],
                "latestRevision": tag == "latest",
            }
            for tag, (rev, url) in self.traffic.items()
            if tag in split
        ]
        return {
            "conditions": [{"type": "Ready", "status": "True" if self.ready else "False"}],
            "components": {"predictor": {"traffic": traffic}},
        }

    # --- helpers for assertions ---------------------------------------------------------------------------

    def get(self, namespace: str, plural: str, name: str) -> dict:
        return self.view((namespace, plural, name))

    def isvc(self, namespace: str = "gr2", name: str = "gr2-reranker") -> dict:
        return self.get(namespace, "inferenceservices", name)


OVERLAY = Path(__file__).resolve().parents[2] / "manifests" / "overlays" / "prod"


class FakeKube:
    """Records applied documents; reports the InferenceService Ready with a latest-tag URL."""

    def __init__(self, latest_url: str | None):
        self.applied: list[dict] = []
        self.latest_url = latest_url

    def apply(self, doc):
        self.applied.append(json.loads(json.dumps(doc)))
        return doc

    def get(self, name, namespace):
        isvcs = [d for d in self.applied if d["kind"] == "InferenceService"]
        if not isvcs or self.latest_url is None:
            return {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
        return {
            "status": {
                "conditions": [{"type": "Ready", "status": "True"}],
                "components": {
                    "predictor": {
                        "traffic": [
                            {"tag": "prev", "url": "http://prev"},
                            {"tag": "latest", "url": self.latest_url},
                        ]
                    }
                },
            }
        }
