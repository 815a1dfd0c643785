"""The serving image run as the dev overlay's InferenceService runs it: each container started from exactly the spec
`kubectl kustomize manifests/overlays/dev` renders (read here, so a drift between the manifests and the image fails
these tests), plus the arguments KServe appends, serving the RL bundle the containerized DAG trained
(tests/containers/test_dag.py), mounted read-only at /mnt/models as KServe's storage initializer leaves it.

dev's transformer reads features from the namespace's Feast HTTP feature server (`--feast_url
http://feast-feature-server:6566`); here that server is the serving image's own `feast serve` over the image's
/app/feature_repo, with the DAG run's registry and online store. Requests go from the host to the containers'
addresses on the engine's network, on the ports the manifests declare."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from deploy.smoke_local import instances, probe, v2_body
from manifests.kustomize import build
from pipelines.containers import engine
from tests.containers.kube import run_spec
from tests.containers.support import bundle_named, run_output

pytestmark = [pytest.mark.slow, pytest.mark.server]

ROOT = Path(__file__).resolve().parents[2]
FEAST_PORT = 6566  # dev's feature server URL names it
READY_S = 300


@pytest.fixture(scope="module")
def isvc() -> dict:
    [doc] = [d for d in build(ROOT / "manifests" / "overlays" / "dev") if d["kind"] == "InferenceService"]
    return doc


def address(container) -> str:
    container.reload()
    ip = container.attrs["NetworkSettings"]["IPAddress"]
    assert ip, f"{container.name} has no address on the engine's network"
    return ip


def wait_200(url: str, container, what: str) -> None:
    """Poll `url` as the kubelet polls a probe, until it answers 200 (fails with the container's log)."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        container.reload()
        if container.status == "exited":
            pytest.fail(f"{what} exited:\n{container.logs().decode()[-4000:]}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"{what}: {url} not 200 within {READY_S} s:\n{container.logs().decode()[-4000:]}")


@pytest.fixture(scope="module")
def served(isvc, images, docker_client, dag, tmp_path_factory):
    """The feature server, the predictor and the transformer, started as above; stopped and removed after."""
    run = dag["docker"]
    name = isvc["metadata"]["name"]
    cli = engine(docker_client)
    started = []

    def start(argv: list[str]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{argv}: {r.stderr}"
        started.append(docker_client.containers.get(r.stdout.strip().splitlines()[-1]))
        return started[-1]

    try:
        # The run's registry and online store where the image's feature_store.yaml expects them (data/...).
        store = tmp_path_factory.mktemp("feast") / "data"
        store.mkdir()
        for f in ("registry.db", "online_store.db"):
            shutil.copy(run_output(run, "materialize/feature_store") / f, store / f)
        for p in (store, *store.iterdir()):
            shutil.chown(p, 10001, 10001)
        feast = start(
            [cli, "run", "--detach", "--volume", f"{store}:/app/feature_repo/data", "--entrypoint", "feast"]
            + [images["serve"], "-c", "/app/feature_repo", "serve", "-h", "0.0.0.0", "-p", str(FEAST_PORT)]
        )
        wait_200(f"http://{address(feast)}:{FEAST_PORT}/health", feast, "feast serve")

        spec = isvc["spec"]
        [pc], [tc] = spec["predictor"]["containers"], spec["transformer"]["containers"]
        kserve = ["--model_name", name, "--http_port", "8080"]
        pspec = run_spec(pc, spec["predictor"].get("volumes", []), images["serve"], kserve)
        pred = start(pspec.argv(cli, "--volume", f"{bundle_named(run, 'rl')}:/mnt/models:ro"))
        kserve = [
            "--model_name",
            name,
            "--predictor_host",
            f"{address(pred)}:{pspec.port}",
            "--http_port",
            "8080",
        ]
        tspec = run_spec(tc, spec["transformer"].get("volumes", []), images["serve"], kserve)
        trans = start(tspec.argv(cli, "--add-host", f"feast-feature-server:{address(feast)}"))
        out = {}
        for role, c, s in (("predictor", pred, pspec), ("transformer", trans, tspec)):
            wait_200(f"http://{address(c)}:{s.readiness.port}{s.readiness.path}", c, role)
            out[role] = {"container": c, "spec": s, "url": f"http://{address(c)}:{s.port}"}
        yield {**out, "name": name, "examples": run_output(run, "candidates/examples"), "rendered": isvc}
    finally:
        for c in reversed(started):
            c.remove(force=True)


def test_probes_answer_200(served):
    """The readiness and liveness probes, as the manifests define them, on both containers."""
    for role in ("predictor", "transformer"):
        c, s = served[role]["container"], served[role]["spec"]
        for p in (s.readiness, s.liveness):
            r = httpx.get(f"http://{address(c)}:{p.port}{p.path}", timeout=10)
            assert r.status_code == 200, (role, p, r.text)


def test_v1_and_v2_from_the_host_get_valid_permutations(served):
    """Through the transformer (histories from the feature server) and on the predictor itself."""
    url, name = served["transformer"]["url"], served["name"]
    summary = probe(url, served["examples"], n_requests=6, model_name=name)
    assert summary["requests"] == 6 and summary["ok"] == 6, summary
    assert summary["with_history"] >= 1, summary  # read from the online store through `feast serve`
    assert summary["v2_status"] == 200 and summary["reversed_status"] == 200, summary
    insts = instances(served["examples"], 4)
    for base in (url, served["predictor"]["url"]):
        r = httpx.post(f"{base}/v1/models/{name}:predict", json={"instances": insts}, timeout=120)
        assert r.status_code == 200, r.text
        preds = r.json()["predictions"]
        r = httpx.post(f"{base}/v2/models/{name}/infer", json=v2_body(insts), timeout=120)
        assert r.status_code == 200, r.text
        [out] = r.json()["outputs"]
        preds2 = [json.loads(d) for d in out["data"]]
        for p, p2, i in zip(preds, preds2, insts, strict=True):
            assert sorted(p["ranking"]) == sorted(i["candidates"]) == sorted(p2["ranking"]), (base, p, p2)


def test_hostile_requests_get_4xx_and_the_server_stays_up(served):
    url, name = served["transformer"]["url"], served["name"]
    insts = instances(served["examples"], 1)
    v1 = f"{url}/v1/models/{name}:predict"
    bad = [
        httpx.post(v1, content=b'{"instances": [{"user_id": ', headers={"content-type": "application/json"}),
        httpx.post(
            v1, json={"instances": [{**insts[0], "candidates": ["no-such-item", *insts[0]["candidates"]]}]}
        ),
        httpx.post(v1, json={"instances": [{**insts[0], "history": ["x" * 100] * 200_000}]}),
    ]
    assert [400 <= r.status_code < 500 for r in bad] == [True] * len(bad), [
        (r.status_code, r.text[:200]) for r in bad
    ]
    assert httpx.post(v1, json={"instances": insts}, timeout=120).status_code == 200
    for role in ("predictor", "transformer"):
        served[role]["container"].reload()
        assert served[role]["container"].status == "running", role


def test_containers_run_as_the_spec_says(served):
    """uid 10001, a read-only root filesystem with a tmpfs only where the manifests mount one, the model read-only."""

    def sh(container, cmd: str) -> int:
        return container.exec_run(["sh", "-c", cmd]).exit_code

    for role in ("predictor", "transformer"):
        c = served[role]["container"]
        assert served[role]["spec"].tmpfs == ["/tmp"]
        assert c.exec_run(["id", "-u"]).output.decode().strip() == "10001", role
        assert sh(c, "touch /tmp/probe") == 0, role
        for path in ("/app/probe", "/var/tmp/probe", "/home/gr2/probe", "/run/probe"):
            assert sh(c, f"touch {path}") != 0, (role, path, "writable")
    pred = served["predictor"]["container"]
    assert sh(pred, "touch /mnt/models/probe") != 0 and sh(pred, "test -f /mnt/models/reranker.json") == 0


def test_image_entrypoint_is_the_manifests_command(served, images, docker_client):
    """KServe runs the rendered `command`; `docker run <image>` runs the image's ENTRYPOINT: the same program."""
    entry = docker_client.images.get(images["serve"]).attrs["Config"]["Entrypoint"]
    rendered = served["rendered"]["spec"]
    for role in ("predictor", "transformer"):
        [c] = rendered[role]["containers"]
        assert c["command"] == entry, (role, c["command"], entry)
