"""A training step submitted as a Kubeflow Trainer TrainJob, against a fake Kubernetes API on 127.0.0.1.

The real kubeflow SDK (TrainerClient, Kubernetes backend) and the real kubernetes client talk HTTP to a small
fake API server that serves the torch-distributed ClusterTrainingRuntime, stores the TrainJob it is sent and
reports it Complete. The fake "node" runs the job's embedded Python (the script the SDK writes for torchrun)
with the step itself stubbed to write a bundle, so the step's copy-in / copy-out through the shared volume is
exercised. The submitted TrainJob is checked against the Trainer API models (kubeflow-trainer-api).
"""

from __future__ import annotations

import json
import re
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from kubeflow_trainer_api import models
from kubernetes import client as k8s

from components._image import TRAIN_IMAGE
from components._lib import trainjob
from components._lib.gpu_pool import GPU_POOL_LABEL, GPU_POOL_VALUE

GROUP = "/apis/trainer.kubeflow.org/v1alpha1"
# The torch-distributed ClusterTrainingRuntime as Kubeflow Trainer installs it (trimmed to what the SDK reads).
RUNTIME = {
    "apiVersion": "trainer.kubeflow.org/v1alpha1",
    "kind": "ClusterTrainingRuntime",
    "metadata": {"name": "torch-distributed", "labels": {"trainer.kubeflow.org/framework": "torch"}},
    "spec": {
        "mlPolicy": {"numNodes": 1, "torch": {"numProcPerNode": "auto"}},
        "template": {
            "spec": {
                "replicatedJobs": [
                    {
                        "name": "node",
                        "template": {
                            "metadata": {
                                "labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
                            },
                            "spec": {
                                "template": {
                                    "spec": {
                                        "containers": [
                                            {
                                                "name": "node",
                                                "image": "pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime",
                                            }
                                        ]
                                    }
                                }
                            },
                        },
                    }
                ]
            }
        },
    },
}


