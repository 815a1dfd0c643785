"""Over real HTTP on 127.0.0.1: the predictor alone and the full transformer (Feast sqlite) -> predictor path,
v1 and v2, every bad input, and the server staying up afterwards."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serving.schema import ServeConfig
from tests.serving.support import MODEL

GOOD_USER = "1"


def v1(base: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    return httpx.post(
        f"{base}/v1/models/{MODEL}:predict",
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
        **kw,
    )


def v2(base: str, instances: list, parameters: dict | None = None, datatype: str = "BYTES") -> httpx.Response:
    body = {
        "inputs": [
            {
                "name": "instances",
                "shape": [len(instances)],
                "datatype": datatype,
                "data": [json.dumps(i) for i in instances],
            }
        ]
    }
    if parameters:
        body["parameters"] = parameters
    return httpx.post(f"{base}/v2/models/{MODEL}/infer", json=body, timeout=30)


def v2_predictions(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["name"] == "predictions" and out["datatype"] == "BYTES"
    return [json.loads(d) for d in out["data"]]


def test_v1_ranks_each_instance_with_its_own_candidates(server, items, ml_slice):
    cands = items[5:15]
    r = v1(
        server["url"],
        {
            "instances": [
                {"user_id": GOOD_USER, "candidates": cands, "history": ml_slice["history"][GOOD_USER]},
                {"user_id": "2", "candidates": cands[::-1], "history": [], "trace": True},
            ]
        },
    )
    assert r.status_code == 200, r.text
    p0, p1 = r.json()["predictions"]
    assert sorted(p0["ranking"]) == sorted(p1["ranking"]) == sorted(cands)
    assert p0["fallback"] is (not p0["valid"]) and p0["model"] == "toy" and p0["ranker"] == "model"
    assert p0["nfe"] > 0 and p0["n_tokens"] > 0  # the generative model decoded it
    assert p0["decoder"] == "diffusion" and p0["tau"] == 0.5  # defaults: the bundle's operating tau
    assert (
        p0["history_len"] == 20 and p1["history_len"] == 0
    )  # a client-sent history wins, also via transformer
    # no history: the bundle's cold-start ranker (always valid, nothing decoded)
    assert p1["ranker"] == "cold_start" and p1["valid"] is True and p1["nfe"] == 0
    assert (
        "trace" not in p0 and p1["trace"] is None
    )  # trace only on request (the cold-start ranker writes none)
    assert set(p0["timing_ms"]) == {"queue", "model", "total"} and p0["batch_size"] >= 1


def test_v2_with_parameters(server, items):
    cands = items[20:24]
    preds = v2_predictions(
        v2(
            server["url"],
            [{"user_id": GOOD_USER, "candidates": cands, "history": []}],
            parameters={"decoder": "ar"},
        )
    )
    assert (
        sorted(preds[0]["ranking"]) == sorted(cands)
        and preds[0]["decoder"] == "ar"
        and preds[0]["tau"] is None
    )
    preds = v2_predictions(
        v2(server["url"], [{"user_id": GOOD_USER, "candidates": cands, "tau": 0.4, "history": []}])
    )
    assert preds[0]["tau"] == 0.4


def test_transformer_fetches_history_from_feast(transformer, ml_slice, items):
    cands = items[30:40]
    for u in ["1", "7", "150"]:
        r = v1(transformer["url"], {"instances": [{"user_id": u, "candidates": cands}]})
        assert r.status_code == 200, r.text
        p = r.json()["predictions"][0]
        assert p["history_len"] == len(ml_slice["history"][u]) == min(20, len(ml_slice["history"][u]))
        assert sorted(p["ranking"]) == sorted(cands) and p["ranker"] == "model"
    preds = v2_predictions(v2(transformer["url"], [{"user_id": "1", "candidates": cands}]))
    assert preds[0]["history_len"] == len(ml_slice["history"]["1"])
    # an unknown user is served with an empty history (the default policy)
    r = v1(transformer["url"], {"instances": [{"user_id": "no-such-user", "candidates": cands}]})
    assert r.status_code == 200 and r.json()["predictions"][0]["history_len"] == 0
    assert r.json()["predictions"][0]["ranker"] == "cold_start"


BAD_INSTANCES = [
    (
        "unknown item",
        lambda it: {"user_id": "1", "candidates": [it[0], "no-such-item"], "history": []},
        "candidates[1]",
    ),
    (
        "duplicate",
        lambda it: {"user_id": "1", "candidates": [it[0], it[1], it[0]], "history": []},
        "candidates[2]: duplicate",
    ),
    ("too many", lambda it: {"user_id": "1", "candidates": it[:11], "history": []}, "candidates: too many"),
    ("too few", lambda it: {"user_id": "1", "candidates": it[:1], "history": []}, "candidates: too few"),
    ("user_id type", lambda it: {"user_id": 5, "candidates": it[:3], "history": []}, "user_id"),
    (
        "candidates type",
        lambda it: {"user_id": "1", "candidates": ",".join(it[:3]), "history": []},
        "candidates",
    ),
    ("candidate type", lambda it: {"user_id": "1", "candidates": [it[0], 7], "history": []}, "candidates[1]"),
    ("history type", lambda it: {"user_id": "1", "candidates": it[:3], "history": "abc"}, "history"),
    ("tau type", lambda it: {"user_id": "1", "candidates": it[:3], "history": [], "tau": "high"}, "tau"),
    (
        "tau bounds",
        lambda it: {"user_id": "1", "candidates": it[:3], "history": [], "tau": 0.0},
        "tau: must be within",
    ),
    (
        "decoder",
        lambda it: {"user_id": "1", "candidates": it[:3], "history": [], "decoder": "beam"},
        "decoder",
    ),
    (
        "typo field",
        lambda it: {"user_id": "1", "candidates": it[:3], "history": [], "taus": 0.5},
        "taus: unknown field",
    ),
    ("not an object", lambda it: ["1", it[:3]], "expected an object"),
]


@pytest.mark.parametrize("case", BAD_INSTANCES, ids=[c[0] for c in BAD_INSTANCES])
def test_bad_instances_v1_and_v2(server, items, case):
    _, make, field = case
    inst = make(items)
    r = v1(server["url"], {"instances": [{"user_id": "1", "candidates": items[:3], "history": []}, inst]})
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("instances[1].") or r.json()["error"].startswith("instances[1]:")
    assert field in r.json()["error"]
    r = v2(server["url"], [inst])
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("inputs[0].data[0]") and field in r.json()["error"]


def test_bad_requests(server, items):
    url = server["url"]
    r = v1(url, b'{"instances": [{"user_id": "1", "candidates": [')
    assert r.status_code == 400 and r.json()["error"].startswith("body: malformed JSON")
    r = httpx.post(
        f"{url}/v2/models/{MODEL}/infer",
        content=b'{"inputs": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"].startswith("body: malformed JSON")
    r = v1(url, {"instances": {"user_id": "1"}})
    assert r.status_code == 400 and r.json()["error"].startswith("instances: must be a list")
    r = v1(url, {"instance": []})
    assert r.status_code == 400 and r.json()["error"].startswith("instances: missing")
    r = v1(url, {"instances": []})
    assert r.status_code == 400 and "instances: empty" in r.json()["error"]
    r = v1(url, {"instances": [{"user_id": "1", "candidates": items[:3]}] * 65})
    assert r.status_code == 400 and "instances: too many instances" in r.json()["error"]
    r = v1(
        url, {"instances": [{"user_id": "1", "candidates": items[:3]}], "parameters": {"decoder": "greedy"}}
    )
    assert r.status_code == 400 and r.json()["error"].startswith("parameters.decoder")
    r = v2(url, [{"user_id": "1", "candidates": items[:3]}], datatype="FP32")
    assert r.status_code == 400 and r.json()["error"].startswith("inputs[0].datatype")
    r = httpx.post(
        f"{url}/v2/models/{MODEL}/infer",
        timeout=30,
        json={"inputs": [{"name": "instances", "shape": [1], "datatype": "BYTES", "data": ["{not json"]}]},
    )
    assert r.status_code == 400 and r.json()["error"].startswith("inputs[0].data[0]: malformed JSON")
    # the predictor's limit also allows the histories a transformer in front of it adds
    cfg = ServeConfig()
    limit = cfg.max_body_bytes if server["name"] == "transformer" else cfg.forwarded_body_bytes()
    r = v1(
        url,
        {"instances": [{"user_id": "1", "candidates": items[:3], "history": ["x" * 100] * (limit // 100)}]},
    )
    assert r.status_code == 413 and r.json()["error"].startswith("body: payload of")
    # the server is still up and serving
    assert server["proc"].poll() is None
    r = v1(url, {"instances": [{"user_id": "1", "candidates": items[:3]}]})
    assert r.status_code == 200 and sorted(r.json()["predictions"][0]["ranking"]) == sorted(items[:3])


def test_concurrent_requests_are_answered_each_with_its_own_result(server, items):
    def one(k: int) -> tuple[list[str], list[str]]:
        cands = items[k : k + 10][::-1] if k % 2 else items[k : k + 10]
        r = v1(server["url"], {"instances": [{"user_id": str(k + 1), "candidates": cands}]})
        assert r.status_code == 200, r.text
        return cands, r.json()["predictions"][0]["ranking"]

    with ThreadPoolExecutor(8) as pool:
        for sent, got in pool.map(one, range(32)):
            assert sorted(got) == sorted(sent)
