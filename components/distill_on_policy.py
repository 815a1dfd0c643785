"""KFP component: on-policy distillation (PAPER 3.3): the student's own rollouts, scored by the frozen AR teacher."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components._image import GPU_COMPONENT_KWARGS


@dsl.component(**GPU_COMPONENT_KWARGS)
def distill_on_policy(
    student_model: Input[Model],
    teacher_model: Input[Model],
    sft_data: Input[Artifact],
    examples: Input[Dataset],
    model: Output[Model],
    metrics: Output[Metrics],
    profile: str,
):
    """The student samples with its block-diffusion decoder (G' rollouts per prompt); the teacher scores the
    committed tokens once per trajectory; per-token KL (direction from the profile). Bundle in model/bundle."""
    from components._lib import model_steps

    info = model_steps.distill(
        student_model.path, teacher_model.path, sft_data.path, examples.path, model.path, profile
    )
    for k, v in info.items():
        if isinstance(v, int | float):
            metrics.log_metric(f"opd/{k}", v)
