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
    run_id: str = "",
):
    """Write interactions/items/user_history/item_features parquet for `dataset` (name, path, or an event log
    s3://... read as of `snapshot_date`, components/event_log.py).

    Malformed data fails here, before anything is written (gr2.data.dataset.DatasetError names the file,
    line and column). The metrics carry the dataset profile: what the data has and lacks. With `run_id`, what
    was read (for an event log: every object with its ETag) is published to the artifact store for the run's
    outcome."""
    from components._lib import steps
    from components.artifact_store import publish
    from gr2.data.profile import profile_metrics

    meta = steps.ingest(dataset, sources.path, profile, snapshot_date, max_users)
    if run_id:
        keys = ("dataset", "snapshot_date", "n_interactions", "n_users", "n_items", "source", "objects")
        publish(run_id, "ingest", {k: meta.get(k) for k in keys})
    sources.metadata.update(
        {k: meta[k] for k in ("dataset", "n_users", "n_items", "n_interactions", "snapshot_date")}
    )
    sources.metadata["lacks"] = ", ".join(meta["profile"]["lacks"]) or "nothing"
    for k in ("n_users", "n_items", "n_interactions", "seconds"):
        metrics.log_metric(k, meta[k])
    for k, v in profile_metrics(meta["profile"]).items():
        metrics.log_metric(k, v)
