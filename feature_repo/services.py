"""Feature service `reranker_v1`: what training extraction and online serving both read (no skew)."""

from feast import FeatureService, FeatureView
from features import item_features, user_history  # feast imports repo files with the repo folder on sys.path

SERVICE_NAME = "reranker_v1"


def build_service(user_history_view: FeatureView, item_features_view: FeatureView) -> FeatureService:
    return FeatureService(
        name=SERVICE_NAME,
        features=[user_history_view, item_features_view],
        description="User history + item features for the Diffusion-GR2 re-ranker.",
        tags={"owner": "gr2"},
    )


reranker_v1 = build_service(user_history, item_features)
