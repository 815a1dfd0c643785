"""The KServe predictor: a `kserve.Model` serving any `gr2.inference.Reranker` over v1 and v2.

v1: POST /v1/models/<name>:predict  {"instances": [{user_id, candidates, history?, decoder?, tau?, trace?}],
                                     "parameters"?: {decoder?, tau?, trace?}}  -> {"predictions": [...]}
v2: POST /v2/models/<name>/infer    one BYTES input whose elements are the same instance objects as JSON
                                     strings; request "parameters" as in v1 -> one BYTES output "predictions".
Each prediction: ranking (item ids, best first), valid / fallback, reason, nfe, n_tokens, decoder, tau,
timing_ms {queue, model, total}, batch_size, history_len, history_unknown_dropped, and trace when asked for.

The model loads from a local directory or a storage URI (s3://bucket/prefix, file://path); in a cluster the
KServe storage initializer has already copied `storageUri` to /mnt/models. Decoding runs in the micro-batcher
(serving/batcher.py), so `predict` is async and never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import kserve
from kserve.errors import InvalidInput
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse

from gr2.inference import DECODERS, Reranker, load_reranker
from serving import metrics
from serving.batcher import MicroBatcher
from serving.schema import (
    BadRequest,
    ServeConfig,
    format_result,
    parse_instance,
    parse_options,
    v1_body,
    v2_instances,
)


def fetch_model_dir(uri: str, cache_dir: str | Path | None = None) -> Path:
    """A local directory holding the model: `uri` itself, or a download of an s3:// prefix (S3_ENDPOINT_URL)."""
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    if not uri.startswith("s3://"):
        return Path(uri)
    import boto3  # lazy: only storage URIs need it
    from botocore.config import Config

    bucket, _, prefix = uri[len("s3://") :].partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    dest = Path(cache_dir or tempfile.mkdtemp(prefix="gr2-model-"))
    s3 = boto3.client(
        "s3",
        endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None,
        config=Config(s3={"addressing_style": "path"}),
    )
    n = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix) :]
            if not rel or rel.endswith("/"):
                continue
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(out))
            n += 1
    if n == 0:
        raise FileNotFoundError(f"{uri}: no objects under this prefix")
    return dest


class RerankPredictor(kserve.Model):
    def __init__(
        self,
        name: str,
        model_uri: str | None = None,
        reranker: Reranker | None = None,
        cfg: ServeConfig | None = None,
    ):
        super().__init__(name)
        if (model_uri is None) == (reranker is None):
            raise ValueError("pass exactly one of model_uri or reranker")
        self.model_uri = model_uri
        self.reranker = reranker
        self.cfg = cfg or ServeConfig()
        self.batcher: MicroBatcher | None = None
        if reranker is not None:
            self.load()

    def load(self) -> bool:
        if self.reranker is None:
            self.reranker = load_reranker(fetch_model_dir(self.model_uri))
        self.batcher = MicroBatcher(self.reranker.rank, self.cfg.max_batch, self.cfg.max_wait_ms)
        self.ready = True
        return self.ready

    async def rank_instances(
        self, instances: list[Any], params: dict[str, Any], where: str
    ) -> list[dict[str, Any]]:
        """Validate every instance first (all-or-nothing), then decode them concurrently via the batcher."""
        t0 = time.perf_counter()
        base = parse_options(params, "parameters", self.cfg)
        parsed = [
            parse_instance(raw, f"{where}[{i}]", self.reranker, self.cfg, base)
            for i, raw in enumerate(instances)
        ]
        # The decoders this model can run: e.g. "spec" needs a model that carries its verifier.
        can = getattr(self.reranker, "decoders", DECODERS)
        for i, (_, opts, _) in enumerate(parsed):
            if opts.decoder not in can:
                raise BadRequest(
                    f"{where}[{i}].decoder: {opts.decoder!r} is not available for this model ({list(can)})"
                )
        timed = await asyncio.gather(*(self.batcher.submit(req, o.decoder, o.tau) for req, o, _ in parsed))
        total = (time.perf_counter() - t0) * 1000
        return [
            format_result(
                req,
                t.result,
                opts,
                self.reranker.name,
                {"queue": round(t.queue_ms, 3), "model": round(t.model_ms, 3), "total": round(total, 3)},
                {
                    "batch_size": t.batch_size,
                    "history_len": len(req.history),
                    "history_unknown_dropped": dropped,
                },
            )
            for (req, opts, dropped), t in zip(parsed, timed, strict=True)
        ]

    def validate(self, payload: Any) -> Any:
        # our own parser validates (and names fields consistently for v1 and v2); skip kserve's shallow check
        return payload

    @metrics.instrument_predict  # requests by status and decoder, latency, validity, tokens per forward
    async def predict(
        self, payload: dict | InferRequest | bytes, headers: dict[str, str] | None = None
    ) -> dict | InferResponse:
        try:
            if isinstance(payload, InferRequest):
                instances, params = v2_instances(payload, self.cfg)
                preds = await self.rank_instances(instances, params, "inputs[0].data")
                data = [json.dumps(p) for p in preds]
                return InferResponse(
                    model_name=self.name,
                    infer_outputs=[
                        InferOutput(name="predictions", shape=[len(data)], datatype="BYTES", data=data)
                    ],
                    response_id=payload.id or str(uuid.uuid4()),  # kserve 500s on a None id (STACK.md §3)
                )
            instances, params = v1_body(payload, self.cfg)
            return {"predictions": await self.rank_instances(instances, params, "instances")}
        except BadRequest as e:
            raise InvalidInput(str(e)) from e
