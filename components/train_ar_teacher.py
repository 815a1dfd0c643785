"""KFP component: GR2 AR teacher SFT (answer weighted above trace); a TrainJob on the cluster."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Metrics, Model, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def train_ar_teacher(
    sft_data: Input[Artifact],
    model: Output[Model],
    metrics: Output[Metrics],
    profile: str,
    variant: str = "trace",
    train_nodes: int = 1,
    gpus_per_node: int = 1,
):
    """Train on prompt -> (trace, answer) ("trace") or answer only ("ar_no_trace"); bundle in model/bundle.

    On a cluster the training runs as a Kubeflow Trainer TrainJob of train_nodes x gpus_per_node processes
    (components/_lib/trainjob.py); locally in this process, or in gpus_per_node processes under torchrun."""
    from components._lib import trainjob

    info = trainjob.run_step(
        "train_ar",
        {"sft_dir": sft_data.path},
        {"out_dir": model.path},
        {"profile": profile, "variant": variant},
        train_nodes,
        gpus_per_node,
    )
    model.metadata.update(
        {"variant": variant, **{k: v for k, v in info.items() if isinstance(v, int | float)}}
    )
    for k in ("final_loss", "tokens_per_s", "n_params", "steps"):
        if info.get(k) is not None:
            metrics.log_metric(k, info[k])
