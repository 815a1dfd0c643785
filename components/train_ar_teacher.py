"""KFP component: GR2 AR teacher SFT (answer weighted above trace); a GPU step on the cluster."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Metrics, Model, Output

from components._image import GPU_COMPONENT_KWARGS


@dsl.component(**GPU_COMPONENT_KWARGS)
def train_ar_teacher(
    sft_data: Input[Artifact],
    model: Output[Model],
    metrics: Output[Metrics],
    profile: str,
    variant: str = "trace",
):
    """Train on prompt -> (trace, answer) ("trace") or answer only ("ar_no_trace"); bundle in model/bundle."""
    from components._lib import model_steps

    info = model_steps.train_ar(sft_data.path, model.path, profile, variant)
    model.metadata.update(
        {"variant": variant, **{k: v for k, v in info.items() if isinstance(v, int | float)}}
    )
    for k in ("final_loss", "tokens_per_s", "n_params", "steps"):
        if info.get(k) is not None:
            metrics.log_metric(k, info[k])
