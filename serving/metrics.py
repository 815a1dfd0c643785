"""Prometheus metrics of the predictor, on KServe's own `/metrics` (kserve's REST server exposes
prometheus_client's default registry; the InferenceService's `serving.kserve.io/enable-prometheus-scraping`
annotation has Knative's queue-proxy merge them into what Prometheus scrapes).

| metric | type | labels | what |
|---|---|---|---|
| `gr2_requests_total` | counter | status, decoder | predict requests by HTTP status ("200", "400", "413", "500") and decoder: "diffusion" / "ar", "mixed" when a request's instances differ, "unknown" when it failed before an answer |
| `gr2_request_latency_seconds` | histogram | decoder | latency of answered requests (queue + model); failures are counted above |
| `gr2_batch_size` | histogram | decoder | instances per model call (the micro-batch) |
| `gr2_queue_seconds` | histogram | decoder | how long an instance waited for its batch |
| `gr2_tokens_per_forward` | histogram | decoder | tokens generated per forward pass, per ranking of a decoding model (nfe > 0) |
| `gr2_rankings_total` | counter | decoder, outcome | rankings served, outcome "valid" or "fallback" (validity = valid / all) |
| `gr2_cold_start_rankings_total` | counter | decoder | of those, rankings the cold-start ranker made (a user without known history; the decoder asked for) |
| `gr2_shared_decode_failures_total` | counter | decoder | shared decode steps (or batched rank() calls) that failed, so that each of their requests ran alone: answered, but slower; any rate is a bug to look for in the logs |
| `gr2_decoding_process_restarts_total` | counter | | decoding processes that died (their requests got 503) and were started again |

Every series is created at import for the known label values, so a rate over a window that starts before the
first request still counts the first increment. The canary analysis (deploy/canary.py) queries these names.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kserve.errors import InvalidInput
from prometheus_client import Counter, Histogram

from gr2.inference import DECODERS
from serving.schema import BadRequest

REQUESTS = Counter("gr2_requests", "Predict requests by HTTP status and decoder", ["status", "decoder"])
LATENCY = Histogram(
    "gr2_request_latency_seconds",
    "Latency of answered predict requests (queue + model)",
    ["decoder"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
BATCH_SIZE = Histogram(
    "gr2_batch_size", "Instances per model call", ["decoder"], buckets=(1, 2, 4, 8, 16, 32, 64, 128)
)
QUEUE = Histogram(
    "gr2_queue_seconds",
    "Time an instance waited for its micro-batch",
    ["decoder"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
TOKENS_PER_FORWARD = Histogram(
    "gr2_tokens_per_forward",
    "Tokens generated per forward pass, per ranking",
    ["decoder"],
    buckets=(1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16),
)
RANKINGS = Counter("gr2_rankings", "Rankings served, valid or fallback", ["decoder", "outcome"])
COLD_START = Counter(
    "gr2_cold_start_rankings", "Rankings made by the cold-start ranker (no known history)", ["decoder"]
)

SHARED_FAILURES = Counter(
    "gr2_shared_decode_failures",
    "Shared decode steps or batched rank() calls that failed (each of their requests then ran alone)",
    ["decoder"],
)
PROCESS_RESTARTS = Counter(
    "gr2_decoding_process_restarts", "Decoding processes that died and were started again"
)

UNKNOWN, MIXED = "unknown", "mixed"
for _d in (*DECODERS, MIXED):
    REQUESTS.labels("200", _d)
    for _m in (LATENCY, BATCH_SIZE, QUEUE, TOKENS_PER_FORWARD):
        _m.labels(_d)
    for _o in ("valid", "fallback"):
        RANKINGS.labels(_d, _o)
    COLD_START.labels(_d)
    SHARED_FAILURES.labels(_d)
for _s in ("400", "413", "500"):
    REQUESTS.labels(_s, UNKNOWN)


def answers(result: Any) -> list[dict[str, Any]]:
    """The predictions of a v1 answer ({"predictions": [...]}) or a v2 InferResponse (JSON strings)."""
    if isinstance(result, dict):
        return result["predictions"]
    return [json.loads(d) for d in result.outputs[0].data]


def observe_request(status: str, predictions: list[dict[str, Any]], seconds: float) -> None:
    decoders = {p["decoder"] for p in predictions}
    decoder = decoders.pop() if len(decoders) == 1 else (MIXED if decoders else UNKNOWN)
    REQUESTS.labels(status, decoder).inc()
    if status != "200":
        return
    LATENCY.labels(decoder).observe(seconds)
    for p in predictions:
        RANKINGS.labels(p["decoder"], "valid" if p["valid"] else "fallback").inc()
        if p.get("ranker") == "cold_start":
            COLD_START.labels(p["decoder"]).inc()
        if p["nfe"]:
            TOKENS_PER_FORWARD.labels(p["decoder"]).observe(p["n_tokens"] / p["nfe"])


def instrument_predict(predict: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Decorate a kserve.Model `predict`: status (InvalidInput = 400, BadRequest its 4xx, any other error = 500),
    latency and what each answered prediction says (decoder, valid / fallback, tokens per forward)."""

    @functools.wraps(predict)
    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            result = await predict(self, *args, **kwargs)
        except (InvalidInput, BadRequest) as e:  # the client's input: 400 (or the BadRequest's 4xx)
            observe_request(
                str(e.status) if isinstance(e, BadRequest) else "400", [], time.perf_counter() - t0
            )
            raise
        except Exception:
            observe_request("500", [], time.perf_counter() - t0)
            raise
        observe_request("200", answers(result), time.perf_counter() - t0)
        return result

    return wrapper


def observe_batch(decoder: str, queue_seconds: list[float]) -> None:
    """One model call of the micro-batcher: its size and each instance's wait."""
    BATCH_SIZE.labels(decoder).observe(len(queue_seconds))
    for q in queue_seconds:
        QUEUE.labels(decoder).observe(q)


def observe_shared_failure(decoder: str) -> None:
    """A shared decode step or batched rank() call failed: each of its requests runs alone."""
    SHARED_FAILURES.labels(decoder).inc()


def observe_rejected(status: int) -> None:
    """A request refused before the model saw it (the body guard's 413 / 400)."""
    REQUESTS.labels(str(status), UNKNOWN).inc()
