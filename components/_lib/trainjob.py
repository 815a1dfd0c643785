"""Run a training step (SFT, CFT, OPD, RL) in N processes: the same model_steps function in every rank.

    run_step(step, kwargs, nodes=1, procs_per_node=1) -> the step's training summary (reranker.json "train")

Where it runs (`where()`):
- "inline": in this process, when nodes * procs_per_node == 1 outside a cluster (`make run`, most tests).
- "torchrun": locally in procs_per_node processes (gloo on CPU, nccl on GPUs), through
  `python -m torch.distributed.run --standalone --nproc-per-node N -m components._lib.trainjob STEP KWARGS`.
  (The kubeflow SDK's local process backend is not used: it builds a fresh venv per job, pip-installs torch
  from the network and starts one process.)
- "trainjob": inside a cluster (KUBERNETES_SERVICE_HOST is set), a Kubeflow Trainer TrainJob
  (trainer.kubeflow.org/v1alpha1) on the torch-distributed runtime, created through the kubeflow SDK's
  TrainerClient: `nodes` pods with `procs_per_node` GPUs each, on the GPU pool, running `trainjob_entry` under
  torchrun in the training image. The KFP step copies its inputs onto a shared ReadWriteMany volume (the pods
  cannot see the step's local artifact paths), waits for the job, and copies the outputs back into its
  artifacts. The checkpoints live on that volume too, so a retried step (same output URIs, same job name)
  re-attaches to a running job or resumes a failed one from its last checkpoint.

Every rank runs the whole step; gr2/train.py splits the batches by rank and all-reduces the gradients, and
the stages write their bundles and logs on rank 0 only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

# step -> (model_steps function, the kwarg naming the folder that receives the step's bundle)
STEPS = {
    "train_ar": ("train_ar", "out_dir"),
    "convert_cft": ("convert_cft", "cft_dir"),
    "rl": ("rl", "out_dir"),
    "distill": ("distill", "out_dir"),
}
RUNTIME = os.environ.get("GR2_TRAIN_RUNTIME", "torch-distributed")  # a (Cluster)TrainingRuntime name
PVC = os.environ.get("GR2_TRAIN_PVC", "gr2-train-workspace")  # ReadWriteMany claim shared by step and job
MOUNT = os.environ.get("GR2_TRAIN_MOUNT", "/mnt/gr2-train")
TIMEOUT_S = int(os.environ.get("GR2_TRAINJOB_TIMEOUT_S", str(48 * 3600)))
POLL_S = int(os.environ.get("GR2_TRAINJOB_POLL_S", "30"))


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def where(nodes: int, procs_per_node: int) -> str:
    if in_cluster():
        return "trainjob"
    if nodes != 1:
        raise ValueError(f"{nodes} nodes need a cluster (a TrainJob); locally use procs_per_node")
    return "inline" if procs_per_node == 1 else "torchrun"


def run_here(step: str, kwargs: dict[str, Any]) -> dict:
    """This process's share of the step (a rank under torchrun, or the whole step in one process)."""
    from components._lib import model_steps

    fn_name, _ = STEPS[step]
    return getattr(model_steps, fn_name)(**kwargs)


def train_summary(step: str, outputs: dict[str, str]) -> dict:
    """The step's training summary, read back from the bundle it wrote (the parent of a torchrun / TrainJob)."""
    from gr2.generative import bundle_dir

    out = bundle_dir(outputs[STEPS[step][1]])
    return json.loads((out / "reranker.json").read_text())["train"]


def torchrun_command(step: str, kwargs: dict[str, Any], procs: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={procs}",
        "-m",
        "components._lib.trainjob",
        step,
        json.dumps(kwargs),
    ]


def run_step(
    step: str,
    inputs: dict[str, str],
    outputs: dict[str, str],
    params: dict[str, Any],
    nodes: int = 1,
    procs_per_node: int = 1,
) -> dict:
    """Run model_steps.<step>(**inputs, **outputs, **params) inline, under torchrun, or as a TrainJob
    (module docstring). inputs / outputs: the step's folder arguments (read / written)."""
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; expected one of {sorted(STEPS)}")
    mode = where(nodes, procs_per_node)
    kwargs = {**inputs, **outputs, **params}
    if mode == "inline":
        return run_here(step, kwargs)
    if mode == "torchrun":
        from components._lib.paths import REPO_ROOT

        path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        subprocess.run(torchrun_command(step, kwargs, procs_per_node), check=True, env=env)
        return train_summary(step, outputs)
    return run_trainjob(step, inputs, outputs, params, nodes, procs_per_node)


