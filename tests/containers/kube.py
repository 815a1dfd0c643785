"""A rendered Kubernetes container spec as `docker run` arguments (docker SDK `containers.run` keywords), so the
container tests start the serving image exactly as the manifests say. Every field the manifests use is
translated; a field this does not know fails loudly, so a manifest change cannot pass unnoticed."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Kubernetes quantities the manifests use: "2", "500m"; "4Gi", "1Gi", "512M"
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9}


def cpu_nanos(q: str) -> int:
    return int(q[:-1]) * 10**6 if q.endswith("m") else int(float(q) * 10**9)


def memory_bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]i?|k)?", q)
    assert m, f"memory quantity {q!r}"
    unit = m.group(2) or ""
    return int(m.group(1)) * (_BINARY.get(unit) or _DECIMAL.get(unit) or 1)


@dataclass(frozen=True)
class Probe:
    path: str
    port: int


@dataclass
class RunSpec:
    """What `containers.run` gets, plus what the test checks against: the port and the probes."""

    kwargs: dict[str, Any]
    port: int
    readiness: Probe
    liveness: Probe
    tmpfs: list[str] = field(default_factory=list)


def _probe(p: dict) -> Probe:
    assert set(p) <= {
        "httpGet",
        "periodSeconds",
        "failureThreshold",
        "timeoutSeconds",
        "initialDelaySeconds",
    }, p
    return Probe(p["httpGet"]["path"], int(p["httpGet"]["port"]))


def run_spec(container: dict, pod_volumes: list[dict], image: str, kserve_args: list[str]) -> RunSpec:
    """`container` as the pod runs it, with `image` in place of the rendered one (the same repository: a deploy
    pins the tag) and the arguments KServe appends."""
    known = {
        "name",
        "image",
        "command",
        "args",
        "env",
        "ports",
        "resources",
        "securityContext",
        "readinessProbe",
        "livenessProbe",
        "volumeMounts",
    }
    assert set(container) <= known, f"fields this translation does not know: {set(container) - known}"
    assert container["image"].split("@")[0].rsplit(":", 1)[0] == image.rsplit(":", 1)[0], (
        container["image"],
        image,
    )
    env = {}
    for e in container.get("env", []):
        assert set(e) == {"name", "value"}, f"env {e} (valueFrom needs the cluster's objects)"
        env[e["name"]] = e["value"]
    [port] = container["ports"]
    assert port.get("protocol", "TCP") == "TCP"
    sc = container["securityContext"]
    assert set(sc) <= {
        "runAsNonRoot",
        "runAsUser",
        "runAsGroup",
        "readOnlyRootFilesystem",
        "allowPrivilegeEscalation",
        "capabilities",
        "seccompProfile",
    }, sc
    assert sc["runAsNonRoot"] and sc["runAsUser"] != 0
    assert sc.get("seccompProfile", {"type": "RuntimeDefault"}) == {
        "type": "RuntimeDefault"
    }  # the engine's default
    kwargs: dict[str, Any] = {
        "image": image,
        "entrypoint": container["command"],
        "command": [*container.get("args", []), *kserve_args],
        "environment": env,
        "user": f"{sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}",
        "read_only": bool(sc.get("readOnlyRootFilesystem")),
        "cap_drop": sc.get("capabilities", {}).get("drop", []),
        "security_opt": [] if sc.get("allowPrivilegeEscalation", True) else ["no-new-privileges"],
    }
    limits = container.get("resources", {}).get("limits", {})
    if "cpu" in limits:
        kwargs["nano_cpus"] = cpu_nanos(str(limits["cpu"]))
    if "memory" in limits:
        kwargs["mem_limit"] = memory_bytes(str(limits["memory"]))
    volumes = {v["name"]: v for v in pod_volumes}
    tmpfs = {}
    for m in container.get("volumeMounts", []):
        v = volumes[m["name"]]
        assert set(v) == {"name", "emptyDir"}, f"volume {v}: only emptyDir is translated (a tmpfs)"
        size = v["emptyDir"].get("sizeLimit")
        tmpfs[m["mountPath"]] = "rw,mode=1777" + (f",size={memory_bytes(size)}" if size else "")
    kwargs["tmpfs"] = tmpfs
    return RunSpec(
        kwargs,
        int(port["containerPort"]),
        _probe(container["readinessProbe"]),
        _probe(container["livenessProbe"]),
        list(tmpfs),
    )
