"""KFP component: AR -> block diffusion (weight copy + block-causal attention + token shift), then CFT."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Metrics, Model, Output

from components._image import GPU_COMPONENT_KWARGS


@dsl.component(**GPU_COMPONENT_KWARGS)
def convert_cft(
    ar_model: Input[Model],
    sft_data: Input[Artifact],
    naive_model: Output[Model],
    model: Output[Model],
    metrics: Output[Metrics],
    profile: str,
):
    """naive_model = the converted AR weights (no training); model = after conversion fine-tuning (model/bundle)."""
    from components._lib import model_steps

    info = model_steps.convert_cft(ar_model.path, sft_data.path, naive_model.path, model.path, profile)
    for k in ("final_loss", "tokens_per_s", "steps"):
        if info.get(k) is not None:
            metrics.log_metric(f"cft/{k}", info[k])
