"""KFP component: load a dataset and write the parquet sources of the feature store (components/_lib/sources.py)."""

from kfp import dsl
from kfp.dsl import Dataset, Metrics, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def ingest(
    dataset: str,
    profile: str,
    snapshot_date: str,
    max_users: int,
    sources: Output[Dataset],
    metrics: Output[Metrics],
):
    """Write interactions/items/user_history/item_features parquet for `dataset` (name or path).

    Malformed data fails here, before anything is written (gr2.data.dataset.DatasetError names the file,
    line and column). The metrics carry the dataset profile: what the data has and lacks."""
    from components._lib import steps
    from gr2.data.profile import profile_metrics

    meta = steps.ingest(dataset, sources.path, profile, snapshot_date, max_users)
    sources.metadata.update(
        {k: meta[k] for k in ("dataset", "n_users", "n_items", "n_interactions", "snapshot_date")}
    )
    sources.metadata["lacks"] = ", ".join(meta["profile"]["lacks"]) or "nothing"
    for k in ("n_users", "n_items", "n_interactions", "seconds"):
        metrics.log_metric(k, meta[k])
    for k, v in profile_metrics(meta["profile"]).items():
        metrics.log_metric(k, v)
