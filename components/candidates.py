"""KFP component: retriever top-N candidate lists -> the re-ranking examples table (retrieval hits only)."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def candidates(
    sources: Input[Dataset],
    targets: Input[Dataset],
    examples: Output[Dataset],
    metrics: Output[Metrics],
    profile: str,
):
    """Write examples.parquet (docs/CONTRACTS.md examples table) and log the retriever's hit rate."""
    from components._lib import steps

    info = steps.candidates(sources.path, targets.path, examples.path, profile)
    examples.metadata.update(info)
    for k, v in info.items():
        if isinstance(v, int | float):
            metrics.log_metric(k, v)