# ------------------------------------------------------------------------------------------------ TrainJob
def trainjob_entry(step: str, kwargs_json: str) -> None:
    """What every TrainJob process runs (the SDK embeds this function's source; torchrun starts it)."""
    import json

    from components._lib.trainjob import run_here

    run_here(step, json.loads(kwargs_json))


def job_name(step: str, kwargs: dict[str, Any]) -> str:
    """A DNS-1035 name that is a function of the step's inputs and outputs (a retry gets the same job)."""
    digest = hashlib.sha1(json.dumps(kwargs, sort_keys=True).encode()).hexdigest()[:12]
    return f"gr2-{step.replace('_', '-')}-{digest}"


def trainjob_request(
    step: str, kwargs: dict[str, Any], nodes: int, gpus_per_node: int, name: str
) -> tuple[Any, list]:
    """(CustomTrainer, options) for TrainerClient.train: image, nodes, GPUs, GPU pool, the shared volume."""
    from kubeflow.trainer import CustomTrainer
    from kubeflow.trainer.options import (
        ContainerPatch,
        JobSetSpecPatch,
        JobSetTemplatePatch,
        JobSpecPatch,
        JobTemplatePatch,
        Labels,
        Name,
        PodSpecPatch,
        PodTemplatePatch,
        ReplicatedJobPatch,
        RuntimePatch,
        TrainingRuntimeSpecPatch,
    )

    from components._image import TRAIN_IMAGE
    from components._lib.gpu_pool import GPU_POOL_LABEL, GPU_POOL_VALUE, GPU_TOLERATION

    trainer = CustomTrainer(
        func=trainjob_entry,
        func_args={"step": step, "kwargs_json": json.dumps(kwargs)},
        image=TRAIN_IMAGE,
        num_nodes=nodes,
        resources_per_node={
            "gpu": gpus_per_node,
            "cpu": 8 * gpus_per_node,
            "memory": f"{32 * gpus_per_node}Gi",
        },
        env={"PYTHONPATH": "/app", "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"},
    )
    pod = PodSpecPatch(
        volumes=[{"name": "workspace", "persistentVolumeClaim": {"claimName": PVC}}],
        containers=[ContainerPatch(name="node", volume_mounts=[{"name": "workspace", "mountPath": MOUNT}])],
        node_selector={GPU_POOL_LABEL: GPU_POOL_VALUE},
        tolerations=[dict(GPU_TOLERATION)],
    )
    patch = RuntimePatch(
        training_runtime_spec=TrainingRuntimeSpecPatch(
            template=JobSetTemplatePatch(
                spec=JobSetSpecPatch(
                    replicated_jobs=[
                        ReplicatedJobPatch(
                            name="node",
                            template=JobTemplatePatch(spec=JobSpecPatch(template=PodTemplatePatch(spec=pod))),
                        )
                    ]
                )
            )
        )
    )
    labels = Labels({"app.kubernetes.io/part-of": "gr2", "gr2.dev/step": step.replace("_", "-")})
    return trainer, [Name(name), labels, patch]


def run_trainjob(
    step: str,
    inputs: dict[str, str],
    outputs: dict[str, str],
    params: dict[str, Any],
    nodes: int,
    gpus_per_node: int,
    client: Any = None,
) -> dict:
    """Submit the step as a TrainJob (or re-attach to the one a previous try submitted), wait, copy back."""
    from kubeflow.trainer import TrainerClient

    client = client or TrainerClient()
    name = job_name(step, {**inputs, **outputs, **params})
    work = Path(MOUNT) / name
    job_kwargs = dict(params)
    for k, src in inputs.items():  # the job's pods cannot see this pod's artifact paths
        dst = work / "in" / k
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, dst) if Path(src).is_dir() else shutil.copy2(src, dst)
        job_kwargs[k] = str(dst)
    job_kwargs.update({k: str(work / "out" / k) for k in outputs})
    try:
        status = client.get_job(name).status
    except RuntimeError:  # no such job yet
        status = None
    if status == "Failed":  # resubmit: it resumes from the checkpoints on the volume
        client.delete_job(name)
        status = None
    if status is None:
        trainer, options = trainjob_request(step, job_kwargs, nodes, gpus_per_node, name)
        client.train(runtime=RUNTIME, trainer=trainer, options=options)
    client.wait_for_job_status(name, timeout=TIMEOUT_S, polling_interval=POLL_S)
    for k, out_path in outputs.items():
        shutil.copytree(work / "out" / k, out_path, dirs_exist_ok=True)
    return train_summary(step, outputs)


def main(argv: list[str] | None = None) -> None:
    """`python -m components._lib.trainjob STEP KWARGS_JSON`: one rank of a torchrun launch."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    step, kwargs_json = (argv or sys.argv[1:])[:2]
    run_here(step, json.loads(kwargs_json))


if __name__ == "__main__":
    main()
