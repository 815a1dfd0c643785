"""Kubernetes settings of pipeline tasks, in one place (kfp.local ignores them; the cluster honours them).

Training steps submit Kubeflow Trainer TrainJobs (`train_task`). GPU steps (decoding) land on the GPU node pool:
accelerator limit, node selector, the nvidia.com/gpu toleration, resource requests and retries with backoff. The
pool's label and taint are defined once, in the kustomize component that puts the serving predictor there
(manifests/components/gpu-pool/gpu-pool.yaml, read by components/_lib/gpu_pool.py); TrainJobs use the same.
Every task gets the artifact-store credentials from a Kubernetes Secret as environment variables (never from
pipeline parameters)."""

import os

from kfp import kubernetes

from components._lib.gpu_pool import GPU_POOL_LABEL, GPU_POOL_VALUE, GPU_TOLERATION
from components._lib.trainjob import MOUNT as TRAIN_MOUNT
from components._lib.trainjob import PVC as TRAIN_PVC

GPU_TYPE = os.environ.get("GR2_GPU_TYPE", "nvidia.com/gpu")
S3_SECRET = os.environ.get("GR2_S3_SECRET", "gr2-s3-credentials")
S3_SECRET_KEYS = {"AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY"}
# Where the artifact store is (not secret): a ConfigMap, so gate and deploy read the real production record.
STORE_CONFIG_MAP = os.environ.get("GR2_STORE_CONFIG_MAP", "gr2-artifact-store")
STORE_KEYS = {k: k for k in ("S3_ENDPOINT_URL", "GR2_S3_BUCKET", "GR2_S3_PREFIX")}


def _common(task):
    kubernetes.use_secret_as_env(task, secret_name=S3_SECRET, secret_key_to_env=S3_SECRET_KEYS)
    kubernetes.use_config_map_as_env(task, config_map_name=STORE_CONFIG_MAP, config_map_key_to_env=STORE_KEYS)
    return task


def cpu_task(task, cpu: str = "2", memory: str = "8G", retries: int = 0):
    """A CPU step: requests, S3 credentials, and `retries` retries (30 s apart).

    Retry only a step that talks to a service which can fail for a moment (feature store registry and
    online store, the artifact store, the Kubernetes API). A step that only computes on its inputs fails
    the same way again: a retry would repeat a data error (bad rows, a missing column) and double its
    time before anyone sees it. Steps that read a dataset or compute on artifacts therefore get none."""
    task.set_cpu_request(cpu).set_memory_request(memory)
    if retries:
        task.set_retry(retries, backoff_duration="30s")
    return _common(task)


def gpu_task(task, gpus: int = 1, cpu: str = "8", memory: str = "32G"):
    """A GPU step on the GPU pool: accelerator, node selector, toleration, requests, retries with backoff.

    Training stages resume from their last checkpoint, so a retry after preemption continues, not restarts."""
    task.set_accelerator_type(GPU_TYPE).set_accelerator_limit(gpus)
    task.set_cpu_request(cpu).set_memory_request(memory)
    task.set_retry(2, backoff_duration="60s", backoff_factor=2, backoff_max_duration="1800s")
    kubernetes.add_node_selector(task, label_key=GPU_POOL_LABEL, label_value=GPU_POOL_VALUE)
    kubernetes.add_toleration(task, **GPU_TOLERATION)
    return _common(task)


def train_task(task):
    """A training step (SFT, CFT, OPD, RL): a small pod that submits the stage as a Kubeflow Trainer TrainJob and
    waits for it (components/_lib/trainjob.py). The GPUs, GPU pool and tolerations are the TrainJob's; the
    shared workspace volume carries inputs, checkpoints and outputs between this pod and the job's pods. A retry
    re-attaches to the job (or resumes it from its checkpoints)."""
    task.set_cpu_request("1").set_memory_request("4G")
    task.set_retry(2, backoff_duration="60s", backoff_factor=2, backoff_max_duration="1800s")
    kubernetes.mount_pvc(task, pvc_name=TRAIN_PVC, mount_path=TRAIN_MOUNT)
    return _common(task)
