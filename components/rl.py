"""KFP component: GRPO/DAPO with the GR2 reward (GR2 stage 3 for the AR teacher; docs/PAPER.md, RL)."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def rl(
    in_model: Input[Model],
    sft_data: Input[Artifact],
    examples: Input[Dataset],
    model: Output[Model],
    metrics: Output[Metrics],
    profile: str,
    train_nodes: int = 1,
    gpus_per_node: int = 1,
):
    """RL on training prompts. The decoder follows the input bundle: an AR teacher samples AR (profile.ar_rl),
    a block-diffusion student samples with its real decoder (profile.rl). Bundle in model/bundle, rollout
    log and curves (reward, validity, loss) in model/train. A TrainJob of train_nodes x gpus_per_node
    processes on a cluster (components/_lib/trainjob.py)."""
    from components._lib import trainjob

    info = trainjob.run_step(
        "rl",
        {"model_dir": in_model.path, "sft_dir": sft_data.path, "examples_path": examples.path},
        {"out_dir": model.path},
        {"profile": profile},
        train_nodes,
        gpus_per_node,
    )
    for k, v in info.items():
        if isinstance(v, int | float):
            metrics.log_metric(f"rl/{k}", v)