class FakeKube:
    """Just enough of the Kubernetes API for TrainerClient.train / get_job / wait_for_job_status."""

    def __init__(self, on_create):
        self.jobs: dict[str, dict] = {}
        self.posts: list[dict] = []
        self.on_create = on_create
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                path = self.path.split("?")[0]
                if path == f"{GROUP}/clustertrainingruntimes/torch-distributed":
                    return self._send(200, RUNTIME)
                if m := re.fullmatch(rf"{GROUP}/namespaces/([^/]+)/trainjobs/([^/]+)", path):
                    if m.group(2) in fake.jobs:
                        return self._send(200, fake.jobs[m.group(2)])
                if re.fullmatch(r"/api/v1/namespaces/[^/]+/pods", path):
                    return self._send(
                        200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []}
                    )
                self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                m = re.fullmatch(rf"{GROUP}/namespaces/([^/]+)/trainjobs", self.path.split("?")[0])
                if not m:
                    return self._send(404, {"kind": "Status", "code": 404})
                fake.posts.append(body)
                fake.on_create(body)  # the "pods" run, then the job reports Complete
                stored = json.loads(json.dumps(body))
                stored["metadata"] |= {
                    "namespace": m.group(1),
                    "creationTimestamp": datetime.now(UTC).isoformat(),
                }
                now = datetime.now(UTC).isoformat()
                done = {"type": "Complete", "status": "True", "reason": "JobsCompleted", "message": "done"}
                stored["status"] = {"conditions": [done | {"lastTransitionTime": now}]}
                fake.jobs[body["metadata"]["name"]] = stored
                self._send(201, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def client(self):
        from kubeflow.common.types import KubernetesBackendConfig
        from kubeflow.trainer import TrainerClient

        conf = k8s.Configuration(host=f"http://127.0.0.1:{self.server.server_address[1]}")
        return TrainerClient(
            backend_config=KubernetesBackendConfig(namespace="gr2", client_configuration=conf)
        )

    def close(self):
        self.server.shutdown()


def run_pod(body: dict, monkeypatch) -> list[tuple]:
    """What a node pod does with the TrainJob: the SDK's script (the function source + its call) under torchrun;
    here the step itself is replaced by a stub that records its arguments and writes a bundle."""
    script = body["spec"]["trainer"]["command"][2]
    assert "torchrun" in script
    code = script.split("<< EOM\n", 1)[1].split("\nEOM", 1)[0]
    calls: list[tuple] = []

    def fake_step(step, kwargs):
        calls.append((step, kwargs))
        bundle = Path(kwargs["out_dir"]) / "bundle"
        bundle.mkdir(parents=True)
        (bundle / "reranker.json").write_text(json.dumps({"name": "ar_sft", "train": {"steps": 3}}))

    monkeypatch.setattr(trainjob, "run_here", fake_step)
    exec(compile(code, "trainjob.py", "exec"), {"__name__": "__main__"})
    return calls


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # the step believes it runs in a pod
    monkeypatch.setattr(trainjob, "MOUNT", str(tmp_path / "workspace"))
    monkeypatch.setattr(trainjob, "POLL_S", 1)
    pods: list[tuple] = []
    fake = FakeKube(lambda body: pods.extend(run_pod(body, monkeypatch)))
    yield fake, pods
    fake.close()


def test_training_step_runs_as_a_trainjob_and_returns_its_output(cluster, tmp_path):
    fake, pods = cluster
    sft = tmp_path / "artifacts" / "sft_data"
    sft.mkdir(parents=True)
    (sft / "records.json").write_text("[]")
    out = tmp_path / "artifacts" / "model"
    inputs, outputs, params = (
        {"sft_dir": str(sft)},
        {"out_dir": str(out)},
        {"profile": "gpu", "variant": "trace"},
    )
    assert trainjob.where(2, 4) == "trainjob"
    info = trainjob.run_trainjob("train_ar", inputs, outputs, params, 2, 4, client=fake.client())
    assert info == {"steps": 3}  # read back from the bundle the job wrote onto the volume
    assert json.loads((out / "bundle" / "reranker.json").read_text())["name"] == "ar_sft"

    [body] = fake.posts
    # The submitted object is a valid TrainJob: every field is one the Trainer API models know.
    job = models.TrainerV1alpha1TrainJob.from_dict(body)
    assert job.to_dict() == body
    assert body["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and body["kind"] == "TrainJob"
    assert body["metadata"]["name"] == trainjob.job_name("train_ar", {**inputs, **outputs, **params})
    assert (
        job.spec.runtime_ref.name == "torch-distributed"
        and job.spec.runtime_ref.kind == "ClusterTrainingRuntime"
    )
    tr = job.spec.trainer
    assert tr.num_nodes == 2 and tr.image == TRAIN_IMAGE
    assert body["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 4
    pod = body["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert pod["name"] == "node"
    pod_spec = pod["template"]["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {GPU_POOL_LABEL: GPU_POOL_VALUE}
    assert pod_spec["volumes"] == [
        {"name": "workspace", "persistentVolumeClaim": {"claimName": trainjob.PVC}}
    ]
    assert pod_spec["containers"][0]["volumeMounts"] == [{"name": "workspace", "mountPath": trainjob.MOUNT}]

    # The pod ran the step on the volume's copies, not on this pod's artifact paths.
    [(step, kwargs)] = pods
    work = Path(trainjob.MOUNT) / body["metadata"]["name"]
    assert step == "train_ar" and kwargs["profile"] == "gpu" and kwargs["variant"] == "trace"
    assert (
        kwargs["sft_dir"] == str(work / "in" / "sft_dir")
        and (work / "in" / "sft_dir" / "records.json").exists()
    )
    assert kwargs["out_dir"] == str(work / "out" / "out_dir")

    # A retry of the step (same artifacts) re-attaches to the finished job instead of training again.
    info = trainjob.run_trainjob("train_ar", inputs, outputs, params, 2, 4, client=fake.client())
    assert len(fake.posts) == 1 and info == {"steps": 3}


def test_local_modes():
    assert trainjob.where(1, 1) == "inline" and trainjob.where(1, 2) == "torchrun"
    with pytest.raises(ValueError, match="cluster"):
        trainjob.where(2, 1)
    cmd = trainjob.torchrun_command("rl", {"out_dir": "/x"}, 2)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert cmd[5:8] == ["-m", "components._lib.trainjob", "rl"] and json.loads(cmd[8]) == {"out_dir": "/x"}
