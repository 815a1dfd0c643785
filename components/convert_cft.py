"""KFP component: AR -> block diffusion (weight copy + block-causal attention + token shift), then CFT."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Metrics, Model, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def convert_cft(
    ar_model: Input[Model],
    sft_data: Input[Artifact],
    naive_model: Output[Model],
    model: Output[Model],
    metrics: Output[Metrics],
    profile: str,
    train_nodes: int = 1,
    gpus_per_node: int = 1,
):
    """naive_model = the converted AR weights (no training); model = after conversion fine-tuning (model/bundle).
    A TrainJob of train_nodes x gpus_per_node processes on a cluster (components/_lib/trainjob.py)."""
    from components._lib import trainjob

    info = trainjob.run_step(
        "convert_cft",
        {"ar_dir": ar_model.path, "sft_dir": sft_data.path},
        {"naive_dir": naive_model.path, "cft_dir": model.path},
        {"profile": profile},
        train_nodes,
        gpus_per_node,
    )
    for k in ("final_loss", "tokens_per_s", "steps"):
        if info.get(k) is not None:
            metrics.log_metric(f"cft/{k}", info[k])
