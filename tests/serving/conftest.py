"""Shared serving fixtures: a real data slice, a floor model directory, a Feast repo with a sqlite online
store (contract names: entities user/item, views user_history/item_features, service reranker_v1), and the
predictor + transformer running as real HTTP servers on 127.0.0.1 in subprocesses."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from gr2.inference import FloorReranker
from serving.serve_local import start_server, stop

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "ml-latest-small"
N_USERS = 200
H = 20
MODEL = "reranker"


# The fixtures below that run server processes: a test that uses one (directly or through another fixture)
# is a `server` test, which `make test-fast` leaves out.
SERVER_FIXTURES = {"predictor", "transformer", "server", "edge", "revisions", "prometheus"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)


def load_ml_slice() -> dict:
    """First 200 users of ml-latest-small: interactions in seq order, their items, and each user's last H."""
    inter = pd.read_csv(DATA / "interactions.tsv", sep="\t", dtype={"user_id": str, "item_id": str})
    users = inter["user_id"].drop_duplicates().head(N_USERS)
    inter = inter[inter["user_id"].isin(users)].sort_values(["user_id", "seq_idx"])
    items = pd.read_csv(DATA / "items.tsv", sep="\t", dtype=str, keep_default_na=False)
    items = items[items["item_id"].isin(set(inter["item_id"]))].reset_index(drop=True)
    history = {u: list(g["item_id"])[-H:] for u, g in inter.groupby("user_id", sort=False)}
    return {"interactions": inter, "items": items, "history": history}


@pytest.fixture(scope="session")
def ml_slice():
    return load_ml_slice()


@pytest.fixture(scope="session")
def model_dir(ml_slice, tmp_path_factory):
    return FloorReranker(name="floor", n_candidates=10, items=ml_slice["items"]["item_id"]).save(
        tmp_path_factory.mktemp("model")
    )


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    """`python -m serving.serve_local <args>`, not waited for."""
    return subprocess.Popen(
        [sys.executable, "-m", "serving.serve_local", *args],
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def start(args: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    """`python -m serving.serve_local <args> --port P` on a free port (retried if another process takes it),
    once /v1/models/<MODEL> answers."""
    return start_server(
        lambda port: [sys.executable, "-m", "serving.serve_local", *args, "--port", str(port)],
        lambda port: f"http://127.0.0.1:{port}/v1/models/{MODEL}",
        log,
        cwd=ROOT,
    )


@pytest.fixture(scope="session")
def predictor(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "predictor.log"
    proc, port = start(["--role", "predictor", "--model_uri", str(model_dir)], log)
    yield {"url": f"http://127.0.0.1:{port}", "port": port, "proc": proc, "log": log}
    stop(proc)


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
    proc, port = start([*args, "--feast_repo", str(feast_repo)], log)
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
