"""A rendered Kubernetes container spec as a `podman run` / `docker run` command line, so the container tests start
the serving image exactly as the manifests say. Every field the manifests use is translated; a field this does not
know fails loudly, so a manifest change cannot pass unnoticed.

The command line, not the Docker API: podman's Docker-compatible API adds writable tmpfs mounts (/run, /var/tmp)
to a read-only container and cannot be told not to; its CLI can (--read-only-tmpfs=false), which leaves only the
tmpfs the pod spec mounts, as in Kubernetes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Kubernetes quantities the manifests use: "2", "500m"; "4Gi", "1Gi", "512M"
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9}
CONTAINER_FIELDS = {
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
SECURITY_FIELDS = {
    "runAsNonRoot",
    "runAsUser",
    "runAsGroup",
    "readOnlyRootFilesystem",
    "allowPrivilegeEscalation",
    "capabilities",
    "seccompProfile",
}


def cpus(q: str) -> str:
    return str(int(q[:-1]) / 1000) if q.endswith("m") else q


def memory_bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|k|M|G)?", q)
    assert m, f"memory quantity {q!r}"
    unit = m.group(2) or ""
    return int(m.group(1)) * (_BINARY.get(unit) or _DECIMAL.get(unit) or 1)


@dataclass(frozen=True)
class Probe:
    path: str
    port: int


@dataclass(frozen=True)
class RunSpec:
    """The engine's `run` flags and the arguments after the image, plus what the test checks: port, probes, the
    tmpfs mounts."""

    flags: list[str]
    image: str
    args: list[str]
    port: int
    readiness: Probe
    liveness: Probe
    tmpfs: list[str] = field(default_factory=list)

    def argv(self, engine: str, *extra: str) -> list[str]:
        """`<engine> run --detach ...`; `extra` flags (volumes, hosts) before the image."""
        only_spec_tmpfs = (
            ["--read-only-tmpfs=false"] if engine == "podman" and "--read-only" in self.flags else []
        )
        return [engine, "run", "--detach", *self.flags, *only_spec_tmpfs, *extra, self.image, *self.args]


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
    assert set(container) <= CONTAINER_FIELDS, f"fields not translated: {set(container) - CONTAINER_FIELDS}"
    rendered = container["image"].split("@")[0].rsplit(":", 1)[0]
    assert rendered == image.rsplit(":", 1)[0], (container["image"], image)
    entrypoint, *command_rest = container["command"]
    flags = ["--entrypoint", entrypoint]
    for e in container.get("env", []):
        assert set(e) == {"name", "value"}, f"env {e} (valueFrom needs the cluster's objects)"
        flags += ["--env", f"{e['name']}={e['value']}"]
    [port] = container["ports"]
    assert port.get("protocol", "TCP") == "TCP"
    sc = container["securityContext"]
    assert set(sc) <= SECURITY_FIELDS, f"securityContext fields not translated: {set(sc) - SECURITY_FIELDS}"
    assert sc["runAsNonRoot"] and sc["runAsUser"] != 0
    assert sc.get("seccompProfile", {"type": "RuntimeDefault"}) == {
        "type": "RuntimeDefault"
    }  # the engine's default
    flags += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}"]
    if sc.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    if sc.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    for cap in sc.get("capabilities", {}).get("drop", []):
        flags += ["--cap-drop", cap]
    limits = container.get("resources", {}).get("limits", {})
    if "cpu" in limits:
        flags += ["--cpus", cpus(str(limits["cpu"]))]
    if "memory" in limits:
        flags += ["--memory", str(memory_bytes(str(limits["memory"])))]
    volumes = {v["name"]: v for v in pod_volumes}
    tmpfs = []
    for m in container.get("volumeMounts", []):
        v = volumes[m["name"]]
        assert set(v) == {"name", "emptyDir"}, f"volume {v}: only emptyDir is translated (a tmpfs)"
        size = v["emptyDir"].get("sizeLimit")
        flags += [
            "--tmpfs",
            f"{m['mountPath']}:rw,mode=1777" + (f",size={memory_bytes(size)}" if size else ""),
        ]
        tmpfs.append(m["mountPath"])
    return RunSpec(
        flags,
        image,
        [*command_rest, *container.get("args", []), *kserve_args],
        int(port["containerPort"]),
        _probe(container["readinessProbe"]),
        _probe(container["livenessProbe"]),
        tmpfs,
    )
