"""Feature services over the two views.

`reranker_v1`: user history + item features, the training side (extraction's point-in-time join reads its user
features). `reranker_serving_v1`: what the serving transformer reads online, one row per (user, candidate): the
user's `history` from the same `user_history` view (no training/serving skew) and the candidate's `title`, which
is null exactly when the item has no catalogue row (the transformer's unknown-item check). Serving does not
fetch the evidence columns: the model reads the evidence it was trained with from its own bundle
(docs/DATAFLOW.md).
"""

from feast import FeatureService, FeatureView
from features import item_features, user_history  # feast imports repo files with the repo folder on sys.path

SERVICE_NAME = "reranker_v1"
SERVING_SERVICE_NAME = "reranker_serving_v1"


def build_services(user_history_view: FeatureView, item_features_view: FeatureView) -> list[FeatureService]:
    return [
        FeatureService(
            name=SERVICE_NAME,
            features=[user_history_view, item_features_view],
            description="User history + item features for the Diffusion-GR2 re-ranker.",
            tags={"owner": "gr2"},
        ),
        FeatureService(
            name=SERVING_SERVICE_NAME,
            features=[user_history_view[["history"]], item_features_view[["title"]]],
            description="What the serving transformer reads: each user's history and each candidate's title.",
            tags={"owner": "gr2"},
        ),
    ]


reranker_v1, reranker_serving_v1 = build_services(user_history, item_features)
