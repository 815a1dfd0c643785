"""The predictor's Prometheus metrics (serving/metrics.py): in process, what each kind of answer records; over
HTTP, that KServe's /metrics shows them after real traffic (requests by status and decoder, latency, batch
size, queue time, tokens per forward, valid / fallback rankings)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from kserve.protocol.infer_type import InferInput, InferRequest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from gr2.inference import RankResult
from serving.predictor import RerankPredictor
from serving.schema import BadRequest, ServeConfig
from tests.serving.support import MODEL


class StubReranker:
    """Decodes 12 tokens in 3 forwards; the user "fallback" gets an invalid (fallback) answer, "crash" an error."""

    name, n_candidates = "stub", 10

    def known_item(self, item_id):
        return True

    def rank(self, requests, decoder="diffusion", tau=0.9):
        if any(r.user_id == "crash" for r in requests):
            raise RuntimeError("model failed")
        return [
            RankResult(list(r.candidates), r.user_id != "fallback", None, nfe=3, n_tokens=12, trace=None)
            for r in requests
        ]


def value(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_each_answer_is_recorded():
    model = RerankPredictor("stub", reranker=StubReranker())
    names = [
        ("gr2_requests_total", {"status": "200", "decoder": "diffusion"}),
        ("gr2_requests_total", {"status": "200", "decoder": "ar"}),
        ("gr2_requests_total", {"status": "200", "decoder": "mixed"}),
        ("gr2_requests_total", {"status": "400", "decoder": "unknown"}),
        ("gr2_requests_total", {"status": "500", "decoder": "unknown"}),
        ("gr2_rankings_total", {"decoder": "diffusion", "outcome": "valid"}),
        ("gr2_rankings_total", {"decoder": "diffusion", "outcome": "fallback"}),
        ("gr2_rankings_total", {"decoder": "ar", "outcome": "valid"}),
        ("gr2_request_latency_seconds_count", {"decoder": "diffusion"}),
        ("gr2_tokens_per_forward_sum", {"decoder": "diffusion"}),
        ("gr2_tokens_per_forward_count", {"decoder": "diffusion"}),
        ("gr2_batch_size_count", {"decoder": "diffusion"}),
        ("gr2_queue_seconds_count", {"decoder": "diffusion"}),
    ]
    before = [value(n, **lab) for n, lab in names]

    def inst(user, decoder="diffusion"):
        return {"user_id": user, "candidates": ["a", "b", "c"], "decoder": decoder}

    async def traffic():
        await model.predict({"instances": [inst("u1"), inst("fallback")]})  # v1: 2 diffusion rankings
        v2 = InferRequest(
            model_name="stub",
            infer_inputs=[InferInput("instances", [1], "BYTES", [json.dumps(inst("u2", "ar"))])],
        )
        await model.predict(v2)  # v2: 1 ar ranking
        await model.predict({"instances": [inst("u3"), inst("u4", "ar")]})  # mixed
        with pytest.raises(BadRequest):
            await model.predict({"instances": [{"user_id": "u5"}]})  # no candidates: 400
        with pytest.raises(RuntimeError):
            await model.predict({"instances": [inst("crash")]})  # the model fails: 500

    asyncio.run(traffic())
    got = [value(n, **lab) - b for (n, lab), b in zip(names, before, strict=True)]
    assert got[:5] == [1, 1, 1, 1, 1]  # requests by status and decoder
    assert got[5:8] == [2, 1, 2]  # diffusion valid (u1, u3), diffusion fallback, ar valid (u2, u4)
    assert got[8] == 1  # latency of the answered all-diffusion request
    assert got[9:11] == [3 * 4.0, 3]  # 12 tokens / 3 forwards for u1, fallback, u3
    assert got[11] >= 2 and got[12] == 4  # batches (u1+fallback may share one), every instance's queue wait


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("gr2_")
    }


def test_metrics_endpoint_shows_them_after_traffic(predictor, ml_slice):
    from serving.serve_local import wait_ready

    url = predictor["url"]
    wait_ready(f"{url}/v1/models/{MODEL}", timeout_s=300, proc=predictor["proc"])  # a loaded CI machine
    items = list(ml_slice["items"]["item_id"])[:5]
    before = scrape(url)
    with httpx.Client(timeout=30) as http:
        for decoder in ("diffusion", "diffusion", "ar"):
            inst = {"user_id": "1", "candidates": items, "decoder": decoder}
            assert (
                http.post(f"{url}/v1/models/{MODEL}:predict", json={"instances": [inst]}).status_code == 200
            )
        bad = {"instances": [{"user_id": "1", "candidates": ["nope", "nada"]}]}
        assert http.post(f"{url}/v1/models/{MODEL}:predict", json=bad).status_code == 400
        # over the predictor's limit, which also allows the histories a transformer adds
        big = b'{"instances": [' + b" " * (ServeConfig().forwarded_body_bytes() + 1024) + b"]}"
        r = http.post(
            f"{url}/v1/models/{MODEL}:predict", content=big, headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
    after = scrape(url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("gr2_requests_total", status="200", decoder="diffusion") == 2
    assert delta("gr2_requests_total", status="200", decoder="ar") == 1
    assert delta("gr2_requests_total", status="400", decoder="unknown") == 1
    assert delta("gr2_requests_total", status="413", decoder="unknown") == 1
    assert delta("gr2_request_latency_seconds_count", decoder="diffusion") == 2
    assert delta("gr2_request_latency_seconds_bucket", decoder="ar", le="+Inf") == 1
    assert delta("gr2_rankings_total", decoder="diffusion", outcome="valid") == 2
    assert delta("gr2_batch_size_count", decoder="diffusion") == 2
    assert delta("gr2_queue_seconds_count", decoder="ar") == 1
    # the floor model decodes nothing (nfe 0): the series is exposed, with nothing observed
    assert ("gr2_tokens_per_forward_count", (("decoder", "diffusion"),)) in after
    assert delta("gr2_tokens_per_forward_count", decoder="diffusion") == 0
