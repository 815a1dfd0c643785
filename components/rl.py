"""KFP component: GRPO/DAPO with the GR2 reward (GR2 stage 3 for the AR teacher; PAPER 3.4 for the student)."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components._image import GPU_COMPONENT_KWARGS


@dsl.component(**GPU_COMPONENT_KWARGS)
def rl(
    in_model: Input[Model],
    sft_data: Input[Artifact],
    examples: Input[Dataset],
    model: Output[Model],
    metrics: Output[Metrics],
    profile: str,
):
    """RL on training prompts. The decoder follows the input bundle: an AR teacher samples AR (profile.ar_rl),
    a block-diffusion student samples with its real decoder (profile.rl). Bundle in model/bundle, rollout
    log and curves (reward, validity, loss) in model/train."""
    from components._lib import model_steps

    info = model_steps.rl(in_model.path, sft_data.path, examples.path, model.path, profile)
    for k, v in info.items():
        if isinstance(v, int | float):
            metrics.log_metric(f"rl/{k}", v)
