"""KFP component: train/val/test targets through Feast point-in-time retrieval (feature service reranker_v1)."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def extract(
    sources: Input[Dataset],
    feature_store: Input[Artifact],
    targets: Output[Dataset],
    metrics: Output[Metrics],
    fs_yaml: str = "",
):
    """Write targets.parquet (example_id, user_id, split, target_pos, event_ts, history, target)."""
    from components._lib import steps

    info = steps.extract(sources.path, feature_store.path, targets.path, fs_yaml)
    targets.metadata.update(info)
    for k, v in info.items():
        metrics.log_metric(k, v)
