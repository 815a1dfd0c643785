"""KFP component: semantic IDs, tokenizer, reasoning teacher and SFT records from the validated examples."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def prepare_sft(
    sources: Input[Dataset],
    examples: Input[Dataset],
    sft_data: Output[Artifact],
    metrics: Output[Metrics],
    profile: str,
):
    """Write sft_data/ (evidence tables with bucket edges, sids.json, tokenizer/, teacher.json, records.pt)."""
    from components._lib import model_steps

    info = model_steps.prepare_sft(sources.path, examples.path, sft_data.path, profile)
    sft_data.metadata.update({k: v for k, v in info.items() if isinstance(v, int | float | str)})
    for k in ("teacher_recall@1_val", "sid_unique_levels_1_3", "vocab_size"):
        if info.get(k) is not None:
            metrics.log_metric(k, info[k])
