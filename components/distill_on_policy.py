"""KFP component: on-policy distillation (docs/PAPER.md, OPD): the student's own rollouts, scored by the frozen AR teacher."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def distill_on_policy(
    student_model: Input[Model],
    teacher_model: Input[Model],
    sft_data: Input[Artifact],
    examples: Input[Dataset],
    model: Output[Model],
    metrics: Output[Metrics],
    profile: str,
    train_nodes: int = 1,
    gpus_per_node: int = 1,
):
    """The student samples with its block-diffusion decoder (G' rollouts per prompt); the teacher scores the
    committed tokens once per trajectory; per-token KL (direction from the profile). Bundle in model/bundle.
    A TrainJob of train_nodes x gpus_per_node processes on a cluster (components/_lib/trainjob.py)."""
    from components._lib import trainjob

    info = trainjob.run_step(
        "distill",
        {
            "student_dir": student_model.path,
            "teacher_dir": teacher_model.path,
            "sft_dir": sft_data.path,
            "examples_path": examples.path,
        },
        {"out_dir": model.path},
        {"profile": profile},
        train_nodes,
        gpus_per_node,
    )
    for k, v in info.items():
        if isinstance(v, int | float):
            metrics.log_metric(f"opd/{k}", v)
