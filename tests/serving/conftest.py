"""Serving fixtures: a Feast repo with a sqlite online store (contract names: entities user/item, views
user_history/item_features, service reranker_v1), and the transformer in front of the session predictor as a
real HTTP server on 127.0.0.1 in a subprocess. The data slice, the toy model and the predictor are shared with
tests/deploy: tests/serving/support.py, registered by tests/conftest.py."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pandas as pd
import pytest

from serving.serve_local import stop
from tests.serving.support import start


def build_feast_repo(ml_slice: dict, root: Path) -> Path:
    """A Feast repo in `root`, applied and written through the SDK (no CLI: `feast apply` imports every .py
    file)."""
    from feast import Entity, FeatureService, FeatureStore, FeatureView, Field, FileSource
    from feast.types import Array, Int64, String
    from feast.value_type import ValueType

    root.mkdir(parents=True, exist_ok=True)
    (root / "feature_store.yaml").write_text(
        "project: gr2\nprovider: local\nregistry: registry.db\n"
        "online_store: {type: sqlite, path: online.db}\noffline_store: {type: file}\n"
        "entity_key_serialization_version: 3\n"
    )
    now = pd.Timestamp(dt.datetime.now(dt.UTC))
    hist = pd.DataFrame(
        {
            "user_id": list(ml_slice["history"]),
            "history": list(ml_slice["history"].values()),
            "history_len": [len(h) for h in ml_slice["history"].values()],
            "event_timestamp": now,
        }
    )
    items = ml_slice["items"]
    feats = pd.DataFrame(
        {
            "item_id": items["item_id"],
            "title": items["title"],
            "categories": [c.split("|") if c else [] for c in items["categories"]],
            "event_timestamp": now,
        }
    )
    hist.to_parquet(root / "user_history.parquet")
    feats.to_parquet(root / "item_features.parquet")
    user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.STRING)
    item = Entity(name="item", join_keys=["item_id"], value_type=ValueType.STRING)
    ttl = dt.timedelta(days=3650)
    uh = FeatureView(
        name="user_history",
        entities=[user],
        ttl=ttl,
        schema=[Field(name="history", dtype=Array(String)), Field(name="history_len", dtype=Int64)],
        source=FileSource(path=str(root / "user_history.parquet"), timestamp_field="event_timestamp"),
    )
    itf = FeatureView(
        name="item_features",
        entities=[item],
        ttl=ttl,
        schema=[Field(name="title", dtype=String), Field(name="categories", dtype=Array(String))],
        source=FileSource(path=str(root / "item_features.parquet"), timestamp_field="event_timestamp"),
    )
    store = FeatureStore(repo_path=str(root))
    services = [
        FeatureService(name="reranker_v1", features=[uh, itf]),
        FeatureService(name="reranker_serving_v1", features=[uh[["history"]], itf[["title"]]]),
    ]
    store.apply([user, item, uh, itf, *services])
    store.write_to_online_store("user_history", hist)
    store.write_to_online_store("item_features", feats)
    return root


@pytest.fixture(scope="session")
def feast_repo(ml_slice, tmp_path_factory):
    return build_feast_repo(ml_slice, tmp_path_factory.mktemp("feature_repo"))


@pytest.fixture(scope="session")
def transformer(predictor, feast_repo, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "transformer.log"
    args = ["--role", "transformer", "--predictor_host", f"127.0.0.1:{predictor['port']}"]
    # --max_candidates: the model's N: more is refused before any feature lookup
    proc, port = start([*args, "--feast_repo", str(feast_repo), "--max_candidates", "10"], log)
    yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "log": log}
    stop(proc)


@pytest.fixture(scope="module")
def items(ml_slice):
    return list(ml_slice["items"]["item_id"])


@pytest.fixture(scope="module", params=["predictor", "transformer"])
def server(request, predictor):
    """Each test runs against the predictor alone and against the transformer in front of it."""
    if request.param == "predictor":
        return {"name": "predictor", **predictor}
    return {"name": "transformer", **request.getfixturevalue("transformer")}
